"""``python -m tenzro_site.serve [daphne options]``: the site's ASGI server, the one way it is started.

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

import os
import sys

APPLICATION = "tenzro_site.asgi:application"


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

    cap = int(settings.TENZRO["WS_MAX_MESSAGE"])
    from daphne.cli import CommandLineInterface  # installs the asyncio reactor: import before twisted's
    from daphne.server import Server
    from twisted.internet import reactor

    class TenzroServer(Server):
        """Daphne's server with a clean close (code 1009, not a dropped socket) over the cap."""

        def run(self):
            # run() builds ws_factory and then starts the reactor; protocols copy the factory's
            # options when a connection is made, so setting them once the reactor runs covers all.
            reactor.callWhenRunning(lambda: self.ws_factory.setProtocolOptions(failByDrop=False))
            super().run()

    cli = CommandLineInterface()
    cli.server_class = TenzroServer
    cli.run([*(sys.argv[1:] if argv is None else argv), "--websocket-max-message-size", str(cap),
             "--websocket-max-frame-size", str(cap), APPLICATION])


if __name__ == "__main__":
    main()
