"""Django app configuration for ``settlement`` (the receipts economy, docs/DESIGN.md §7)."""
from django.apps import AppConfig


class SettlementConfig(AppConfig):
    """App config of ``settlement``: registers the forward listener with the router (``router.hooks``)."""

    name = "settlement"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self):
        """Hand every finished forward to ``settlement.recording.on_forward``."""
        from router.hooks import add_forward_listener
        from settlement.recording import on_forward

        add_forward_listener(on_forward)
