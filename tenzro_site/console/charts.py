"""Server-rendered SVG charts: geometry computed here, drawn by ``console/_bar_chart.html``.

No JavaScript and no chart library: a bar chart is a handful of rectangles whose
coordinates are plain numbers (SVG user units, i.e. CSS pixels at scale 1).
"""
from __future__ import annotations

from dataclasses import dataclass

#: Width of one character of the charts' 10 px text, a little over the real average, so a
#: label kept inside the view box by this estimate is inside it when drawn.
CHAR_W = 6.2
TITLE_H = 14.0  # the title's line; value labels start below it


@dataclass(frozen=True)
class Bar:
    """One bar: ``label`` under it, ``value`` above it, and its rectangle ``x, y, w, h``.

    ``label_x`` / ``value_x`` with ``label_anchor`` / ``value_anchor`` (SVG ``text-anchor``)
    place the two texts centred on the bar, shifted inwards at the chart's edges."""

    label: str
    value: int | float
    x: float
    y: float
    w: float
    h: float
    cls: str = ""
    tick: bool = True  # draw the label under the bar (dense series label every n-th bar)
    label_x: float = 0.0
    label_anchor: str = "middle"
    value_x: float = 0.0
    value_anchor: str = "middle"


def _text_x(centre: float, text: str, width: float, pad: float = 2.0) -> tuple[float, str]:
    """(x, text-anchor) for ``text`` centred on ``centre``, kept within ``[pad, width - pad]``."""
    half = len(text) * CHAR_W / 2
    if centre + half > width - pad:
        return round(width - pad, 2), "end"
    if centre - half < pad:
        return pad, "start"
    return round(centre, 2), "middle"


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
    largest value fills the plot (an all-zero series draws flat bars); the plot starts below
    the title and one line of value labels, and labels stay inside the view box. ``tick_every``: label
    every n-th bar only, counted from the last (dense time series). Raises ``ValueError`` for a
    negative or non-finite value, or ``tick_every`` < 1.
    """
    if tick_every < 1:
        raise ValueError(f"tick_every must be >= 1, got {tick_every!r}")
    # Top: the title's line plus one line for the value over a full-height bar.
    top, bottom, left, right = TITLE_H + 14.0, 28.0, 8.0, 8.0
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
        x, w = round(left + i * slot + slot * 0.1, 2), round(slot * 0.8, 2)
        label_x, label_anchor = _text_x(x + w / 2, str(label), width)
        value_x, value_anchor = _text_x(x + w / 2, str(value), width)
        bars.append(Bar(label=str(label), value=value, x=x, y=round(top + plot_h - h, 2), w=w, h=round(h, 2),
                        cls=cls, tick=(len(data) - 1 - i) % tick_every == 0, label_x=label_x,
                        label_anchor=label_anchor, value_x=value_x, value_anchor=value_anchor))
    return BarChart(title=title, width=width, height=height, baseline=top + plot_h, bars=tuple(bars),
                    x_label=x_label, y_label=y_label)


@dataclass(frozen=True)
class Line:
    """One series of a line chart: ``name``, its css class, SVG ``points`` ("x,y x,y …" per
    run of known values: a gap splits the series) and its ``last`` value (None: unknown)."""

    name: str
    cls: str
    points: tuple[str, ...]
    last: float | None


@dataclass(frozen=True)
class LineChart:
    """A line chart ready to draw: ``width`` × ``height`` view box, ``baseline`` y of the axis,
    ``top`` y of the ``peak`` value, first and last x labels."""

    title: str
    width: int
    height: int
    baseline: float
    top: float
    peak: float
    lines: tuple[Line, ...]
    first_label: str
    last_label: str
    y_label: str


def line_chart(title: str, labels: list[str], series: list[tuple[str, list[float | None], str]],
               y_label: str = "", width: int = 360, height: int = 140) -> LineChart:
    """Lay out ``series`` (``(name, values, css class)``, one value or None per ``labels``
    entry, oldest first) as polylines sharing a y scale from 0 to the largest value. A None
    value is a gap. Raises ``ValueError`` for a negative or non-finite value or a series
    whose length is not ``len(labels)``."""
    top, bottom, left, right = 18.0, 20.0, 8.0, 8.0
    plot_h, plot_w = height - top - bottom, width - left - right
    peak = 0.0
    for name, values, _cls in series:
        if len(values) != len(labels):
            raise ValueError(f"series {name!r} has {len(values)} values for {len(labels)} labels")
        for v in values:
            if v is not None and (not v >= 0 or v == float("inf")):
                raise ValueError(f"series {name!r}: values must be finite and >= 0, got {v!r}")
            if v is not None:
                peak = max(peak, float(v))
    step = plot_w / (len(labels) - 1) if len(labels) > 1 else 0.0
    lines = []
    for name, values, cls in series:
        runs, run = [], []
        for i, v in enumerate(values):
            if v is None:
                if run:
                    runs.append(" ".join(run))
                run = []
                continue
            y = top + plot_h - (plot_h * float(v) / peak if peak else 0.0)
            run.append(f"{round(left + i * step, 2)},{round(y, 2)}")
        if run:
            runs.append(" ".join(run))
        last = values[-1] if values else None
        lines.append(Line(name=name, cls=cls, points=tuple(runs), last=None if last is None else round(last, 2)))
    return LineChart(title=title, width=width, height=height, baseline=top + plot_h, top=top, peak=round(peak, 2),
                     lines=tuple(lines), first_label=labels[0] if labels else "",
                     last_label=labels[-1] if labels else "", y_label=y_label)
