"""Line charts over time as inline SVG, rendered on the server (the admin pages load nothing from
elsewhere: no CDN, no script). Each chart is one <figure class="aotx-chart"> with its title, an
<svg> of one <polyline> per series and run of known values (a missing value breaks the line), a
dashed line for a capacity, y grid lines with labels, the first and last sample's time, and a
legend; `data-chart` names it and `data-points` counts its plotted values. The legend gives each
series' last plotted value with the time of the sample it comes from ("last sample 10:42:05 UTC"):
it is a stored sample, older than the live reading a page may show beside the chart, and the two
would otherwise disagree without saying why."""
from __future__ import annotations

import datetime
import math
from dataclasses import dataclass, field
from typing import Sequence, TypeVar

from django.utils.html import escape
from django.utils.safestring import SafeString, mark_safe

WIDTH, HEIGHT = 640, 170
LEFT, RIGHT, TOP, BOTTOM = 64, 12, 10, 24  # plot margins
COLORS = ("#2f6db5", "#d9822b", "#3a9a4a", "#b5382f", "#7d4fb5", "#5d6d7e")

Point = tuple[datetime.datetime, float | None]


@dataclass
class Series:
    label: str
    points: list[Point]
    dashed: bool = False  # a capacity or limit
    color: str | None = None


@dataclass
class Chart:
    slug: str
    title: str
    series: list[Series]
    unit: str = ""  # "bytes", "/s", "ms" or "" (a count)
    note: str = ""  # shown instead of the plot when there is nothing to draw
    extra: dict[str, str] = field(default_factory=dict)
    now: datetime.datetime | None = None  # the page's time: a legend's sample time on another day shows its date

    @property
    def points(self) -> int:
        return sum(1 for s in self.series for _, v in s.points if v is not None)

    def svg(self) -> SafeString:
        return render(self)


def human(value: float, unit: str) -> str:
    if unit == "bytes":
        for suffix, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
            if abs(value) >= size:
                return f"{value / size:.1f} {suffix}"
        return f"{value:.0f} B"
    if unit in ("/s", "ms"):
        text = f"{value:.2f}" if abs(value) < 10 else f"{value:.1f}" if abs(value) < 100 else f"{value:.0f}"
        return f"{text}{unit if unit == '/s' else ' ms'}"
    if value == int(value):
        return f"{int(value):,}"
    return f"{value:.1f}"


def _nice_top(value: float) -> float:
    """The smallest 1, 2, 2.5 or 5 × 10^k at or above value (the y axis top)."""
    if value <= 0:
        return 1.0
    exponent = math.floor(math.log10(value))
    for step in (1.0, 2.0, 2.5, 5.0, 10.0):
        top = step * 10 ** exponent
        if top >= value * (1 - 1e-9):
            return top
    return 10.0 ** (exponent + 1)


def _time(t: datetime.datetime, span: datetime.timedelta) -> str:
    return t.strftime("%Y-%m-%d %H:%M" if span >= datetime.timedelta(days=1) else "%H:%M:%S")


def sample_time(t: datetime.datetime, today: datetime.date) -> str:
    """When a sample was taken, in UTC: its time of day, with its date too when that is not `today`."""
    utc = t.astimezone(datetime.timezone.utc) if t.tzinfo is not None else t
    return utc.strftime("%H:%M:%S UTC" if utc.date() == today else "%Y-%m-%d %H:%M:%S UTC")


def _last(points: Sequence[Point]) -> tuple[datetime.datetime, float] | None:
    """A series' last known value and the time of its sample."""
    return next(((t, v) for t, v in reversed(points) if v is not None), None)


def render(chart: Chart) -> SafeString:
    today = (chart.now or datetime.datetime.now(datetime.timezone.utc)).astimezone(datetime.timezone.utc).date()
    values = [v for s in chart.series for _, v in s.points if v is not None]
    times = [t for s in chart.series for t, v in s.points if v is not None]
    head = (f'<figure class="aotx-chart" data-chart="{escape(chart.slug)}" data-points="{chart.points}">'
            f'<figcaption>{escape(chart.title)}</figcaption>')
    if not values:
        note = chart.note or "no samples yet"
        return mark_safe(f'{head}<svg class="aotx-empty" viewBox="0 0 {WIDTH} 40" width="100%" role="img" '
                         f'aria-label="{escape(chart.title)}: {escape(note)}"><text x="{LEFT}" y="24">'
                         f'{escape(note)}</text></svg></figure>')
    t0, t1 = min(times), max(times)
    span = t1 - t0
    seconds = span.total_seconds() or 1.0
    top = _nice_top(max(values))
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def x(t: datetime.datetime) -> float:
        return LEFT + (plot_w * (t - t0).total_seconds() / seconds if span else plot_w / 2)

    def y(v: float) -> float:
        return TOP + plot_h * (1 - max(v, 0.0) / top)

    parts = [f'<svg viewBox="0 0 {WIDTH} {HEIGHT}" width="100%" role="img" aria-label="{escape(chart.title)}" '
             f'font-size="11" font-family="sans-serif">']
    for i in range(5):  # grid and y labels: 0, 1/4 … top
        v = top * i / 4
        parts.append(f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#ccc" '
                     f'stroke-width="0.5"/><text x="{LEFT - 4}" y="{y(v) + 4:.1f}" text-anchor="end" '
                     f'fill="currentColor">{escape(human(v, chart.unit))}</text>')
    parts.append(f'<text x="{LEFT}" y="{HEIGHT - 6}" fill="currentColor">{escape(_time(t0, span))}</text>'
                 f'<text x="{WIDTH - RIGHT}" y="{HEIGHT - 6}" text-anchor="end" fill="currentColor">'
                 f'{escape(_time(t1, span))} UTC</text>')
    legend = []
    lasts = [_last(series.points) for series in chart.series]
    last_times = {last[0] for last in lasts if last is not None}
    shared_time = len(last_times) == 1  # one time for the whole legend, said once at its end
    for n, series in enumerate(chart.series):
        color = series.color or COLORS[n % len(COLORS)]
        dash = ' stroke-dasharray="5 3"' if series.dashed else ""
        for run in _runs(series.points):
            if len(run) == 1:
                t, v = run[0]
                parts.append(f'<circle class="aotx-series" data-series="{escape(series.label)}" cx="{x(t):.1f}" '
                             f'cy="{y(v):.1f}" r="2.5" fill="{color}"/>')
            else:
                coords = " ".join(f"{x(t):.1f},{y(v):.1f}" for t, v in run)
                parts.append(f'<polyline class="aotx-series" data-series="{escape(series.label)}" fill="none" '
                             f'stroke="{color}" stroke-width="1.5"{dash} points="{coords}"/>')
        last = lasts[n]
        value = ""
        if last is not None:
            value = f": {escape(human(last[1], chart.unit))}"
            if not shared_time:
                value += f' <span class="aotx-sampled">(last sample {escape(sample_time(last[0], today))})</span>'
        legend.append(f'<li><span class="aotx-swatch" style="border-color:{color};'
                      f'border-style:{"dashed" if series.dashed else "solid"}"></span>{escape(series.label)}{value}</li>')
    if shared_time:
        legend.append(f'<li class="aotx-sampled">(last sample {escape(sample_time(last_times.pop(), today))})</li>')
    parts.append("</svg>")
    return mark_safe(head + "".join(parts) + f'<ul class="aotx-legend">{"".join(legend)}</ul></figure>')


def _runs(points: Sequence[Point]) -> list[list[tuple[datetime.datetime, float]]]:
    runs: list[list[tuple[datetime.datetime, float]]] = [[]]
    for t, v in points:
        if v is None:
            if runs[-1]:
                runs.append([])
        else:
            runs[-1].append((t, v))
    return [r for r in runs if r]


T = TypeVar("T")


def thin(items: list[T], at_most: int) -> list[T]:
    """Every k-th item (and the last), so a chart draws at most about `at_most` points."""
    if len(items) <= at_most:
        return items
    step = math.ceil(len(items) / at_most)
    kept = items[::step]
    if kept[-1] is not items[-1]:
        kept.append(items[-1])
    return kept
