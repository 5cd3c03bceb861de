"""Simulated idle time against the published closed forms, for a fixed list of configurations.

Launch: python benchmarks/pipeline_schedule_formulas.py [--markdown]

Costs here are per action (one stage or chunk), the papers' convention, so the columns plug
straight into the formulas. Idle is per rank (makespan minus the rank's busy time); a set with
several values means the ranks differ. "steady" is the idle one iteration adds when iterations
run back to back (see refimpl/parallel/pipeline/simulate.py). Everything is exact arithmetic;
nothing here measures wall-clock time.
"""

from __future__ import annotations

import argparse
from fractions import Fraction

from refimpl.parallel.pipeline import Costs, build, closed_form, simulate

CONFIGS = [
    # (schedule, pp, micro-batches, chunks, costs, latency, why it is listed)
    ("1f1b", 4, 8, None, "F=1,B=2", 0, "exact for any F, B"),
    ("1f1b", 4, 8, None, "F=1,B=3", 0, "exact for any F, B"),
    ("1f1b", 4, 8, None, "F=1,B=2", "1/2", "latency: the formula becomes a lower bound"),
    ("gpipe", 4, 8, None, "F=1,B=2", "1/2", "GPipe pays each hop twice: (p-1)(F+B+2L)"),
    ("interleaved", 4, 8, 2, "F=1/2,B=1", 0, "chunk costs = stage costs / v"),
    ("zb1p", 4, 8, None, "F=1,I=1,W=1", 0, "exact: W <= F and W <= I"),
    ("zb1p", 4, 8, None, "F=2,I=1,W=1", 0, "exact: W <= F and W <= I"),
    ("zb1p", 4, 8, None, "F=1,I=1,W=2", 0, "W > I: start-up (p-1)F exceeds the formula"),
    ("zbh2", 4, 8, None, "F=1,I=1,W=1", 0, "zero in steady state; (p-1)F in one iteration"),
    ("zbh2", 4, 8, None, "F=2,I=1,W=1", 0, "steady (p-1)(F+I-2W); one iteration max((p-1)F, that)"),
    ("zbv", 4, 8, None, "F=1,I=1,W=1", 0, "zero in steady state at F = I = W"),
    ("zbv", 4, 8, None, "F=1,I=2,W=1", 0, "unequal costs: not bubble-free (order tuned for F = I = W)"),
    ("dualpipe", 8, 20, None, "F=1,I=1,W=1", 0, "exact at balanced costs"),
    ("dualpipe", 8, 20, None, "F=2,I=1,W=1", 0, "unbalanced: above the formula"),
    ("dualpipe", 8, 20, None, "F=1,I=2,W=1", 0, "unbalanced: below the formula"),
    ("dualpipe", 8, 20, None, "F=1,I=1,W=1,FB=2", 0, "F&B < F+B: the ranks differ"),
    ("dualpipev", 4, 10, None, "F=1,I=1,W=1", 0, "exact at balanced costs (PP = 8 stages)"),
    ("dualpipev", 4, 10, None, "F=2,I=1,W=1", 0, "unbalanced: above the formula"),
]


def fmt(x) -> str:
    x = Fraction(x)
    return str(x.numerator) if x.denominator == 1 else str(x)


def values(xs) -> str:
    return ", ".join(fmt(x) for x in sorted(set(xs)))


def rows():
    for name, pp, m, chunks, costs_text, latency, why in CONFIGS:
        schedule = build(name, pp, m, chunks)
        costs = Costs.parse(costs_text)
        timeline = simulate(schedule, costs, Fraction(latency))
        closed = closed_form(schedule, costs, Fraction(latency))
        simulated = timeline.steady_state_idle if closed.accounting == "steady-state" else timeline.idle
        agrees = set(simulated) == {closed.idle}
        yield [
            name,
            str(pp),
            str(m),
            costs_text + ("" if not latency else f", L={latency}"),
            values(timeline.idle),
            values(timeline.steady_state_idle),
            f"{closed.formula} = {fmt(closed.idle)}" + (" (steady)" if closed.accounting == "steady-state" else ""),
            ("exact" if closed.exact else "not exact") + (", agrees" if agrees else ", differs"),
            why,
        ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    header = ["schedule", "pp", "m", "costs", "idle per rank", "steady", "closed form", "verdict", "why listed"]
    table = list(rows())
    if args.markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "|".join("---" for _ in header) + "|")
        for row in table:
            print("| " + " | ".join(row) + " |")
    else:
        widths = [max(len(h), *(len(r[i]) for r in table)) for i, h in enumerate(header)]
        for row in [header, *table]:
            print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())


if __name__ == "__main__":
    main()
