"""Site health check and Prometheus metrics (the console pages live in ``tenzro_site.console``)."""
from __future__ import annotations

import os

from django.conf import settings
from django.db import DatabaseError
from django.http import HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt

from registry import selectors
from router.apps import current
from tenzro_site.celery import cached_queue_workers


@csrf_exempt  # a POST gets the JSON 405 below, not the CSRF failure page
def healthz(request):
    """``GET /healthz``: 200 while the site answers and its database is reachable, with
    ``{"ok": true, "deployment", "pid", **registry.selectors.health()}`` (``pid``: the site
    process that answered, behind a balancer one of several): ``status`` "ok" or "degraded" (holders
    failing, experts under-replicated, and with a broker configured no Celery worker on the
    task queue: ``celery_workers``, asked at most every 10 s, 2 s while none answers;
    ``problems`` says which). 503 ``{"ok": false, "status": "down", "error"}`` when the database
    cannot be read. Another method: JSON 405."""
    if request.method not in ("GET", "HEAD"):
        return JsonResponse({"error": f"{request.method} is not allowed on /healthz; use GET"}, status=405,
                            headers={"Allow": "GET, HEAD"})
    try:
        body = selectors.health()
    except DatabaseError as exc:
        return JsonResponse({"ok": False, "status": "down", "error": f"database unreachable: {type(exc).__name__}"},
                            status=503)
    if not settings.CELERY_TASK_ALWAYS_EAGER:  # a broker is configured: someone must consume its queue
        body["celery_workers"] = cached_queue_workers()
        if not body["celery_workers"]:
            body["problems"].append(f"no Celery worker consumes the task queue {settings.CELERY_TASK_DEFAULT_QUEUE!r}: "
                                    "prepare jobs, settlements and sweeps are not running")
            body["status"] = "degraded"
    return JsonResponse({"ok": True, "deployment": settings.TENZRO["DEPLOYMENT"], "pid": os.getpid(), **body})


@csrf_exempt  # a POST gets the JSON 405 below, not the CSRF failure page
def metrics(request):
    """``GET /metrics``: Prometheus text exposition of this site process's serving metrics
    (``router.metrics.ServingMetrics``: sequences running and waiting, tokens, TTFT and
    inter-token histograms, step rows and time, KV cache use, holder batch latency and
    failures per provider).

    Unauthenticated, like the console's read-only pages that show the same numbers: it
    names providers and timings, nothing secret. Operators who want it private scrape it on
    a private interface or block the path at their proxy. Each site process has its own
    numbers: scrape every process. Another method: JSON 405."""
    if request.method not in ("GET", "HEAD"):
        return JsonResponse({"error": f"{request.method} is not allowed on /metrics; use GET"}, status=405,
                            headers={"Allow": "GET, HEAD"})
    m = current().metrics
    return HttpResponse(m.exposition(), content_type=m.CONTENT_TYPE)


@csrf_exempt  # no state changes: a POST gets the same JSON 404, not the CSRF failure page
def api_not_found(request, rest: str = ""):
    """Any ``/api/`` path no route serves: JSON ``{"error"}`` 404 (Kvasir contract §1.0: never an
    HTML error page). A GET/HEAD for a path that exists with a trailing slash (``/api/docs``)
    is redirected there, as Django's ``APPEND_SLASH`` would have done without this catch-all;
    other methods are never redirected (a redirected POST loses its body)."""
    from django.http import HttpResponsePermanentRedirect
    from django.urls import Resolver404, resolve

    if request.method in ("GET", "HEAD") and not request.path.endswith("/"):
        try:
            match = resolve(request.path + "/")
        except Resolver404:
            match = None
        if match is not None and match.url_name != "api-not-found":
            query = request.META.get("QUERY_STRING", "")
            return HttpResponsePermanentRedirect(request.path + "/" + (f"?{query}" if query else ""))
    return JsonResponse({"error": f"unknown endpoint {request.method} {request.path}"}, status=404)


def bad_request(request, exception=None):
    """Django's ``handler400`` (a ``SuspiciousOperation`` such as a ``Host`` header outside
    ``ALLOWED_HOSTS``): JSON in the shape of the path's API, never Django's HTML page:
    OpenAI's ``{"error": {message, type, param, code}}`` under ``/v1/``, a JSON-RPC error
    object under ``/rpc``, ``{"error": message}`` elsewhere. A refused host is named with
    the setting that admits it (``TENZRO_ALLOWED_HOSTS``); a body over the site's limit (a view
    reading ``request.body``) is a 413 naming ``TENZRO_MAX_BODY``."""
    from django.core.exceptions import DisallowedHost, RequestDataTooBig

    from tenzro_site.api import body_too_big_message
    from tenzro_site.serve import error_body

    if isinstance(exception, RequestDataTooBig):
        return JsonResponse(error_body(request.path, body_too_big_message(), "body"), status=413)
    if isinstance(exception, DisallowedHost):  # request.get_host() would raise again: the raw header
        host = request.META.get("HTTP_HOST") or request.META.get("SERVER_NAME", "")
        message = (f"Host {host!r} is not allowed on this site; the operator admits it by adding it to "
                   f"TENZRO_ALLOWED_HOSTS (a comma list) and restarting the site")
    else:
        message = f"bad request ({type(exception).__name__})" if exception is not None else "bad request"
    return JsonResponse(error_body(request.path, message), status=400)
