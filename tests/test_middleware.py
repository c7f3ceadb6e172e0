"""``tenzro_site.middleware``: under ASGI Django's middleware hooks run on the event loop (no
thread hand-off per hook), and what can reach the database still works: a login saves its
session, CSRF still refuses a form without its token, messages reach the next page."""
from __future__ import annotations

import asyncio
import re

import httpx
import pytest
from asgiref import sync
from django.contrib.auth import get_user_model

from tenzro_site.asgi import application


def client() -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=application), base_url="http://testserver")


@pytest.fixture
def hops(monkeypatch) -> list[str]:
    """The functions handed to ``sync_to_async`` (thread hops) from now on, by qualified name."""
    made: list[str] = []
    real = sync.SyncToAsync.__init__

    def counting(self, func, *args, **kwargs):
        made.append(getattr(func, "__qualname__", repr(func)))
        real(self, func, *args, **kwargs)

    monkeypatch.setattr(sync.SyncToAsync, "__init__", counting)
    return made


def test_an_async_view_takes_no_thread_hop_per_middleware_hook(hops):
    made = hops

    async def go():
        async with client() as c:
            r = await c.get("/v1/nothing-here")
            assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"

    asyncio.run(go())
    # Left: Django's request_started/finished signals and the response's close; with Django's
    # MiddlewareMixin each hook of the 7 middleware classes (13, and CSRF's process_view) took a thread.
    assert not [m for m in made if "process_" in m], made
    assert len(made) <= 4, made


@pytest.mark.django_db(transaction=True)
def test_login_session_csrf_and_messages_work_under_asgi():
    get_user_model().objects.create_user("alice", password="pw-alice", is_staff=True)

    async def go():
        async with client() as c:
            page = await c.get("/login/")
            token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text).group(1)
            refused = await c.post("/login/", data={"username": "alice", "password": "pw-alice"})
            assert refused.status_code == 403  # no CSRF token: refused, as before
            r = await c.post("/login/?next=/governance/", data={"username": "alice", "password": "pw-alice",
                                                                  "csrfmiddlewaretoken": token},
                             headers={"Referer": "http://testserver/login/"})
            assert r.status_code == 302 and "sessionid" in c.cookies  # the session was saved (its thread)
            gov = await c.get("/governance/")
            assert gov.status_code == 200 and "alice" in gov.text
            warned = await c.get("/receipts/?layer=not-a-number")  # a message, shown on the page itself
            assert warned.status_code == 200 and "ignored invalid filter" in warned.text

    asyncio.run(go())


def test_the_csrf_check_of_a_form_post_keeps_its_thread_and_json_apis_do_not(hops):
    """A form post's CSRF check parses the body (up to TENZRO_MAX_BODY): in a thread, never on the
    event loop every stream runs on; a csrf_exempt JSON API's check is inline."""
    made = hops

    async def go():
        async with client() as c:
            r = await c.post("/governance/proposals", data={"title": "x" * 100_000})
            assert r.status_code == 403
            assert "CsrfViewMiddleware.process_view" in made, made
            made.clear()
            r = await c.post("/v1/nothing-here", json={"model": "m"})
            assert r.status_code == 404 and not [m for m in made if "process_" in m], made

    asyncio.run(go())


@pytest.fixture
def started_skipped():
    """``tenzro_site.serve.skip_request_started_hop`` applied, as the ASGI server does; undone after."""
    from django.core import signals
    from django.db import close_old_connections, reset_queries

    from tenzro_site.serve import skip_request_started_hop

    skip_request_started_hop()
    yield
    signals.request_started.connect(reset_queries)
    signals.request_started.connect(close_old_connections)


@pytest.mark.django_db(transaction=True)
def test_request_started_receivers_find_no_open_connection_under_asgi():
    """The premise of ``skip_request_started_hop``: Django's ASGI handler starts each request in a
    fresh thread of its own, where ``close_old_connections`` and ``reset_queries`` have nothing to act on."""
    import threading

    from django.core import signals
    from django.db import connections

    seen = []

    def probe(**kwargs):
        seen.append((threading.current_thread().name, [c.alias for c in connections.all(initialized_only=True)
                                             if c.connection is not None]))

    signals.request_started.connect(probe)
    try:
        async def go():
            await sync.sync_to_async(lambda: get_user_model().objects.count())()  # a connection opened elsewhere
            async with client() as c:
                for path in ("/healthz", "/login/", "/v1/models", "/login/"):
                    assert (await c.get(path)).status_code in (200, 404)

        asyncio.run(go())
    finally:
        signals.request_started.disconnect(probe)
    assert len(seen) == 4 and all(open_ == [] for _, open_ in seen), seen
    assert len({name for name, _ in seen}) == 4  # a thread (of a new executor) per request


@pytest.mark.django_db(transaction=True)
def test_the_server_skips_the_request_started_hop_and_keeps_request_finished(hops, started_skipped):
    from django.core import signals
    from django.db import close_old_connections

    def receivers(signal):
        return [entry[1]() for entry in signal.receivers]  # (lookup key, weak reference, is_async)

    assert close_old_connections not in receivers(signals.request_started)
    assert close_old_connections in receivers(signals.request_finished)
    get_user_model().objects.create_user("bob", password="pw-bob", is_staff=True)

    async def go():
        async with client() as c:
            r = await c.get("/v1/nothing-here")
            assert r.status_code == 404
            started = len(hops)
            page = await c.get("/login/")  # the database still works without the skipped receivers
            token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text).group(1)
            r = await c.post("/login/?next=/governance/", data={"username": "bob", "password": "pw-bob",
                                                                  "csrfmiddlewaretoken": token},
                             headers={"Referer": "http://testserver/login/"})
            assert r.status_code == 302 and (await c.get("/governance/")).status_code == 200
            return started

    started = asyncio.run(go())
    # Without the skip the 404 took Signal.asend's hop for request_started's sync receivers, then
    # log_response and the response's close (request_finished); now only the last two.
    assert hops[:started] == ["log_response", "HttpResponseBase.close"], hops
