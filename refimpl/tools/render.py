"""Pictures of a simulated schedule: a text grid, an SVG, a PNG (if matplotlib is installed) and
a Chrome trace that Perfetto (ui.perfetto.dev) or chrome://tracing opens.

Every picture has one row per rank and time running left to right, like the figures of the
Megatron-LM, zero-bubble and DualPipe papers. A cell shows the action's kind and micro-batch:

    F3   forward of micro-batch 3         B3  full backward
    I3   input-gradient half              W3  weight-gradient half
    f3, b3, i3, w3   the same on a rank's second stage: chunk 1 of a V (ZB-V, DualPipeV) or
                     direction 1 of DualPipe
    F3.2             interleaved 1F1B: chunk 2 of the rank
    F5&b1            an overlapped F&B step
    .                idle

Only `render_png` needs matplotlib, and it is imported inside that function; nothing else in
refimpl depends on it.

`render_lanes_svg` draws the inside of one step (an F&B with the experts' all-to-alls) as lanes:
the compute lane (the F's and the B's chunks, one task at a time), each action's all-to-alls in
flight, and the waits on them (exposed communication); `step_lanes` sorts the simulator's
Segments or a measured run's pacing.Pacing events into those lanes.
"""

from __future__ import annotations

import math
from fractions import Fraction
from xml.sax.saxutils import escape  # "3&5" must be "3&amp;5" in SVG text

from refimpl.parallel.pipeline.actions import Action, Schedule, step_label
from refimpl.parallel.pipeline.simulate import Timeline


def _quantum(timeline: Timeline) -> Fraction:
    """The largest time unit that divides every start and end: one grid column."""
    values = [t for iv in timeline.intervals for s, e, _ in iv for t in (s, e) if t]
    if not values:
        return Fraction(1)
    denominator = math.lcm(*(v.denominator for v in values))
    numerator = math.gcd(*(v.numerator * (denominator // v.denominator) for v in values))
    return Fraction(numerator, denominator)


def render_text(timeline: Timeline, max_columns: int = 160) -> str:
    """An ASCII grid, one row per rank; one column per time quantum (coarsened past
    `max_columns`, in which case short steps may hide behind their neighbours)."""
    schedule = timeline.schedule
    quantum = _quantum(timeline)
    columns = int(timeline.makespan / quantum) if timeline.makespan else 0
    if columns > max_columns:
        quantum = timeline.makespan / max_columns
        columns = max_columns
    labels = [[step_label(schedule, step) for _, _, step in iv] for iv in timeline.intervals]
    single = [len(label) for row in labels for label in row if "&" not in label]
    width = max(single, default=2) + 1
    lines = []
    for rank, iv in enumerate(timeline.intervals):
        cells = ["." + " " * (width - 1) for _ in range(columns)]
        for (start, end, _), label in zip(iv, labels[rank]):
            first = int(start / quantum)
            last = max(first + 1, int(math.ceil(end / quantum)))
            span = (last - first) * width
            text = (label + "-" * span)[: span - 1] + " "  # label, continued by dashes
            for j in range(first, min(last, columns)):
                k = j - first
                cells[j] = text[k * width : (k + 1) * width]
        lines.append(f"rank {rank:>2} | " + "".join(cells).rstrip())
    unit = f"one column = {float(quantum):g} time unit{'s' if quantum != 1 else ''}"
    return "\n".join(lines + [f"({unit}; '.' = idle)"])


# --------------------------------------------------------------------------------------------
# Colours: one hue per kind; the second stage / direction 1 is a darker shade.
# --------------------------------------------------------------------------------------------

_COLOURS = {
    ("F", 0): "#8fb9e8", ("F", 1): "#3d7cc9",
    ("B", 0): "#9fd8a4", ("B", 1): "#3f9d4a",
    ("I", 0): "#f4c27a", ("I", 1): "#d98b1c",
    ("W", 0): "#d0d0d0", ("W", 1): "#8c8c8c",
}


def _shade(schedule: Schedule, action: Action) -> int:
    if action.direction is not None:
        return action.direction
    own = schedule.placement.stages_of(schedule.placement.rank_of(action.stage))
    return 1 if len(own) > 1 and own.index(action.stage) % 2 == 1 else 0


def colour(schedule: Schedule, action: Action) -> str:
    return _COLOURS[(action.kind, _shade(schedule, action))]


def _boxes(timeline: Timeline):
    """(rank, start, end, [(fraction of the row height, colour)], label) for every step."""
    schedule = timeline.schedule
    for rank, iv in enumerate(timeline.intervals):
        for start, end, step in iv:
            parts = step.parts
            bands = [(1 / len(parts), colour(schedule, a)) for a in parts]
            yield rank, start, end, bands, "&".join(str(a.mb) for a in parts)


def render_svg(timeline: Timeline, cell: int = 22, row: int = 26) -> str:
    """A standalone SVG: rows are ranks, width proportional to time."""
    schedule = timeline.schedule
    left, top = 60, 30
    scale = cell / min((c for c in (timeline.costs.F, timeline.costs.I, timeline.costs.W) if c), default=Fraction(1))
    width = left + int(float(timeline.makespan * scale)) + 20
    height = top + row * schedule.pp + 30
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        'font-family="monospace" font-size="11">',
        f'<text x="{left}" y="18">{schedule.name}: pp={schedule.pp}, micro-batches={schedule.micro_batches}, '
        f"makespan={float(timeline.makespan):g}, bubble={float(timeline.bubble_fraction):.3f}</text>",
    ]
    for rank in range(schedule.pp):
        out.append(f'<text x="4" y="{top + rank * row + row * 0.65:.1f}">rank {rank}</text>')
    for rank, start, end, bands, label in _boxes(timeline):
        x, w = left + float(start * scale), float((end - start) * scale)
        y = top + rank * row
        offset = 0.0
        for share, fill in bands:
            h = (row - 2) * share
            out.append(f'<rect x="{x:.1f}" y="{y + offset:.1f}" width="{w:.1f}" height="{h:.1f}" fill="{fill}" '
                       'stroke="#333" stroke-width="0.5"/>')
            offset += h
        out.append(f'<text x="{x + w / 2:.1f}" y="{y + row * 0.6:.1f}" text-anchor="middle">{escape(label)}</text>')
    legend = "F forward, B backward, I input grad, W weight grad; darker: second stage / direction 1"
    out.append(f'<text x="{left}" y="{height - 8}">{legend}</text>')
    out.append("</svg>")
    return "\n".join(out)


_LANE_COLOURS = {("compute", "F"): "#8fb9e8", ("compute", "B"): "#9fd8a4", ("compute", "I"): "#f4c27a",
                 ("all_to_all", "F"): "#d2e3f6", ("all_to_all", "B"): "#d8f0da", ("all_to_all", "I"): "#fbe6c6",
                 ("wait", "F"): "#e06666", ("wait", "B"): "#e06666", ("wait", "I"): "#e06666"}


def step_lanes(events) -> list:
    """(lane title, [(start, end, label, fill)]) from (lane, label, start, end) events (simulate.Segment
    fields, or pacing.Pacing events; a label starts with its action: F3, B1): the compute lane, one
    lane of all-to-alls in flight per action (the F's and the B's overlap in time), the waits."""
    events = list(events)

    def boxes(lane, keep=lambda label: True):
        return [(start, end, label, _LANE_COLOURS.get((lane, label[:1].upper()), "#cccccc"))
                for kind, label, start, end in events if kind == lane and keep(label)]

    actions = list(dict.fromkeys(label.split()[0] for kind, label, _, _ in events if kind == "all_to_all"))
    return ([("compute", boxes("compute"))]
            + [(f"{action} all-to-all", boxes("all_to_all", lambda label, a=action: label.split()[0] == a))
               for action in actions]
            + [("blocked (exposed)", boxes("wait"))])


def render_lanes_svg(title: str, groups, width: int = 900, row: int = 24, unit: str = "ms",
                     per_unit: float = 1e3) -> str:
    """A standalone SVG of one or more groups of lanes on one time axis (seconds from the step's
    start, shown in `unit`: per_unit of them a second): groups = [(group title, [(lane title,
    [(start, end, label, fill)])])]."""
    left, top = 150, 34
    end = max((e for _, lanes in groups for _, boxes in lanes for _, e, _, _ in boxes), default=1.0) or 1.0
    scale = (width - left - 20) / float(end)
    height = top + sum(18 + row * len(lanes) + 8 for _, lanes in groups) + 24
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="monospace" '
           f'font-size="11">', f'<text x="4" y="18">{escape(title)}</text>']
    y = top
    for group, lanes in groups:
        out.append(f'<text x="4" y="{y + 12}" font-weight="bold">{escape(group)}</text>')
        y += 18
        for lane, boxes in lanes:
            out.append(f'<text x="8" y="{y + row * 0.65:.1f}">{escape(lane)}</text>')
            for start, stop, label, fill in boxes:
                x, w = left + float(start) * scale, max(0.5, float(stop - start) * scale)
                out.append(f'<rect x="{x:.1f}" y="{y + 1}" width="{w:.1f}" height="{row - 3}" fill="{fill}" '
                           f'stroke="#333" stroke-width="0.5"><title>{escape(label)}</title></rect>')
                if w > 7 * len(label):
                    out.append(f'<text x="{x + w / 2:.1f}" y="{y + row * 0.62:.1f}" text-anchor="middle">'
                               f'{escape(label)}</text>')
            y += row
        y += 8
    ticks = 10
    for i in range(ticks + 1):
        t = float(end) * i / ticks
        x = left + t * scale
        out.append(f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{y}" stroke="#bbb" stroke-width="0.3"/>')
        out.append(f'<text x="{x:.1f}" y="{y + 14}" text-anchor="middle">{t * per_unit:.4g}</text>')
    out.append(f'<text x="8" y="{y + 14}">time ({escape(unit)})</text>')
    out.append("</svg>")
    return "\n".join(out)


def render_png(timeline: Timeline, path: str) -> None:
    """Draw the timeline with matplotlib into `path` (needs `pip install matplotlib`)."""
    try:
        import matplotlib  # noqa: PLC0415 - matplotlib is optional (PNG output only)

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415 - matplotlib is optional
    except ImportError:
        raise ValueError("PNG output needs matplotlib (pip install matplotlib); --render svg needs nothing") from None
    schedule = timeline.schedule
    fig, ax = plt.subplots(figsize=(max(6.0, float(timeline.makespan) * 0.25), 0.5 * schedule.pp + 1))
    for rank, start, end, bands, label in _boxes(timeline):
        offset = 0.0
        for share, fill in bands:
            ax.broken_barh([(float(start), float(end - start))], (rank + offset - 0.45, 0.9 * share),
                           facecolors=fill, edgecolor="#333", linewidth=0.4)
            offset += 0.9 * share
        ax.text(float(start + end) / 2, rank, label, ha="center", va="center", fontsize=7)
    ax.set_yticks(range(schedule.pp), [f"rank {r}" for r in range(schedule.pp)])
    ax.invert_yaxis()
    ax.set_xlabel("time")
    ax.set_title(f"{schedule.name}: pp={schedule.pp}, m={schedule.micro_batches}, "
                 f"bubble {float(timeline.bubble_fraction):.3f}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def render_trace(timeline: Timeline, microseconds_per_unit: float = 1000.0) -> dict:
    """Chrome trace-event JSON of a simulated timeline: one thread per rank, one complete event per
    step. (A measured run's trace is timeline.chrome_trace.)"""
    schedule = timeline.schedule
    events = [
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": f"rank {r}"}}
        for r in range(schedule.pp)
    ]
    for rank, iv in enumerate(timeline.intervals):
        for start, end, step in iv:
            events.append(
                {
                    "name": step_label(schedule, step),
                    "cat": step.kind,
                    "ph": "X",
                    "pid": 0,
                    "tid": rank,
                    "ts": float(start) * microseconds_per_unit,
                    "dur": float(end - start) * microseconds_per_unit,
                    "args": {"step": str(step)},
                }
            )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


__all__ = ["render_text", "render_svg", "render_png", "render_trace", "render_lanes_svg",
           "step_lanes"]
