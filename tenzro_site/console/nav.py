"""Navigation of the console: one entry per section, rendered by ``base.html``.

A new section (receipts, disputes, settlement, repair) adds one ``NavItem`` here; ``section``
is what its views pass as ``nav_section`` to mark the entry current.
"""
from __future__ import annotations

from dataclasses import dataclass

from django.urls import reverse


@dataclass(frozen=True)
class NavItem:
    """One navigation link: ``section`` key, visible ``label`` and the URL ``name`` it reverses."""

    section: str
    label: str
    url_name: str


NAV: tuple[NavItem, ...] = (
    NavItem("overview", "Overview", "index"),
    NavItem("governance", "Governance", "console-governance"),
    NavItem("providers", "Providers", "console-providers"),
    NavItem("coverage", "Coverage", "console-coverage-index"),
    NavItem("receipts", "Receipts", "console-receipts"),
    NavItem("disputes", "Disputes", "console-disputes"),
    NavItem("settlements", "Settlements", "console-settlements"),
    NavItem("prepare", "Prepare jobs", "prepare-jobs"),
    NavItem("serving", "Serving", "console-serving"),
)


def nav(request) -> dict:
    """Context processor: ``console_nav`` as ``[{section, label, url}]`` for the base layout."""
    return {"console_nav": [{"section": i.section, "label": i.label, "url": reverse(i.url_name)} for i in NAV]}
