"""Django app configuration for ``registry``."""
from django.apps import AppConfig
from django.db.models.signals import post_migrate, post_save


def _sync_beat(**kwargs) -> None:
    """Keep the django-celery-beat repair row in step with the interval in force."""
    from registry.repair_service import ensure_beat_schedule

    ensure_beat_schedule()


class RegistryConfig(AppConfig):
    """App config of ``registry``: after migrations and on every policy change the repair
    pass's beat schedule row is created/updated (``registry.repair_service``)."""

    name = "registry"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        """Connect the schedule sync."""
        from registry.models import ReplicationPolicy

        post_migrate.connect(_sync_beat, sender=self, dispatch_uid="registry.sync_beat")
        post_save.connect(_sync_beat, sender=ReplicationPolicy, dispatch_uid="registry.sync_beat_policy")
