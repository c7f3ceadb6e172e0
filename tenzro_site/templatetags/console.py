"""Template filters of the console pages (``{% load console %}``)."""
from __future__ import annotations

import json
from datetime import datetime, timezone

from django import template

register = template.Library()


@register.filter
def ms_datetime(ms) -> str:
    """Unix milliseconds (int) → ``YYYY-MM-DD HH:MM:SS`` UTC; "—" for None/0/invalid."""
    try:
        ms = int(ms)
    except (TypeError, ValueError):
        return "—"
    if ms <= 0:
        return "—"
    try:
        return datetime.fromtimestamp(ms / 1000, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
    except (OverflowError, OSError, ValueError):
        return "—"


@register.filter
def pretty_json(value) -> str:
    """Any JSON-serialisable value as indented JSON text (auto-escaped by the template)."""
    return json.dumps(value, indent=2, sort_keys=True, default=str)
