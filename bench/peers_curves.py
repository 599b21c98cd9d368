"""Held-out accuracy against training wall-clock for ``bench/peers.py``: the curves, the time each
side takes to reach an accuracy, the two sides compared at equal wall-clock, and the PNG.

A curve is the list of ``(seconds, accuracy)`` points of one run: ``(0, SFT accuracy)`` (the
shared start), then one point per evaluated policy at the training clock of the step that
produced it. Between two points a run has the earlier point's policy (a step function): a
policy exists from the end of the step that made it, so nothing is interpolated upwards.

The chart is drawn by the run report's own SVG code (:mod:`kuberl.trainer.svg`) and turned into
a PNG by headless Chromium (the report test's browser), so no plotting library is needed.
"""

from __future__ import annotations

import math
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from html import escape
from pathlib import Path

from kuberl.trainer import svg

Curve = list[tuple[float, float]]

# accuracies are k/n of the same n problems: compare them with a tolerance for float sums
EPS = 1e-9


def build_curve(start_acc: float, clock: dict[int, float], accs: dict[int, float]) -> Curve:
    """``(0, start_acc)`` then ``(clock[step], accs[step])`` for every evaluated step, in clock order
    (pure). ``clock`` maps a step to the training seconds at its end; a step evaluated but not
    clocked is an error (the run's records and its saved policies disagree)."""
    missing = sorted(set(accs) - set(clock))
    if missing:
        raise ValueError(f"evaluated steps {missing} have no clock reading: the run's step records end earlier")
    pts = sorted((clock[s], accs[s]) for s in accs if s > 0)
    if any(t <= 0 for t, _ in pts):
        raise ValueError("a step's clock reading must be > 0 s (the start, 0 s, is the SFT policy)")
    return [(0.0, start_acc), *pts]


def time_to_reach(curve: Curve, target: float) -> float | None:
    """The clock at which the run first had a policy at least ``target`` accurate; None when it
    never did (a miss, reported as such) (pure)."""
    for t, acc in curve:
        if acc >= target - EPS:
            return t
    return None


def accuracy_at(curve: Curve, t: float) -> float | None:
    """The accuracy of the policy the run had at clock ``t`` (the last point at or before it);
    None past the run's last point, where it had stopped (pure)."""
    if not curve or t < curve[0][0] or t > curve[-1][0] + EPS:
        return None
    acc = curve[0][1]
    for ti, a in curve:
        if ti > t + EPS:
            break
        acc = a
    return acc


def aligned(ours: Curve, theirs: Curve) -> list[tuple[float, float, float]]:
    """``(t, our accuracy, their accuracy)`` at every clock where either side has a point, up to
    the shorter run's end (pure): the two step functions compared at equal wall-clock."""
    end = min(ours[-1][0], theirs[-1][0])
    times = sorted({t for t, _ in ours + theirs if t <= end + EPS})
    out = []
    for t in times:
        a, b = accuracy_at(ours, t), accuracy_at(theirs, t)
        if a is not None and b is not None:
            out.append((t, a, b))
    return out


def equal_clock(ours: Curve, theirs: Curve) -> dict[str, float]:
    """At equal wall-clock after the start: the share of the common span where ours is at least
    as accurate, the time-weighted mean gap (ours minus theirs), and the span itself (pure).
    Each aligned value holds until the next clock reading, so a long stretch counts for more."""
    pts = aligned(ours, theirs)
    span = pts[-1][0] - pts[0][0] if len(pts) > 1 else 0.0
    if span <= 0:
        return {"share_at_least": math.nan, "mean_gap": math.nan, "span_s": 0.0}
    ahead = gap = 0.0
    for (t, a, b), (t_next, _, _) in zip(pts, pts[1:], strict=False):
        dt = t_next - t
        gap += (a - b) * dt
        if a >= b - EPS:
            ahead += dt
    return {"share_at_least": ahead / span, "mean_gap": gap / span, "span_s": span}


def mean_curve(curves: Sequence[Curve], points: int = 41) -> Curve:
    """The seeds' mean accuracy on an even grid from 0 to the shortest run's end (pure)."""
    end = min(c[-1][0] for c in curves)
    grid = [end * i / (points - 1) for i in range(points)] if end > 0 else [0.0]
    out = []
    for t in grid:
        vals = [accuracy_at(c, t) for c in curves]
        out.append((t, sum(v for v in vals if v is not None) / len(vals)))
    return out


def chart(curves: dict[str, list[Curve]], title: str) -> svg.Chart:
    """Every seed's curve as markers and each side's mean as a line, one chart (pure)."""
    series = []
    for name, runs in curves.items():
        series.append(svg.Series(f"{name} mean", tuple(mean_curve(runs))))
    for name, runs in curves.items():
        for i, c in enumerate(runs):
            series.append(svg.Series(f"{name} seed {i}", tuple(c), markers=True))
    return svg.Chart(title, series, unit="", y_min=0.0, y_max=1.0, note="x: training wall-clock s")


def page(c: svg.Chart, caption: str) -> str:
    """A bare HTML page holding the chart, its legend (as text) and a caption."""
    keys = "".join(
        f'<span style="margin-right:12px"><b style="color:{svg.PALETTE[i % len(svg.PALETTE)]}">&#9632;</b> '
        f"{escape(s.name)}</span>"
        for i, s in enumerate(c.series)
    )
    return (
        '<!doctype html><html><body style="margin:8px;font:12px sans-serif;background:#fff">'
        f"<div><b>{escape(c.title)}</b></div>{svg.render(c)}<div>{keys}</div>"
        f"<div>x: training wall-clock (s); y: held-out accuracy</div><div>{escape(caption)}</div></body></html>"
    )


def write_png(c: svg.Chart, caption: str, path: Path, size: tuple[int, int] = (560, 360)) -> None:
    """The chart as a PNG, screenshot by headless Chromium (raises naming what is missing)."""
    browser = next((p for n in ("chromium", "chromium-browser", "google-chrome") if (p := shutil.which(n))), None)
    if browser is None:
        raise RuntimeError("no chromium on PATH to render the PNG (apt-get install chromium)")
    with tempfile.TemporaryDirectory(prefix="peers-png-") as tmp:
        html = Path(tmp) / "chart.html"
        html.write_text(page(c, caption))
        res = subprocess.run(
            [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
             f"--user-data-dir={tmp}/profile", f"--window-size={size[0]},{size[1]}",
             f"--screenshot={path.resolve()}", html.as_uri()],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    if res.returncode != 0 or not path.is_file():
        raise RuntimeError(f"chromium did not write {path}: {res.stderr[-1000:]}")
