"""Deployment identity: one deployment name per database (``registry.models.Deployment``).

A site process (``tenzro_site.serve``), Celery worker and local cluster claim the name from
``TENZRO_DEPLOYMENT`` (settings ``TENZRO["DEPLOYMENT"]``) before they serve: several
processes of one deployment share the database; a process of another deployment is refused
with ``DeploymentMismatch`` before it writes anything, instead of seeing (and placing onto)
the other deployment's agents.
"""
from __future__ import annotations

import re

from django.conf import settings
from django.db import IntegrityError, transaction

from registry.models import Deployment

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")


class DeploymentMismatch(RuntimeError):
    """This database belongs to another deployment (``claimed``) than the one configured (``wanted``)."""

    def __init__(self, wanted: str, claimed: str):
        super().__init__(f"this database belongs to deployment {claimed!r}, but TENZRO_DEPLOYMENT is {wanted!r}: "
                         f"set TENZRO_DEPLOYMENT={claimed} to join it, or give this deployment its own DATABASE_URL")
        self.wanted, self.claimed = wanted, claimed


def check_name(name: str) -> str:
    """``name`` when it is a valid deployment name (lowercase letters, digits, ``_.-``, 1..64
    characters, starting with a letter or digit); raises ``ValueError`` naming TENZRO_DEPLOYMENT."""
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise ValueError(f"TENZRO_DEPLOYMENT must be 1..64 of a-z 0-9 _ . - (starting with a letter or digit), "
                         f"got {name!r}")
    return name


def claim(name: str | None = None) -> str:
    """Claim this database for deployment ``name`` (default ``settings.TENZRO["DEPLOYMENT"]``);
    returns it. Idempotent for the same name, safe against concurrent first claims (the row's
    primary key decides). Raises ``DeploymentMismatch`` when the database belongs to another
    name, ``ValueError`` for a malformed name."""
    name = check_name(name or settings.TENZRO["DEPLOYMENT"])
    try:
        with transaction.atomic():
            row, _ = Deployment.objects.get_or_create(pk=1, defaults={"name": name})
    except IntegrityError:  # a concurrent first claim won
        row = Deployment.objects.get(pk=1)
    if row.name != name:
        raise DeploymentMismatch(name, row.name)
    return row.name


def current() -> str | None:
    """The deployment name this database belongs to, or None before the first claim."""
    return Deployment.objects.filter(pk=1).values_list("name", flat=True).first()
