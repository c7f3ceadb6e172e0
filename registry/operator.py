"""The operator credential (docs/DESIGN.md §6): a bearer token for management methods.

``TENZRO_OPERATOR_TOKEN`` when set; otherwise generated on first use and kept in
``$TENZRO_VAR_DIR/operator_token`` (mode 0600) so every process of one site agrees.
"""
from __future__ import annotations

import hmac
import os
import secrets

from django.conf import settings


def operator_token() -> str:
    """The operator token, creating and storing one on first use."""
    env = os.environ.get("TENZRO_OPERATOR_TOKEN", "").strip()
    if env:
        return env
    path = settings.VAR_DIR / "operator_token"
    if not path.exists():
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_urlsafe(32))
        try:
            os.link(tmp, path)  # first writer wins; everyone reads the same token
        except FileExistsError:
            pass
        os.unlink(tmp)
    return path.read_text().strip()


def is_operator(authorization: str | None) -> bool:
    """Whether an ``Authorization`` header carries ``Bearer <operator token>`` (constant-time)."""
    scheme, _, token = (authorization or "").strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():  # the scheme is case-insensitive (RFC 7235)
        return False
    return hmac.compare_digest(token.strip().encode(), operator_token().encode())
