"""`python -m refimpl schedule`: generate, validate, simulate and draw a pipeline schedule.

    python -m refimpl schedule 1f1b --pp 4 --micro-batches 8
    python -m refimpl schedule dualpipe --pp 8 --micro-batches 20 --render svg --out dualpipe.svg
    python -m refimpl schedule zbv --pp 4 --micro-batches 8 --costs F=1,I=1,W=1 --json
    python -m refimpl schedule --compare --pp 4 --micro-batches 16 --markdown
    python -m refimpl schedule interleaved --pp 4 --micro-batches 8 --chunks 2 --program
    python -m refimpl schedule docs/examples/my_schedule.py:early_backward --pp 4 --micro-batches 8

A schedule of your own is named MODULE:FUNCTION or FILE.py:FUNCTION (a generator like the built-in
ones; refimpl/parallel/pipeline/schedules/__init__.py, docs/capstone.md): it is built, validated,
simulated and drawn like them; there is no closed form to show beside it, so the report compares
it with 1F1B at the same pp, micro-batches and costs instead, and `--compare` adds it as a row.

Costs. `--costs` are the times of one forward / backward / ... of one rank's share of the model
(1/pp of it), so that the schedules can be compared on the same model. A schedule that cuts the
model into more stages than ranks (interleaved: v*pp, zbv and dualpipev: 2*pp) runs actions that
are proportionally smaller, and their costs are scaled by pp/stages; `--costs-per-action` turns
that scaling off. B defaults to I + W and F&B (written FB) to F + B.

Output: the text timeline, a per-rank table (busy, idle, closed-form idle, peak activations in
both conventions, steady-state idle), the totals and the validator's report. With `--json`, one
JSON object on one line on stdout (and a one-line summary on stderr).
"""

from __future__ import annotations

import argparse
import json
from fractions import Fraction

from refimpl.parallel.pipeline.actions import Overlapped, Schedule, format_rank
from refimpl.parallel.pipeline.formulas import ClosedForm, closed_form
from refimpl.parallel.pipeline.schedules import SCHEDULES, build
from refimpl.parallel.pipeline.simulate import Costs, Timeline, simulate
from refimpl.parallel.pipeline.validate import Report, validate
from refimpl.tools.console import emit_json, log
from refimpl.tools.flags import add_max_work_argument, check_work, check_writable, positive_int, schedule_name
from refimpl.tools.plugin import build_schedule
from refimpl.tools.plugin import is_spec as is_plugin
from refimpl.tools.render import render_png, render_svg, render_text, render_trace


def add_arguments(parser: argparse.ArgumentParser) -> None:
    names = list(SCHEDULES)
    parser.add_argument("name", nargs="?", type=schedule_name, metavar="NAME",
                        help=f"schedule: {', '.join(names)}, or MODULE:FUNCTION (FILE.py:FUNCTION) of your own")
    parser.add_argument("--schedule", type=schedule_name, help="the schedule (same as NAME)")
    parser.add_argument("--pp", type=positive_int, required=True, help="number of pipeline ranks")
    parser.add_argument("--micro-batches", type=positive_int, required=True, help="micro-batches per iteration")
    parser.add_argument("--chunks", type=positive_int, default=None,
                        help="model chunks per rank (interleaved; default 2)")
    parser.add_argument("--costs", default="F=1,B=2,I=1,W=1", help="action costs, e.g. F=1,B=2,I=1,W=1,FB=3")
    parser.add_argument("--costs-per-action", action="store_true", help="do not scale costs by pp/stages")
    parser.add_argument("--latency", default="0", help="point-to-point latency per message (default 0)")
    parser.add_argument("--render", choices=["text", "svg", "png", "trace", "none"], default="text")
    parser.add_argument("--out", help="file for --render svg/png/trace (text: default stdout)")
    parser.add_argument("--png", metavar="FILE", help="shorthand for --render png --out FILE")
    parser.add_argument("--compare", action="store_true", help="one table of every schedule")
    parser.add_argument("--program", action="store_true", help="print each rank's action list")
    parser.add_argument("--markdown", action="store_true", help="print Markdown (for docs)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    add_max_work_argument(parser, MAX_ACTIONS, "actions (3 x stages x micro-batches, per schedule)")


MAX_ACTIONS = 100_000  # generating, validating and simulating this many actions takes tens of seconds


def actions_estimate(pp: int, micro_batches: int, chunks: int | None) -> int:
    """An upper bound on a schedule's actions (F, B or I and W per stage and micro-batch), before building it:
    at most max(chunks, 2) stages per rank (interleaved's chunks; zbv and dualpipev's two)."""
    return 3 * pp * max(chunks or 2, 2) * micro_batches


def check_exact_number(text: str, flag: str) -> None:
    """Refuse, before Fraction() expands it, a number whose exact value is astronomically long (1e100000000)."""
    text = text.strip()
    mantissa, _, exponent = text.lower().partition("e")
    if len(text) > 60 or (exponent and not (exponent.lstrip("+-").isdigit() and abs(int(exponent)) <= 300)):
        shown = text if len(text) <= 40 else text[:37] + "..."
        raise ValueError(f"{flag} {shown!r}: write a number such as 1, 0.5 or 1/3 (at most 60 characters, "
                         f"exponents within ±300)")


# --------------------------------------------------------------------------------------------
# Running one schedule
# --------------------------------------------------------------------------------------------


def _number(x):
    """Fractions as JSON numbers: integers stay integers."""
    if isinstance(x, Fraction):
        return x.numerator if x.denominator == 1 else float(x)
    return x


def _fmt(x) -> str:
    if isinstance(x, Fraction):
        return str(x.numerator) if x.denominator == 1 else f"{float(x):.4g}"
    return str(x)


def action_json(step) -> dict:
    if isinstance(step, Overlapped):
        return {"kind": "F&B", "f": action_json(step.f), "b": action_json(step.b)}
    out = {"kind": step.kind, "stage": step.stage, "mb": step.mb}
    if step.direction is not None:
        out["dir"] = step.direction
    return out


def scaled_costs(schedule: Schedule, costs: Costs, per_action: bool) -> Costs:
    return costs if per_action else costs.scaled(Fraction(schedule.pp, schedule.num_stages))


def analyse(name: str, pp: int, m: int, chunks, costs: Costs, per_action: bool, latency):
    schedule = build_schedule(name, pp, m, chunks)
    report = validate(schedule)
    action_costs = scaled_costs(schedule, costs, per_action)
    timeline = simulate(schedule, action_costs, latency)
    closed = closed_form(schedule, action_costs, latency) if not is_plugin(name) else own_form(pp, m, costs, latency)
    return schedule, report, timeline, closed


OWN = "1F1B, simulated"  # the ClosedForm.formula of a schedule of your own (its baseline)


def own_form(pp: int, m: int, costs: Costs, latency) -> ClosedForm:
    """A schedule of your own has no published closed form: 1F1B's simulated figures stand beside it."""
    base = build("1f1b", pp, m)
    timeline = simulate(base, costs, latency)
    idle = max(timeline.idle)
    note = (f"a schedule of your own: no closed form; compared with 1F1B simulated at the same pp, micro-batches and "
            f"costs (makespan {_fmt(timeline.makespan)}, bubble fraction {float(timeline.bubble_fraction):.4f}, "
            f"peak activations {timeline.peak_activations})")
    return ClosedForm(OWN, idle, "iteration", False, note, idle, timeline.bubble_fraction,
                      list(timeline.peak_activations))


def summary(schedule: Schedule, report: Report, timeline: Timeline, closed: ClosedForm) -> dict:
    """Everything the command reports about one schedule, as plain JSON values."""
    pp = schedule.pp
    return {
        "schedule": schedule.name,
        "pp": pp,
        "micro_batches": schedule.micro_batches,
        "chunks": schedule.chunks,
        "num_stages": schedule.num_stages,
        "costs": {k: _number(v) for k, v in timeline.costs.as_dict().items()},
        "latency": _number(timeline.latency),
        "makespan": _number(timeline.makespan),
        "busy_per_rank": [_number(x) for x in timeline.busy],
        "idle_per_rank": [_number(x) for x in timeline.idle],
        "bubble_fraction": float(timeline.bubble_fraction),
        "steady_state_idle_per_rank": [_number(x) for x in timeline.steady_state_idle],
        "peak_activations_per_rank": timeline.peak_activations,
        "peak_activations_freed_at_i_per_rank": timeline.peak_freed_at_i,
        "peak_activation_memory_per_rank": [
            float(Fraction(x * pp, schedule.num_stages)) for x in timeline.peak_activations
        ],
        "parameter_copies_per_rank": [schedule.parameter_share(r) for r in range(pp)],
        "closed_form": {
            "formula": closed.formula,
            "idle": _number(closed.idle),
            "accounting": closed.accounting,
            "exact": closed.exact,
            "iteration_idle": _number(closed.iteration_idle) if closed.iteration_idle is not None else None,
            "bubble_fraction": float(closed.bubble_fraction) if closed.bubble_fraction is not None else None,
            "peak_activations_per_rank": closed.peak_activations,
            "note": closed.note,
        },
        "validation": {
            "valid": True,
            "actions": report.actions,
            "messages": report.messages,
            "rendezvous_lookahead": report.rendezvous_lookahead,
            "fifo_channels": report.fifo_channels,
            "per_channel_ok": report.per_channel_ok,
        },
        "placement": [list(row) for row in schedule.placement.table],
    }


def rank_table(schedule: Schedule, timeline: Timeline, closed: ClosedForm, markdown: bool) -> str:
    simulated_key = "steady-state idle" if closed.accounting == "steady-state" else "idle"
    baseline = "1F1B idle" if closed.formula == OWN else f"closed form ({simulated_key})"
    header = ["rank", "stages", "busy", "idle", "steady-state idle", baseline,
              "peak act. (free at W)", "peak act. (free at I)"]
    rows = []
    for r in range(schedule.pp):
        rows.append(
            [
                str(r),
                ",".join(map(str, schedule.placement.stages_of(r))),
                _fmt(timeline.busy[r]),
                _fmt(timeline.idle[r]),
                _fmt(timeline.steady_state_idle[r]),
                _fmt(closed.idle) + ("" if closed.exact or closed.formula == OWN else " ~"),
                str(timeline.peak_activations[r]),
                str(timeline.peak_freed_at_i[r]),
            ]
        )
    return _table(header, rows, markdown)


def _table(header: list[str], rows: list[list[str]], markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines)
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(lines)


def describe(
    schedule: Schedule, report: Report, timeline: Timeline, closed: ClosedForm, markdown: bool, picture: bool = True
) -> str:
    c = timeline.costs
    costs = ", ".join(f"{k}={_fmt(v)}" for k, v in c.as_dict().items())
    exact = "exact" if closed.exact else "not exact here"
    lines = [
        f"{schedule.name}: pp={schedule.pp} ranks, {schedule.micro_batches} micro-batches, "
        f"{schedule.num_stages} stages; action costs {costs}; latency {_fmt(timeline.latency)}",
        "",
    ]
    if picture:
        grid = render_text(timeline)
        lines += [f"```\n{grid}\n```" if markdown else grid, ""]
    bullet = "- " if markdown else ""
    if closed.formula == OWN:  # a schedule of your own: beside 1F1B rather than a published formula
        ours = max(timeline.idle)
        lines += [
            rank_table(schedule, timeline, closed, markdown),
            "",
            f"{bullet}makespan {_fmt(timeline.makespan)}, bubble fraction {float(timeline.bubble_fraction):.4f} "
            f"(1F1B: {float(closed.bubble_fraction):.4f}); idle per rank at most {_fmt(ours)} (1F1B: "
            f"{_fmt(closed.idle)}); peak activations {timeline.peak_activations} (1F1B: {closed.peak_activations})",
            f"{bullet}{closed.note}",
            f"{bullet}validated: {report.actions} actions, {report.messages} messages; rendezvous run completes with "
            f"receives pre-posted {report.rendezvous_lookahead} step(s) ahead"
            + ("; or with one receive per (source, kind) channel (the executor's policy: it can run over MPI)"
               if report.per_channel_ok else "; NOT with one receive per (source, kind) channel: the executor "
               "(train, verify) cannot run it"),
        ]
        return "\n".join(lines)
    lines += [
        rank_table(schedule, timeline, closed, markdown),
        "",
        f"{bullet}makespan {_fmt(timeline.makespan)}, bubble fraction {float(timeline.bubble_fraction):.4f}"
        + (f" (published: {float(closed.bubble_fraction):.4f})" if closed.bubble_fraction is not None else ""),
        f"{bullet}closed form {closed.formula} = {_fmt(closed.idle)} per rank, {closed.accounting} accounting, "
        f"{exact}: {closed.note}",
        f"{bullet}validated: {report.actions} actions, {report.messages} messages; rendezvous run completes with "
        f"receives pre-posted {report.rendezvous_lookahead} step(s) ahead"
        + ("; or with one receive per (source, kind) channel" if report.per_channel_ok else ""),
    ]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Comparing every schedule
# --------------------------------------------------------------------------------------------


def compare(args, costs: Costs) -> tuple[str, list[dict]]:
    header = [
        "schedule", "stages", "makespan", "bubble", "idle per rank", "steady-state idle",
        "closed form", "peak act.", "act. memory", "params", "lookahead",
    ]
    rows, results = [], []
    own = [n for n in (args.name, args.schedule) if n and is_plugin(n)]
    for name in [*SCHEDULES, *dict.fromkeys(own)]:
        chunks = args.chunks if name == "interleaved" or is_plugin(name) else None
        try:
            schedule, report, timeline, closed = analyse(name, args.pp, args.micro_batches, chunks, costs,
                                                         args.costs_per_action, args.latency)
        except ValueError as exc:
            rows.append([name, "-", "-", "-", f"n/a: {exc}", *["-"] * 6])
            results.append({"schedule": name, "error": str(exc)})
            continue
        info = summary(schedule, report, timeline, closed)
        results.append({k: v for k, v in info.items() if k != "placement"})
        idle = sorted(set(timeline.idle))
        steady = sorted(set(timeline.steady_state_idle))
        accounting = "(" + closed.accounting + ")" if closed.accounting != "iteration" else ""
        stages_per_rank = [len(schedule.placement.stages_of(r)) for r in range(args.pp)]
        rows.append(
            [
                name,
                str(schedule.num_stages),
                _fmt(timeline.makespan),
                f"{float(timeline.bubble_fraction):.3f}",
                ",".join(_fmt(x) for x in timeline.idle) if len(idle) > 1 else _fmt(idle[0]),
                ",".join(_fmt(x) for x in timeline.steady_state_idle) if len(steady) > 1 else _fmt(steady[0]),
                f"1F1B: {_fmt(closed.idle)}" if closed.formula == OWN else
                f"{_fmt(closed.idle)} {accounting}".strip()
                + ("" if closed.exact else " ~"),
                str(max(timeline.peak_activations)),
                _fmt(max(Fraction(x * args.pp, schedule.num_stages) for x in timeline.peak_activations)),
                _fmt(max(Fraction(n * args.pp, schedule.num_stages) for n in stages_per_rank)),
                str(report.rendezvous_lookahead),
            ]
        )
    return _table(header, rows, args.markdown), results


COMPARE_LEGEND = (
    "makespan and idle in the units of --costs (per 1/pp of the model); "
    "bubble = idle per rank / makespan (total idle / (pp * makespan)); "
    "closed form: published idle per rank ('~' = not exact for these costs, see docs); "
    "peak act. = most (stage, micro-batch) activations held by one rank (freed at W); "
    "act. memory and params in units of one 1F1B rank's (1/pp of the model); "
    "lookahead = steps of receives an executor must pre-post for a rendezvous run (validate.py)"
)


# --------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------


def run(args) -> int:
    name = args.name or args.schedule
    if args.name and args.schedule and args.name != args.schedule:
        raise ValueError(f"two schedules given ({args.name} and --schedule {args.schedule}); give one")
    for item in args.costs.split(","):
        check_exact_number(item.partition("=")[2], "--costs")
    check_exact_number(args.latency, "--latency")
    costs = Costs.parse(args.costs)
    try:
        Fraction(args.latency)
    except (ValueError, ZeroDivisionError):
        raise ValueError(f"--latency must be a number such as 0, 0.1 or 1/4; got {args.latency!r}") from None
    if Fraction(args.latency) < 0:
        raise ValueError(f"--latency must be >= 0; got {args.latency}")
    count = len(SCHEDULES) + 1 if args.compare else 1
    check_work(count * actions_estimate(args.pp, args.micro_batches, args.chunks), args.max_work, "actions",
               f"{'--compare' if args.compare else 'the schedule'} at --pp {args.pp}, --micro-batches "
               f"{args.micro_batches}")
    if args.png:
        check_writable(args.png, "--png")
    elif args.out:
        check_writable(args.out, "--out")
    if args.compare:
        table, results = compare(args, costs)
        if args.json:
            log(f"compared {len(results)} schedules at pp={args.pp}, micro-batches={args.micro_batches}")
            emit_json({"pp": args.pp, "micro_batches": args.micro_batches, "costs": args.costs, "schedules": results})
        else:
            print(table)
            print()
            print(COMPARE_LEGEND)
        return 0
    if name is None:
        raise ValueError("name a schedule (e.g. 'schedule 1f1b --pp 4 --micro-batches 8') or pass --compare")
    schedule, report, timeline, closed = analyse(name, args.pp, args.micro_batches, args.chunks, costs,
                                                 args.costs_per_action, args.latency)
    render, out = args.render, args.out
    if args.png:
        render, out = "png", args.png
    if render in ("svg", "png", "trace") and not out:
        raise ValueError(f"--render {render} writes a file: add --out FILE")
    if render == "svg":
        with open(out, "w") as f:
            f.write(render_svg(timeline))
    elif render == "png":
        render_png(timeline, out)
    elif render == "trace":
        with open(out, "w") as f:
            json.dump(render_trace(timeline), f)
    if render != "text" and out:
        log(f"wrote {out}")
    if args.json:
        info = summary(schedule, report, timeline, closed)
        info["actions"] = [[action_json(step) for step in steps] for steps in schedule.ranks]
        log(
            f"{schedule.name}: makespan {_fmt(timeline.makespan)}, "
            f"bubble fraction {float(timeline.bubble_fraction):.4f}, "
            f"idle per rank {[_fmt(x) for x in timeline.idle]}"
        )
        emit_json(info)
        return 0
    text = describe(schedule, report, timeline, closed, args.markdown, picture=render == "text")
    if args.program:
        program = "\n".join(f"rank {r}: {format_rank(steps)}" for r, steps in enumerate(schedule.ranks))
        text += "\n\n" + ("```\n" + program + "\n```" if args.markdown else program)
    if render == "text" and out:
        with open(out, "w") as f:
            f.write(text + "\n")
        log(f"wrote {out}")
    else:
        print(text)
    return 0


__all__ = ["add_arguments", "run", "action_json", "summary"]
