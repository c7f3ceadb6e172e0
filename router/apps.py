"""Django app configuration for ``router``: the site's serving path (forward, generation, OpenAI API,
agent sockets, admission, scoreboard, fallback, handoff)."""
from django.apps import AppConfig


class RouterConfig(AppConfig):
    """App config of ``router``."""

    name = "router"
    default_auto_field = "django.db.models.BigAutoField"
