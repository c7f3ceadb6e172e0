"""Django app configuration for ``settlement`` (the receipts economy, docs/DESIGN.md §7), and the
accessor of the process's ``settlement.state.Economy``."""
from __future__ import annotations

from typing import TYPE_CHECKING

from django.apps import AppConfig, apps

if TYPE_CHECKING:
    from settlement.state import Economy


class SettlementConfig(AppConfig):
    """App config of ``settlement``: holds the process's ``Economy`` and registers its forward
    listener with the router (``router.hooks``)."""

    name = "settlement"
    default_auto_field = "django.db.models.BigAutoField"
    economy: "Economy"

    def ready(self):
        """Create the ``Economy``; hand every finished forward to ``settlement.state.on_forward``."""
        from router.hooks import add_forward_listener
        from settlement.state import Economy, on_forward

        self.economy = Economy()
        add_forward_listener(on_forward)


def current() -> "Economy":
    """The ``settlement.state.Economy`` of this site process (made at app start)."""
    return apps.get_app_config("settlement").economy


def install(economy: "Economy") -> "Economy":
    """Make ``economy`` this process's (tests); returns the one it replaces."""
    config = apps.get_app_config("settlement")
    previous, config.economy = config.economy, economy
    return previous
