"""Django app configuration for ``settlement``."""
from django.apps import AppConfig


class SettlementConfig(AppConfig):
    """App config of ``settlement``."""

    name = "settlement"
    default_auto_field = "django.db.models.BigAutoField"
