"""Line charts as inline SVG strings: no scripts, no fonts, no network."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from html import escape

__all__ = ["line_chart", "PALETTE"]

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf")

W, H = 640, 280
LEFT, RIGHT, TOP, BOTTOM = 78, 150, 34, 40


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def _num(v: float) -> str:
    a = abs(v)
    if a == 0:
        return "0"
    for div, unit in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if a >= div:
            return f"{v / div:.3g}{unit}"
    return f"{v:.3g}"


def line_chart(plot_id: str, title: str, series: dict[str, Sequence[tuple[float, float]]], *,
               x_label: str = "step", y_label: str = "", y_format: Callable[[float], str] = _num) -> str:
    """A ``<figure id=plot_id>`` holding an SVG line chart of ``series`` (name -> (x, y) points).

    Non-finite points are dropped; a series with no points is listed in the legend as "no data".
    """
    clean = {k: [(float(x), float(y)) for x, y in pts if math.isfinite(x) and math.isfinite(y)]
             for k, pts in series.items()}
    xs = [x for pts in clean.values() for x, _ in pts]
    ys = [y for pts in clean.values() for _, y in pts]
    x0, x1 = (min(xs), max(xs)) if xs else (0.0, 1.0)
    y0, y1 = (min(ys), max(ys)) if ys else (0.0, 1.0)
    if y0 > 0 and y0 < 0.5 * y1:
        y0 = 0.0  # positive quantities that vary a lot read better from zero
    if x1 == x0:
        x1 = x0 + 1
    if y1 == y0:
        pad = abs(y0) * 0.1 or 1.0
        y0, y1 = y0 - pad, y1 + pad
    pw, ph = W - LEFT - RIGHT, H - TOP - BOTTOM

    def px(x: float) -> float:
        return LEFT + (x - x0) / (x1 - x0) * pw

    def py(y: float) -> float:
        return TOP + ph - (y - y0) / (y1 - y0) * ph

    out = [f'<figure class="plot" id="{escape(plot_id)}">',
           f'<svg role="img" aria-label="{escape(title)}" width="{W}" height="{H}" viewBox="0 0 {W} {H}">',
           f'<title>{escape(title)}</title>',
           f'<text x="{LEFT}" y="20" class="t">{escape(title)}</text>',
           f'<rect x="{LEFT}" y="{TOP}" width="{pw}" height="{ph}" class="frame"/>']
    for t in _ticks(y0, y1):
        y = py(t)
        out.append(f'<line x1="{LEFT}" x2="{LEFT + pw}" y1="{y:.1f}" y2="{y:.1f}" class="grid"/>')
        out.append(f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end" class="a">{escape(y_format(t))}</text>')
    for t in _ticks(x0, x1, 6):
        x = px(t)
        out.append(f'<text x="{x:.1f}" y="{TOP + ph + 16}" text-anchor="middle" class="a">{_num(t)}</text>')
    out.append(f'<text x="{LEFT + pw / 2:.0f}" y="{H - 6}" text-anchor="middle" class="a">{escape(x_label)}</text>')
    if y_label:
        out.append(f'<text x="14" y="{TOP + ph / 2:.0f}" text-anchor="middle" class="a" '
                   f'transform="rotate(-90 14 {TOP + ph / 2:.0f})">{escape(y_label)}</text>')
    for i, (name, pts) in enumerate(clean.items()):
        color = PALETTE[i % len(PALETTE)]
        if len(pts) == 1:
            x, y = pts[0]
            out.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{color}" class="series"/>')
        elif pts:
            path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
            out.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="1.8" class="series"/>')
        ly = TOP + 12 + 16 * i
        out.append(f'<line x1="{W - RIGHT + 10}" x2="{W - RIGHT + 28}" y1="{ly - 4}" y2="{ly - 4}" '
                   f'stroke="{color}" stroke-width="3"/>')
        label = name if pts else f"{name} (no data)"
        out.append(f'<text x="{W - RIGHT + 33}" y="{ly}" class="a">{escape(label)}</text>')
    out.append("</svg></figure>")
    return "\n".join(out)
