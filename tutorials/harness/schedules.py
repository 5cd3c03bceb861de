"""Checks for tutorials 07 (pipeline schedules and their bubbles) and 08 (zero bubble, DualPipe).

A student writes a schedule as one list of actions per rank, in the short text form of
refimpl/parallel/pipeline/actions.py: "F3" is the forward of micro-batch 3 at the rank's own stage
(stage = rank for GPipe, 1F1B and ZB-H1), "B3" its full backward, "I3" and "W3" the two halves of
a split backward. The checks turn the lists into a `Schedule`, run refimpl's validator (every
action exactly once, in an order whose messages can all be matched without deadlock) and the
timing simulator, and compare idle time and activation memory with refimpl's own generators.
"""

from __future__ import annotations

from fractions import Fraction

from refimpl.parallel.pipeline import Costs, ScheduleError, build, parse_action, simulate, validate
from refimpl.parallel.pipeline.actions import Action, Schedule, linear_placement, make_schedule
from refimpl.parallel.pipeline.simulate import Deadlock, peak_in_flight

from . import Wrong, plain


def to_schedule(name: str, pp: int, m: int, programs) -> Schedule:
    """Per-rank lists of "F3"-style strings (or Actions) -> a validated Schedule on ranks 0..pp-1."""
    if not isinstance(programs, (list, tuple)) or len(programs) != pp:
        raise Wrong(f"return one list of actions per rank: {pp} lists for pp={pp}; got "
                    f"{len(programs) if isinstance(programs, (list, tuple)) else type(programs).__name__}")
    ranks = []
    for r, program in enumerate(programs):
        steps = []
        for item in program:
            try:
                steps.append(item if isinstance(item, Action) else parse_action(str(item), stage=r))
            except ValueError as exc:
                raise Wrong(f"rank {r}: {exc}") from None
        ranks.append(steps)
    schedule = make_schedule(name, pp, m, linear_placement(pp), ranks)
    try:
        validate(schedule)
    except ScheduleError as exc:
        raise Wrong(f"pp={pp}, m={m}: not a valid schedule: {exc}") from None
    return schedule


def _timeline(schedule, costs):
    try:
        return simulate(schedule, costs, steady_state=False)
    except Deadlock as exc:
        raise Wrong(str(exc)) from None


def _compare(name, programs_of, reference: str, sizes, costs_list, peak_rule=None) -> None:
    for pp, m in sizes:
        ours = to_schedule(name, pp, m, programs_of(pp, m))
        ref = build(reference, pp, m)
        for costs in costs_list:
            got, expected = _timeline(ours, costs), _timeline(ref, costs)
            if got.idle != expected.idle:
                raise Wrong(f"pp={pp}, m={m}, costs F={costs.F}, B={costs.B}, I={costs.I}, W={costs.W}: idle time per "
                            f"rank is {[str(x) for x in got.idle]}, refimpl's {reference} has "
                            f"{[str(x) for x in expected.idle]}")
        peaks = [peak_in_flight(ours, r) for r in range(pp)]
        expected_peaks = [peak_in_flight(ref, r) for r in range(pp)] if peak_rule is None else peak_rule(pp, m)
        if peaks != expected_peaks:
            raise Wrong(f"pp={pp}, m={m}: peak activations per rank are {peaks}; {reference} holds {expected_peaks}")


SIZES = [(1, 1), (2, 2), (3, 5), (4, 8), (4, 3)]


def check_gpipe(gpipe) -> None:
    """Check: GPipe."""
    _compare("gpipe", gpipe, "gpipe", SIZES, [Costs(F=1, B=2), Costs(F=1, B=3)], lambda pp, m: [m] * pp)


def check_one_f_one_b(one_f_one_b) -> None:
    """Check: 1F1B."""
    _compare("1f1b", one_f_one_b, "1f1b", SIZES, [Costs(F=1, B=2), Costs(F=2, B=3)],
             lambda pp, m: [min(pp - r, m) for r in range(pp)])


def check_bubble_fraction(bubble_fraction) -> None:
    """Check: the bubble fraction of 1F1B."""
    for pp in range(1, 7):
        for m in (1, 2, 3, 4, 8, 12):
            expected = simulate(build("1f1b", pp, m), Costs(F=1, B=2), steady_state=False).bubble_fraction
            got = bubble_fraction(pp, m)
            if got is None or abs(float(got) - float(expected)) > 1e-12:
                raise Wrong(f"pp={pp}, m={m}: the simulator measures a bubble fraction of {expected} "
                            f"= {float(expected):.4f}; you said {plain(got)}")


def check_zb1p_idle(zb1p_idle) -> None:
    """Check: ZB-H1's idle time per rank."""
    for pp in (2, 3, 4, 6):
        for F_, I_, W_ in [(1, 1, 1), (2, 1, 1), (2, 2, 1), (3, 2, 1), (1, 1, Fraction(1, 2))]:
            costs = Costs(F=F_, I=I_, W=W_)
            idle = simulate(build("zb1p", pp, 2 * pp), costs, steady_state=False).idle
            got = zb1p_idle(pp, F_, I_, W_)
            if got is None or abs(float(got) - float(idle[0])) > 1e-12:
                raise Wrong(f"pp={pp}, F={F_}, I={I_}, W={W_} (m={2 * pp}): every rank idles {idle[0]} in the "
                            f"simulator; you said {plain(got)}")


def check_peak_activations(peak_activations) -> None:
    """Check: peak activations of a rank's program."""
    cases = [("gpipe", 4, 6), ("1f1b", 4, 8), ("zb1p", 4, 8), ("zbh2", 4, 8), ("zbv", 4, 8), ("dualpipev", 4, 8)]
    for name, pp, m in cases:
        schedule = build(name, pp, m)
        for rank in range(pp):
            program = [str(a) for a in schedule.actions(rank)]  # e.g. "F3s2", "I0s5"
            for free_at in ("I", "W"):
                expected = peak_in_flight(schedule, rank, free_at)
                got = peak_activations(program, free_at)
                if got != expected:
                    raise Wrong(f"{name} pp={pp} m={m}, rank {rank}, activations freed at {free_at}: the peak is "
                                f"{expected}, you said {plain(got)} (program: {' '.join(program[:12])} ...)")


def check_zb_h1(zb_h1) -> None:
    """Check: a ZB-H1 program."""
    costs = [Costs(F=1, I=1, W=1), Costs(F=2, I=1, W=1), Costs(F=2, I=2, W=1)]
    _compare("zb1p", zb_h1, "zb1p", [(2, 2), (3, 5), (4, 4), (4, 8)], costs, lambda pp, m: [pp] * pp)


def check_interleaved_bubble(interleaved_bubble) -> None:
    """Check: the bubble fraction of interleaved 1F1B."""
    for pp in (2, 3, 4, 5):
        for m in (pp, 2 * pp, 3 * pp):
            for v in (2, 3, 4):
                schedule = build("interleaved", pp, m, chunks=v)
                for f, b in [(1, 2), (1, 3)]:  # each chunk's action costs 1/v of a whole rank's share
                    expected = simulate(schedule, Costs(F=Fraction(f, v), B=Fraction(b, v)),
                                        steady_state=False).bubble_fraction
                    got = interleaved_bubble(pp, m, v)
                    try:
                        if abs(float(got) - float(expected)) <= 1e-12:
                            continue
                    except (TypeError, ValueError):
                        pass
                    head = (f"pp={pp}, m={m}, v={v} chunks, costs F={f}, B={b} per rank's share: "
                            f"the simulator measures a bubble fraction of {expected} = {float(expected):.4f}; "
                            f"you said {plain(got)}")
                    for wrong, why in [(Fraction(pp - 1, m + pp - 1), "that is 1F1B's, as if the chunks changed "
                                        "nothing"),
                                       (Fraction(pp - 1, v * (m + pp - 1)), "dividing 1F1B's fraction by v divides "
                                        "the idle time, but the makespan it is a fraction of shrinks too"),
                                       (Fraction(pp - 1, v * m), "that is idle time ÷ work; the bubble fraction is "
                                        "idle ÷ (work + idle)")]:
                        if got is not None and not isinstance(got, (str, list, tuple)) and \
                                abs(float(got) - float(wrong)) <= 1e-12:
                            raise Wrong(f"{head}: {why}")
                    raise Wrong(head)


def check_zb1p_idle_any(zb1p_idle_any) -> None:
    """Check: ZB-H1's idle time for any costs, W > F or W > I included."""
    costs = [(1, 1, 1), (2, 1, 1), (1, 1, 2), (1, 2, 2), (2, 1, 2), (1, 3, 2), (3, 1, 2), (2, 1, 3), (1, 2, 3),
             (1, 1, 3), (2, 3, 4), (1, 1, Fraction(3, 2)), (Fraction(1, 2), 2, 1), (3, 5, Fraction(7, 2))]
    for pp in (2, 3, 4, 6):
        for F_, I_, W_ in costs:
            idle = simulate(build("zb1p", pp, 2 * pp), Costs(F=F_, I=I_, W=W_), steady_state=False).idle
            got = zb1p_idle_any(pp, F_, I_, W_)
            try:
                if abs(float(got) - float(idle[0])) <= 1e-12:
                    continue
            except (TypeError, ValueError):
                pass
            head = (f"pp={pp}, F={F_}, I={I_}, W={W_} (m={2 * pp}): every rank idles {idle[0]} in the simulator; "
                    f"you said {plain(got)}")
            numeric = got is not None and not isinstance(got, (str, list, tuple))
            reasons = []
            if numeric and W_ > min(F_, I_) and float(got) in (float((pp - 1) * (F_ + I_ - W_)),
                                                                float((pp - 1) * max(F_ + I_ - W_, 0))):
                reasons.append(f"That is exercise 1's (p − 1)(F + I − W), which holds only while W ≤ F and W ≤ I: "
                               f"here W is longer than {'F' if W_ > F_ else 'I'}, and a W cannot fill more of a gap "
                               "than the gap is long")
            if numeric and W_ > F_ and float(got) == float((pp - 1) * (F_ + I_ - min(I_, W_))):
                reasons.append("Here W > F: the gap a deferred W fills is bounded by F as well as by I")
            raise Wrong(". ".join([head] + reasons))
