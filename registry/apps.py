"""Django app configuration for ``registry``."""
from django.apps import AppConfig


class RegistryConfig(AppConfig):
    """App config of ``registry``."""

    name = "registry"
    default_auto_field = "django.db.models.BigAutoField"
