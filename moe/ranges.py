"""The range string of heartbeat holdings and command-line flags: ``"0-2,5"`` ↔ ``[0, 1, 2, 5]``.

One codec for the agent (which writes it) and the site (which reads it). Pure Python.
"""
from __future__ import annotations

import re

_RANGE = re.compile(r"([0-9]{1,7})(?:-([0-9]{1,7}))?")
#: Most values one spec may expand to (> 10 × a whole Kimi K2, 61 × 385); bounds the expansion.
MAX_VALUES = 262_144


class RangeError(ValueError):
    """A range spec is malformed or out of bounds; ``field`` names the offending input."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


def format_ranges(values) -> str:
    """Non-negative ints as a range string, sorted and deduplicated (``[5, 0, 1, 2]`` → ``"0-2,5"``)."""
    out, vals = [], sorted(set(values))
    i = 0
    while i < len(vals):
        j = i
        while j + 1 < len(vals) and vals[j + 1] == vals[j] + 1:
            j += 1
        out.append(str(vals[i]) if i == j else f"{vals[i]}-{vals[j]}")
        i = j + 1
    return ",".join(out)


def parse_ranges(spec, field: str, hi: int, limit: int = MAX_VALUES) -> list[int]:
    """Expand a range spec (``"0-127,130"`` or ``[[0, 127], 130]``) to sorted unique ints.

    Ranges are inclusive; every value must lie in ``[0, hi]``; the total may not exceed
    ``limit``; no value may be listed twice. Raises ``RangeError`` naming ``field``.
    """
    parts: list[tuple[int, int]] = []
    if isinstance(spec, str):
        for piece in spec.split(","):
            piece = piece.strip()
            m = _RANGE.fullmatch(piece)
            if m is None:
                raise RangeError(f"{field}: {piece[:40]!r} is not an integer or an inclusive lo-hi range", field)
            parts.append((int(m[1]), int(m[2] or m[1])))
    elif isinstance(spec, list) and spec:
        for item in spec:
            if isinstance(item, int) and not isinstance(item, bool):
                parts.append((item, item))
            elif (isinstance(item, list) and len(item) == 2
                  and all(isinstance(v, int) and not isinstance(v, bool) for v in item)):
                parts.append((item[0], item[1]))
            else:
                raise RangeError(f"{field}: items must be integers or [lo, hi] pairs, got {item!r}", field)
    else:
        raise RangeError(f"{field} must be a range string like \"0-127,130\" or a non-empty list "
                         "of integers and [lo, hi] pairs", field)
    total = 0
    for lo, up in parts:
        if not 0 <= lo <= up <= hi:
            raise RangeError(f"{field}: range {lo}-{up} must satisfy 0 <= lo <= hi <= {hi}", field)
        total += up - lo + 1
        if total > limit:
            raise RangeError(f"{field} expands to more than {limit} values", field)
    values = sorted({v for lo, up in parts for v in range(lo, up + 1)})
    if len(values) != total:
        raise RangeError(f"{field} lists a value twice (overlapping ranges)", field)
    return values
