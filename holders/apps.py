"""Django app configuration for ``holders``."""
from django.apps import AppConfig


class HoldersConfig(AppConfig):
    """App config of ``holders``."""

    name = "holders"
    default_auto_field = "django.db.models.BigAutoField"
