"""The one rule for model ids this site creates (publish, prepare, the market, their RPCs and
commands): 1 to ``MAX_LEN`` characters from letters, digits, ``.``, ``_`` and ``-``, starting
with a letter or digit, so an id is one URL path segment as is (``/coverage/<model_id>``) and a
file-name-safe word. Pure Python; imports nothing from Django."""
from __future__ import annotations

import re

from moe.jsonrpc import ParamError

MAX_LEN = 200  # MoeModel.model_id / MarketModel.model_id column width
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
RULE = f"1-{MAX_LEN} characters of letters, digits, '.', '_' and '-', starting with a letter or digit"


def validate_model_id(value: object, field: str = "model_id", hub: bool = False) -> str:
    """``value`` when it is a valid model id; raises ``ParamError`` naming ``field`` otherwise.

    ``hub``: the expert-coverage market's Hub-style ids (Kvasir-compatible, ``org/name``) may
    also be two such words joined by one ``/`` (they are never a console path segment)."""
    rule = RULE + (", or two such joined by one '/'" if hub else "")
    if not isinstance(value, str) or not value:
        raise ParamError(f"{field} must be a non-empty string ({rule})", field)
    words = value.split("/", 1) if hub else [value]
    if len(value) > MAX_LEN or not all(_ID.fullmatch(w) for w in words):
        raise ParamError(f"{field} {value[:60]!r} is not a valid model id: {rule}", field)
    return value
