"""Django app configuration for ``prepare``."""
from django.apps import AppConfig


class PrepareConfig(AppConfig):
    """App config of ``prepare``."""

    name = "prepare"
    default_auto_field = "django.db.models.BigAutoField"
