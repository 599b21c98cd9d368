"""Line charts as inline SVG, generated in Python: the run report needs no charting library.

A report must open anywhere (a laptop without network, an artifact in CI), so it cannot load
a JS library from a CDN; plain SVG written here renders in every browser and can be tested
by reading the markup back. Pure functions: series in, markup out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from html import escape

WIDTH, HEIGHT = 520, 240
LEFT, RIGHT, TOP, BOTTOM = 56, 12, 12, 28
PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf")


@dataclass(frozen=True)
class Series:
    """One named curve; ``points`` are (x, y) with y None or NaN where the value is unknown (a gap)."""

    name: str
    points: tuple[tuple[float, float | None], ...]
    markers: bool = False  # dots instead of a line (sparse values such as evals)


@dataclass(frozen=True)
class Mark:
    """A vertical rule at ``x`` (a stage boundary), labelled."""

    x: float
    label: str


@dataclass
class Chart:
    title: str
    series: list[Series]
    unit: str = ""
    y_min: float | None = None
    y_max: float | None = None
    marks: list[Mark] = field(default_factory=list)
    note: str = ""
    x_range: tuple[float, float] | None = None  # the same for every panel of a page


def finite(y: float | None) -> bool:
    return y is not None and isinstance(y, (int, float)) and math.isfinite(y)


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round tick values covering [lo, hi] (1, 2, 2.5 or 5 times a power of ten apart)."""
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    raw = (hi - lo) / max(1, count - 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw)
    start = math.floor(lo / step) * step
    ticks = []
    t = start
    while t <= hi + step * 1e-9:
        ticks.append(round(t, 12))
        t += step
    if ticks[-1] < hi:
        ticks.append(round(t, 12))
    return ticks


def _label(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1000:
        return f"{v / 1000:g}k"
    return f"{v:.3g}"


def segments(points: tuple[tuple[float, float | None], ...]) -> list[list[tuple[float, float]]]:
    """Runs of consecutive known values: a missing value breaks the line instead of faking it."""
    runs: list[list[tuple[float, float]]] = [[]]
    for x, y in points:
        if finite(y):
            runs[-1].append((x, float(y)))  # type: ignore[arg-type]
        elif runs[-1]:
            runs.append([])
    return [r for r in runs if r]


def has_data(chart: Chart) -> bool:
    return any(finite(y) for s in chart.series for _, y in s.points)


def render(chart: Chart) -> str:
    """The chart as an ``<svg>`` element (an empty frame with a 'no data' note when nothing is known)."""
    pts = [(x, y) for s in chart.series for x, y in s.points if finite(y)]
    xs = [x for x, _ in pts] + [m.x for m in chart.marks]
    x_lo, x_hi = chart.x_range or ((min(xs), max(xs)) if xs else (0.0, 1.0))
    if x_hi == x_lo:
        x_lo, x_hi = x_lo - 1, x_hi + 1
    ys = [float(y) for _, y in pts]  # type: ignore[arg-type]
    y_lo = chart.y_min if chart.y_min is not None else (min(ys) if ys else 0.0)
    y_hi = max([*ys, chart.y_max if chart.y_max is not None else -math.inf]) if ys else (chart.y_max or 1.0)
    if chart.y_min is None and ys and y_lo > 0 and y_lo < 0.5 * y_hi:
        y_lo = 0.0  # small positive values read best against a zero baseline
    ticks = nice_ticks(y_lo, y_hi)
    y_lo, y_hi = ticks[0], ticks[-1]
    pw, ph = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def sx(x: float) -> float:
        return LEFT + (x - x_lo) / (x_hi - x_lo) * pw

    def sy(y: float) -> float:
        return TOP + ph - (y - y_lo) / ((y_hi - y_lo) or 1.0) * ph

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" '
        f'width="{WIDTH}" height="{HEIGHT}" role="img" aria-label="{escape(chart.title)}">',
        f'<rect x="{LEFT}" y="{TOP}" width="{pw}" height="{ph}" fill="#fff" stroke="#ccc"/>',
    ]
    for t in ticks:
        y = sy(t)
        out.append(f'<line x1="{LEFT}" x2="{LEFT + pw}" y1="{y:.1f}" y2="{y:.1f}" stroke="#eee"/>')
        out.append(
            f'<text x="{LEFT - 4}" y="{y + 3:.1f}" text-anchor="end" font-size="10" fill="#555">'
            f"{_label(t)}{escape(chart.unit)}</text>"
        )
    for t in nice_ticks(x_lo, x_hi, 6):
        if x_lo <= t <= x_hi:
            x = sx(t)
            out.append(
                f'<text x="{x:.1f}" y="{HEIGHT - 10}" text-anchor="middle" font-size="10" fill="#555">'
                f"{_label(t)}</text>"
            )
    for m in chart.marks:
        x = sx(m.x)
        out.append(
            f'<line class="stage-mark" x1="{x:.1f}" x2="{x:.1f}" y1="{TOP}" y2="{TOP + ph}" '
            'stroke="#888" stroke-dasharray="4 3"/>'
        )
        out.append(
            f'<text x="{x + 3:.1f}" y="{TOP + 10}" font-size="10" fill="#666">{escape(m.label)}</text>'
        )
    for i, s in enumerate(chart.series):
        color = PALETTE[i % len(PALETTE)]
        group = [f'<g class="series" data-series="{escape(s.name)}">']
        for run in segments(s.points):
            if s.markers or len(run) == 1:
                group.extend(
                    f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3.5" fill="{color}"/>' for x, y in run
                )
            else:
                coords = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in run)
                group.append(f'<polyline points="{coords}" fill="none" stroke="{color}" stroke-width="1.6"/>')
        group.append("</g>")
        out.extend(group)
    if not pts:
        out.append(
            f'<text x="{LEFT + pw / 2}" y="{TOP + ph / 2}" text-anchor="middle" font-size="12" fill="#999">'
            "no data in this run</text>"
        )
    out.append("</svg>")
    return "".join(out)


def legend(chart: Chart) -> str:
    """HTML legend entries (buttons: the report's script toggles a series by its name)."""
    items = []
    for i, s in enumerate(chart.series):
        color = PALETTE[i % len(PALETTE)]
        items.append(
            f'<button type="button" class="key" data-series="{escape(s.name)}">'
            f'<span style="background:{color}"></span>{escape(s.name)}</button>'
        )
    return "".join(items)
