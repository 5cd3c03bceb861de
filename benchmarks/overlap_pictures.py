"""The picture of docs/experts.md §5: one DualPipe F&B step, simulated, with and without the overlap.

Launch:  python benchmarks/overlap_pictures.py [--out docs/images]
(python docs/generate.py runs it too: PICTURES there names the picture)

    overlap_fb.svg   the F&B step F4&B0 of rank 0 in DualPipe at pp 4 with 8 micro-batches, each
                     stage holding 2 MoE layers under expert parallelism (2 all-to-alls per layer
                     and action: dispatch and combine), F = B = 50 ms cut into equal chunks between
                     the all-to-alls, an all-to-all taking A = 25 ms: the compute lane, each
                     action's all-to-alls in flight, and the time blocked waiting for one; above,
                     the two actions interleaved as refimpl's Interleaver runs them
                     (refimpl/parallel/pipeline/overlap.py), below, F then B.

The lanes come from the schedule simulator's chunk model (simulate.run_step), exact fractions, so
the file is the same on every machine; benchmarks/bench_overlap.py draws the same step measured.
"""

from __future__ import annotations

import argparse
from fractions import Fraction
from pathlib import Path

from refimpl.parallel.pipeline import Overlapped, build
from refimpl.parallel.pipeline.simulate import Costs, run_step
from refimpl.tools.render import render_lanes_svg, step_lanes

ROOT = Path(__file__).resolve().parents[1]
PICTURES = ("overlap_fb",)
COSTS = Costs(F=Fraction(1, 20), B=Fraction(1, 20), I=Fraction(1, 40), W=Fraction(1, 40), A=Fraction(1, 40))
EXCHANGES_PER_STAGE = 4  # 2 MoE layers x (dispatch + combine)


def svg(name: str) -> str:
    """The SVG text of docs/images/NAME.svg."""
    if name not in PICTURES:
        raise ValueError(f"unknown picture {name!r}; choose one of {', '.join(PICTURES)}")
    schedule = build("dualpipe", 4, 8)
    step = next(s for s in schedule.ranks[0] if isinstance(s, Overlapped))
    exchanges = {s: EXCHANGES_PER_STAGE for s in range(schedule.num_stages)}
    groups = []
    for title, overlap in (("overlapped (Interleaver)", True), ("F then B (--no-overlap)", False)):
        run = run_step(step, COSTS, exchanges, overlap)
        groups.append((f"{title}: {float(run.duration) * 1e3:.0f} ms, blocked {float(run.exposed) * 1e3:.0f} ms",
                       step_lanes((g.lane, g.label, float(g.start), float(g.end)) for g in run.segments)))
    text = render_lanes_svg(f"DualPipe F&B step on rank 0: F = B = 50 ms in chunks, all-to-all A = 25 ms, "
                            f"{EXCHANGES_PER_STAGE} per action", groups)
    head, _, rest = text.partition("\n")
    return f"{head}\n<title>{name}: one DualPipe F&amp;B step, overlapped and not (simulated)</title>\n{rest}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "images"))
    args = parser.parse_args(argv)
    for name in PICTURES:
        (Path(args.out) / f"{name}.svg").write_text(svg(name))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
