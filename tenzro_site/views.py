"""Site health check (the console pages live in ``tenzro_site.console``)."""
from __future__ import annotations

from django.db import DatabaseError
from django.http import JsonResponse

from registry import selectors


def healthz(request):
    """``GET /healthz``: 200 while the site answers and its database is reachable, with
    ``{"ok": true, **registry.selectors.health()}``: ``status`` "ok" or "degraded" (holders
    failing, experts under-replicated; ``problems`` says which). 503 ``{"ok": false, "status":
    "down", "error"}`` when the database cannot be read."""
    try:
        body = selectors.health()
    except DatabaseError as exc:
        return JsonResponse({"ok": False, "status": "down", "error": f"database unreachable: {type(exc).__name__}"},
                            status=503)
    return JsonResponse({"ok": True, **body})
