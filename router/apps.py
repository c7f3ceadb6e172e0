"""Django app configuration for ``router``: the site's serving path (forward, generation, OpenAI API,
agent sockets, admission, scoreboard, fallback, handoff), and the accessor of the process's
``router.state.Router``."""
from __future__ import annotations

from typing import TYPE_CHECKING

from django.apps import AppConfig, apps

if TYPE_CHECKING:
    from router.state import Router


class RouterConfig(AppConfig):
    """App config of ``router``: holds the process's ``Router`` (``current``)."""

    name = "router"
    default_auto_field = "django.db.models.BigAutoField"
    router: "Router"

    def ready(self):
        """Create the process's ``Router``; hand agent socket presence to its scoreboard and the path of
        each agent request (local socket or relay) to its metrics."""
        from router.state import Router
        from router.ws import AgentLink

        self.router = Router()
        # Through ``current()``: a router installed later (tests) gets the presence, not this one.
        AgentLink.presence_listeners.append(lambda provider, connected: current().presence(provider, connected))
        AgentLink.path_listeners.append(lambda path: current().metrics.agent_requests.labels(path).inc())


def current() -> "Router":
    """The ``router.state.Router`` of this site process (made at app start). Views, consumers
    and tasks reach the router's state through it."""
    return apps.get_app_config("router").router


def install(router: "Router") -> "Router":
    """Make ``router`` this process's router (tests); returns the one it replaces."""
    config = apps.get_app_config("router")
    previous, config.router = config.router, router
    return previous
