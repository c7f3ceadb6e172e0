"""Server-rendered SVG charts: geometry computed here, drawn by ``console/_bar_chart.html``.

No JavaScript and no chart library: a bar chart is a handful of rectangles whose
coordinates are plain numbers (SVG user units, i.e. CSS pixels at scale 1).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Bar:
    """One bar: ``label`` under it, ``value`` above it, and its rectangle ``x, y, w, h``."""

    label: str
    value: int | float
    x: float
    y: float
    w: float
    h: float
    cls: str = ""
    tick: bool = True  # draw the label under the bar (dense series label every n-th bar)


@dataclass(frozen=True)
class BarChart:
    """A bar chart ready to draw: ``width`` × ``height`` view box, ``baseline`` y of the axis."""

    title: str
    width: int
    height: int
    baseline: float
    bars: tuple[Bar, ...]
    x_label: str
    y_label: str


def bar_chart(title: str, data: list[tuple[str, int | float, str]], x_label: str = "", y_label: str = "",
              width: int = 360, height: int = 160, tick_every: int = 1) -> BarChart:
    """Lay out ``data`` (``(label, value >= 0, css class)`` in display order) as vertical bars.

    Bars share the plot width evenly with a 20 % gap; heights scale linearly so that the
    largest value fills the plot (an all-zero series draws flat bars). ``tick_every``: label
    every n-th bar only, counted from the last (dense time series). Raises ``ValueError`` for a
    negative or non-finite value, or ``tick_every`` < 1.
    """
    if tick_every < 1:
        raise ValueError(f"tick_every must be >= 1, got {tick_every!r}")
    top, bottom, left, right = 18.0, 28.0, 8.0, 8.0
    plot_h = height - top - bottom
    peak = 0.0
    for label, value, _cls in data:
        if not value >= 0 or value == float("inf"):
            raise ValueError(f"bar {label!r}: value must be finite and >= 0, got {value!r}")
        peak = max(peak, float(value))
    n = max(len(data), 1)
    slot = (width - left - right) / n
    bars = []
    for i, (label, value, cls) in enumerate(data):
        h = plot_h * (float(value) / peak) if peak else 0.0
        bars.append(Bar(label=str(label), value=value, x=round(left + i * slot + slot * 0.1, 2),
                        y=round(top + plot_h - h, 2), w=round(slot * 0.8, 2), h=round(h, 2), cls=cls,
                        tick=(len(data) - 1 - i) % tick_every == 0))
    return BarChart(title=title, width=width, height=height, baseline=top + plot_h, bars=tuple(bars),
                    x_label=x_label, y_label=y_label)
