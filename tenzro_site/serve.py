"""``python -m tenzro_site.serve [daphne options]``: the site's ASGI server, the one way it is started.

Slow clients: twisted's only HTTP timeout is an idle one (60 s), which a slowloris client
sending a header line every few seconds never trips, so each connection held a descriptor
for as long as it liked (400 of them exhausted the site's). ``RequestDeadlineChannel`` gives
every request a deadline, as Apache's ``mod_reqtimeout`` does: its headers within
``TENZRO_HTTP_HEADER_TIMEOUT`` seconds of its first byte (of the connection, for the first
request), then its body within ``TENZRO_HTTP_BODY_TIMEOUT`` seconds plus one more per
``TENZRO_HTTP_BODY_MIN_RATE`` bytes received; past it the client gets ``408`` (JSON) and the
connection is closed. Time the application takes, idle keep-alive connections and
WebSocket connections (after the upgrade) are not bounded by it.

Daphne (through autobahn) caps a WebSocket *message* and, separately, each *frame*; both
default to 1 MiB, and raising only the message cap still closes every agent that sends one
frame above 1 MiB. Here both are set from ``TENZRO_WS_MAX_MESSAGE`` (settings
``TENZRO["WS_MAX_MESSAGE"]``, the cap the site announces to agents in its welcome), and a
message over it is answered with a close frame, code 1009 "message too big", instead of
autobahn's default of dropping the TCP connection (the peer saw only 1006). Used by
``make serve`` and ``LocalCluster``; options other than the size caps pass through to
daphne (``-b``, ``-p``, ``--websocket_timeout``, ...). The application is
``tenzro_site.asgi:application``.

Before serving, the process claims its deployment (``registry.deployment.claim``,
``TENZRO_DEPLOYMENT``): a database of another deployment, or one not migrated, ends it with
a message (exit code 1). Behind a load balancer, pass daphne's ``--proxy-headers`` (the
client address then comes from ``X-Forwarded-For``).
"""
from __future__ import annotations

import gc
import json
import os
import sys

APPLICATION = "tenzro_site.asgi:application"


def error_body(path: str, message: str, field: str | None = None) -> dict:
    """A JSON error in the shape of ``path``'s API (``path`` without its query): OpenAI's
    ``{"error": {message, type, param, code}}`` under ``/v1/``, a JSON-RPC error object
    (-32600, ``id`` null, ``data.field``) under ``/rpc``, ``{"error": message}`` elsewhere.
    Used by the server's own early answers (413, 408) and Django's ``handler400``."""
    from moe import jsonrpc

    if path == "/v1" or path.startswith("/v1/"):
        return {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}}
    if path.rstrip("/") == "/rpc":
        return jsonrpc.error_response(None, jsonrpc.RpcError(jsonrpc.INVALID_REQUEST, message, field=field))
    return {"error": message}


def skip_request_started_hop() -> None:
    """Disconnect Django's database receivers from ``request_started`` in this ASGI server.

    Django's ASGI handler runs each request in a fresh ``ThreadSensitiveContext``, so sync
    receivers of ``request_started`` (``reset_queries``, ``close_old_connections``) run in a new
    thread of that request, which has no database connection yet: both are no-ops there
    (``tests/test_middleware.py`` checks that premise). They still cost a thread creation and
    a hand-off before the view runs: 3-4 ms of median intake latency per request when 16
    requests arrive together on 2 shared cores. ``request_finished`` keeps both receivers (it
    closes what the request's thread opened), and ``channels.db.database_sync_to_async`` closes
    old connections around every call."""
    from django.core import signals
    from django.db import close_old_connections, reset_queries

    signals.request_started.disconnect(reset_queries)
    signals.request_started.disconnect(close_old_connections)


def deadline_channel(header_s: float, body_s: float, body_min_rate: int, max_body: int = 0):
    """The ``twisted.web.http.HTTPChannel`` subclass that enforces the request deadlines of the
    module doc (``header_s``, ``body_s`` seconds, ``body_min_rate`` bytes per extra second) and
    refuses, as soon as its headers arrive, a request declaring a ``Content-Length`` over
    ``max_body`` bytes (413 JSON and close; 0: no cap): no view accepts such a body, and twisted
    would otherwise spool it to disk before Django's own limit sees it."""
    from twisted.internet import reactor
    from twisted.web import http

    class RequestDeadlineChannel(http.HTTPChannel):
        """An HTTP/1.1 channel whose requests must arrive by a deadline (408 and close)."""

        _deadline = None
        _body_start = 0.0
        _body_bytes = 0
        _between = True  # no request in progress: the next line starts one
        _refused = False  # answered early (413): what the client still sends is dropped

        def connectionMade(self):
            super().connectionMade()
            self._arm(header_s)  # the first request's headers, from the connection's start

        def lineReceived(self, line):
            if self._between:  # a request's first line (or the first of a kept-alive connection's next)
                self._between = False
                if self._deadline is None:
                    self._arm(header_s)
            super().lineReceived(line)

        def allHeadersReceived(self):
            if max_body and (self.length or 0) > max_body:
                self._disarm()
                self._refused = True
                self._answer(413, "Payload Too Large", f"request body is {self.length} bytes, over this "
                                                       f"site's {max_body}-byte limit (TENZRO_MAX_BODY)", "body")
                return
            super().allHeadersReceived()
            self._body_start, self._body_bytes = reactor.seconds(), 0
            self._arm(body_s)

        def dataReceived(self, data):
            if not self._refused:
                super().dataReceived(data)

        def rawDataReceived(self, data):
            if self._refused:
                return
            self._body_bytes += len(data)
            if self._deadline is not None and self._deadline.active() and body_min_rate > 0:
                due = self._body_start + body_s + self._body_bytes / body_min_rate
                self._deadline.reset(max(0.0, due - reactor.seconds()))
            super().rawDataReceived(data)

        def allContentReceived(self):
            self._disarm()
            self._between = True
            super().allContentReceived()

        def connectionLost(self, reason):
            self._disarm()
            super().connectionLost(reason)

        def _arm(self, seconds: float) -> None:
            self._disarm()
            self._deadline = self.callLater(seconds, self._too_slow)

        def _disarm(self) -> None:
            if self._deadline is not None and self._deadline.active():
                self._deadline.cancel()
            self._deadline = None

        def _too_slow(self) -> None:
            self._deadline = None
            self._answer(408, "Request Timeout", "request timeout: the request did not arrive in time")

        def _answer(self, status: int, reason: str, message: str, field: str | None = None) -> None:
            """Write a JSON error response (``error_body``: the request path's API shape) and close
            the connection."""
            transport = self.transport
            if transport is None:
                return
            path = (getattr(self, "_path", None) or b"").decode("latin-1").partition("?")[0]
            body = json.dumps(error_body(path, message, field)).encode()
            transport.write(b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\n"
                            b"Content-Length: %d\r\nConnection: close\r\n\r\n%s"
                            % (status, reason.encode(), len(body), body))
            transport.loseConnection()
            self.callLater(5, transport.abortConnection)  # a peer that does not read: drop it

    return RequestDeadlineChannel


def main(argv: list[str] | None = None) -> None:
    """Run daphne with ``argv`` plus the size caps and the application; returns when it stops."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tenzro_site.settings")
    import django
    from django.conf import settings
    from django.db import DatabaseError

    django.setup()
    from registry.deployment import DeploymentMismatch, claim

    try:
        claim()
    except (DeploymentMismatch, ValueError) as exc:
        sys.exit(f"tenzro_site.serve: {exc}")
    except DatabaseError as exc:
        sys.exit(f"tenzro_site.serve: cannot claim the deployment ({type(exc).__name__}: {exc}); "
                 "run `python manage.py migrate` first")
    finally:
        from django.db import connections

        connections.close_all()  # the pool's connection is not the server's thread's

    # Django, numba and the apps leave ~160k long-lived objects that every full collection
    # walked again while all streams waited; frozen, it walks only what serving allocated.
    import importlib

    from django.urls import get_resolver

    importlib.import_module(APPLICATION.split(":")[0])  # the ASGI routing, its consumers and what they import
    get_resolver().url_patterns  # noqa: B018 - imports every view module (Django would on the first request)
    skip_request_started_hop()
    gc.collect()
    gc.freeze()
    # Serving allocates containers (futures, tasks, frames' dicts, receipts) at a rate that ran a
    # young collection ~50 times a second at 16 clients and promoted short-lived objects into
    # full collections of the ~100k objects loaded after the freeze (model, views, kernels):
    # 6 % of the site's CPU. A young generation of 10,000 lets those die young: 1 %.
    gc.set_threshold(10_000, 10, 10)
    cap = int(settings.TENZRO["WS_MAX_MESSAGE"])
    from daphne.cli import CommandLineInterface  # installs the asyncio reactor: import before twisted's
    from daphne.server import Server
    from twisted.internet import reactor
    from twisted.web.http import _GenericHTTPChannelProtocol

    t = settings.TENZRO
    channel = deadline_channel(float(t["HTTP_HEADER_TIMEOUT_S"]), float(t["HTTP_BODY_TIMEOUT_S"]),
                               int(t["HTTP_BODY_MIN_RATE"]), int(settings.DATA_UPLOAD_MAX_MEMORY_SIZE))

    class TenzroServer(Server):
        """Daphne's server with a clean close (code 1009, not a dropped socket) over the cap
        and request deadlines for slow clients (``deadline_channel``)."""

        def run(self):
            # run() builds the factories and then starts the reactor; protocols copy the factory's
            # options when a connection is made, so setting them once the reactor runs covers all.
            def configure():
                self.ws_factory.setProtocolOptions(failByDrop=False)
                self.http_factory.protocol = lambda: _GenericHTTPChannelProtocol(channel())

            reactor.callWhenRunning(configure)
            super().run()

    cli = CommandLineInterface()
    cli.server_class = TenzroServer
    cli.run([*(sys.argv[1:] if argv is None else argv), "--websocket-max-message-size", str(cap),
             "--websocket-max-frame-size", str(cap), APPLICATION])


if __name__ == "__main__":
    main()
