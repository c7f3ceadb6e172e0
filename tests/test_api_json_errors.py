"""Issue 27 item 7: every unknown ``/api/`` path answers JSON ``{"error"}`` (404; 405 for a known
path with the wrong method), never Django's HTML page; no WebSocket handshake answers 500."""
from __future__ import annotations

import pytest
from channels.testing import WebsocketCommunicator

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize("path", ["/api/expert-relay", "/api/expert-dispatch-map/x?model=m", "/api/moe/nope",
                                  "/api/expert-relay/nope", "/api/nope/", "/api/v1/no-such-thing",
                                  "/api/proxy/models/m/nothing"])
@pytest.mark.parametrize("method", ["get", "post", "delete"])
def test_unknown_api_paths_answer_json_404(client, path, method):
    r = getattr(client, method)(path)
    assert r.status_code == 404
    assert r["Content-Type"].startswith("application/json")
    assert r.json()["error"].startswith(f"unknown endpoint {method.upper()} /api/")


def test_known_api_paths_with_the_wrong_method_answer_json_405(client):
    for method, path in [("get", "/api/expert-coverage"), ("post", "/api/expert-demand"),
                         ("delete", "/api/v1/providers")]:
        r = getattr(client, method)(path)
        assert r.status_code == 405, path
        assert r["Content-Type"].startswith("application/json")
        assert r.json().get("error") or r.json().get("detail"), path


def test_slash_redirect_of_get_pages_still_works(client):
    r = client.get("/api/docs?x=1")
    assert r.status_code == 301 and r["Location"] == "/api/docs/?x=1"
    r = client.post("/api/docs")  # a POST is never redirected
    assert r.status_code == 404 and r.json()["error"]


def test_healthz_with_another_method_is_a_json_405_not_the_csrf_page():
    from django.test import Client

    r = Client(enforce_csrf_checks=True).post("/healthz")
    assert r.status_code == 405 and r["Content-Type"].startswith("application/json") and r["Allow"] == "GET, HEAD"
    assert "use GET" in r.json()["error"]


@pytest.mark.parametrize("method", ["post", "put", "delete"])
def test_metrics_with_another_method_is_a_json_405_not_the_csrf_page(method):
    """A scraper or script POSTing to /metrics got Django's HTML CSRF page (403), a PUT an empty 405."""
    from django.test import Client

    r = getattr(Client(enforce_csrf_checks=True), method)("/metrics")
    assert r.status_code == 405 and r["Content-Type"].startswith("application/json") and r["Allow"] == "GET, HEAD"
    assert "use GET" in r.json()["error"]


def test_non_api_paths_keep_their_pages(client):
    assert client.get("/healthz").status_code == 200
    assert not client.get("/no-such-page")["Content-Type"].startswith("application/json")



@pytest.mark.parametrize("method,path", [("get", "/v1/models"), ("post", "/v1/completions"), ("post", "/rpc"),
                                         ("get", "/api/v1/providers"), ("get", "/healthz")])
def test_a_disallowed_host_is_a_json_400_naming_the_host_and_the_setting(client, method, path):
    r = getattr(client, method)(path, HTTP_HOST="evil.com")
    assert r.status_code == 400 and r["Content-Type"].startswith("application/json"), r.content[:200]
    body = r.json()
    if path.startswith("/v1/"):
        err = body["error"]
        assert err["type"] == "invalid_request_error" and set(err) == {"message", "type", "param", "code"}
        message = err["message"]
    elif path == "/rpc":
        assert body["jsonrpc"] == "2.0" and body["id"] is None and body["error"]["code"] == -32600
        message = body["error"]["message"]
    else:
        message = body["error"]
    assert "'evil.com'" in message and "TENZRO_ALLOWED_HOSTS" in message, message


def test_a_disallowed_host_is_logged_in_one_line_without_a_traceback(client):
    """A client-caused ``SuspiciousOperation`` (here a foreign ``Host``) is one log line naming it,
    not Django's 30-line traceback per request (before: any client could flood the site's log)."""
    import io
    import logging

    handlers, logger = [], logging.getLogger("django.security.DisallowedHost")
    while logger is not None:  # every stream handler the record reaches
        handlers += [h for h in logger.handlers if isinstance(h, logging.StreamHandler)]
        logger = logger.parent if logger.propagate else None
    olds = [h.setStream(io.StringIO()) for h in handlers]
    try:
        assert client.get("/v1/models", HTTP_HOST="evil.com").status_code == 400
        logged = "".join(h.stream.getvalue() for h in handlers)
    finally:
        for h, stream in zip(handlers, olds):
            h.setStream(stream)
    assert "evil.com" in logged and "Traceback" not in logged and logged.count("\n") == 1, logged


@pytest.mark.parametrize("path", ["/api/v1/providers/heartbeat", "/api/auth/challenge", "/api/auth/node-token"])
def test_a_body_over_the_site_limit_is_a_json_413_on_every_api_path(client, settings, path):
    """A body over TENZRO_MAX_BODY (``DATA_UPLOAD_MAX_MEMORY_SIZE``) that reaches a view reading
    ``request.body`` (a chunked upload has no Content-Length to refuse it by earlier) is a JSON 413
    naming the limit: before, the REST heartbeat answered 500 (and logged a traceback) and the
    market's login endpoints 400 "bad request (RequestDataTooBig)"."""
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1000
    r = client.post(path, data=b'{"x": "' + b"a" * 2000 + b'"}', content_type="application/json")
    assert r.status_code == 413 and r["Content-Type"].startswith("application/json"), (r.status_code, r.content)
    assert "1000-byte limit" in r.json()["error"] and "TENZRO_MAX_BODY" in r.json()["error"]


@pytest.mark.asyncio
@pytest.mark.parametrize("path", ["/api/expert-relayx?session=s&token=t", "/ws/nope/", "/"])
async def test_unknown_websocket_paths_are_refused_with_a_close_frame(path):
    from tenzro_site.asgi import application

    comm = WebsocketCommunicator(application, path)
    connected, _ = await comm.connect(timeout=10)
    assert connected  # the 101 completes (Android requires it) ...
    out = await comm.receive_output(timeout=10)
    assert out["type"] == "websocket.close" and out["code"] == 4404  # ... then a deliberate close
    assert out["reason"] == f"no WebSocket endpoint at {path.split('?')[0]}"
    await comm.wait()
