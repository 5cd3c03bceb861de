"""Exposed communication: the simulator's chunk model against hand-derived numbers,
the executor's observer Pacing (chunk pacing, delayed all-to-alls and messages), the lanes picture, and in
sleep-cost + link-delay mode over MPI: the fields are reported, the delays change no number and
the all-to-alls counted are the simulator's.

No test here depends on speed: on the real clock they assert only what holds
under any delay (orders, counts, lower bounds -- a sleep or a delay only overshoots -- and the
simulator's exact figures); Pacing's exact figures are checked on a virtual clock. Measured against
simulated within 10 % is benchmarks/bench_overlap.py's job, and benchmarks/suite_under_load.sh runs
the suite beside CPU-bound processes."""

import json
import math
import time
from fractions import Fraction
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mpi_util import PROGRAMS, last_json, run_mpi

from refimpl.parallel.pipeline import Costs, build, simulate
from refimpl.parallel.pipeline.actions import Action, Message, Overlapped
from refimpl.parallel.pipeline.overlap import Interleaver
from refimpl.parallel.pipeline.simulate import run_step
from refimpl.tools import timeline as tl
from refimpl.tools.pacing import Pacing
from refimpl.tools.render import render_lanes_svg, step_lanes
from refimpl.tools.sweep import SMALL

FB = Overlapped(Action("F", 0, 3, 0), Action("B", 3, 1, 1))  # a DualPipe F&B: stage 0 forward, stage 3 backward
TWO = {0: 2, 3: 2}  # one MoE layer per stage: dispatch and combine


# --- the simulator's chunk model ------------------------------------------------------------------


def test_an_overlapped_f_and_b_hides_each_all_to_all_behind_the_other_tasks_chunk():
    # F = 30 in chunks of 10, B = 60 in chunks of 20, A = 15:
    #   F 0-10 | B 10-30 (F's a2a 10-25 hidden) | F 30-40, B's a2a 30-45 | wait 40-45 | B 45-65 |
    #   F 65-75 (F's a2a 40-55 hidden) | wait for B's a2a 65-80: 75-80 | B 80-100
    run = run_step(FB, Costs(F=30, I=30, W=30, A=15), TWO, overlap=True)
    assert (run.duration, run.exposed, run.exchanges) == (100, 10, 4)
    compute = [(s.label, s.start, s.end) for s in run.segments if s.lane == "compute"]
    assert compute == [("F3 1/3", 0, 10), ("B1 1/3", 10, 30), ("F3 2/3", 30, 40), ("B1 2/3", 45, 65),
                       ("F3 3/3", 65, 75), ("B1 3/3", 80, 100)]
    assert [(s.start, s.end) for s in run.segments if s.lane == "wait"] == [(40, 45), (75, 80)]
    # F then B: every all-to-all waited for in full
    run = run_step(FB, Costs(F=30, I=30, W=30, A=15), TWO, overlap=False)
    assert (run.duration, run.exposed) == (150, 60)


def test_a_slow_all_to_all_is_only_partly_hidden():
    # A = 100: F waits 30-110, B 130 (from 150-... ): F 0-10, B 10-30, F waits to 110, 110-120, B waits
    # to 130, 130-150, F waits to 220, 220-230 (done), B waits to 250, 250-270.
    run = run_step(FB, Costs(F=30, I=30, W=30, A=100), TWO, overlap=True)
    assert (run.duration, run.exposed) == (270, 80 + 10 + 70 + 20)
    assert run_step(FB, Costs(F=30, I=30, W=30, A=100), TWO, overlap=False).duration == 90 + 4 * 100


def test_steps_without_all_to_alls_keep_their_costs_and_w_has_none():
    costs = Costs(F=1, I=2, W=3, FB=5, A=7)
    assert run_step(FB, costs).duration == 5  # no experts: FB
    assert run_step(Action("W", 0, 0), costs, {0: 2}).duration == 3
    assert run_step(Action("I", 0, 0), costs, {0: 2}).duration == 2 + 2 * 7


def test_1f1b_at_two_ranks_hand_derived_exposed_communication():
    # F = 1, B = 2, P = 1/2, no experts. rank 0: F0 [0,1] F1 [1,2] B0 [5,7] B1 [8,10];
    # rank 1: F0 [1.5,2.5] B0 [2.5,4.5] F1 [4.5,5.5] B1 [5.5,7.5]
    schedule = build("1f1b", 2, 2)
    t = simulate(schedule, Costs(F=1, I=1, W=1, P=Fraction(1, 2)), steady_state=False)
    assert t.makespan == 10 and t.exposed_pipeline == [4, Fraction(3, 2)] and t.exposed_all_to_all == [0, 0]
    # with one MoE layer per stage and A = 1/2: F lasts 2, B 3; rank 0: F0 [0,2] F1 [2,4] B0 [8,11] B1 [13,16];
    # rank 1: F0 [2.5,4.5] B0 [4.5,7.5] F1 [7.5,9.5] B1 [9.5,12.5]
    t = simulate(schedule, Costs(F=1, I=1, W=1, P=Fraction(1, 2), A=Fraction(1, 2)), steady_state=False,
                 exchanges={0: 2, 1: 2})
    assert t.makespan == 16 and t.exposed_pipeline == [6, Fraction(5, 2)]
    assert t.exposed_all_to_all == [4, 4] and t.all_to_all == [8, 8] and t.hidden_fraction() == 0
    assert t.busy == [sum(end - start for start, end, _ in iv) for iv in t.intervals]


@settings(max_examples=30, deadline=None)
@given(st.sampled_from([("1f1b", 4, 8), ("zb1p", 4, 8), ("dualpipe", 4, 8), ("dualpipev", 2, 4), ("zbv", 2, 4)]),
       st.sampled_from([Fraction(1, 2), Fraction(1), Fraction(3)]), st.integers(1, 3))
def test_chunk_model_bounds(case, A, layers):
    """Without overlap every all-to-all is exposed in full; with it never more; with A = 0 the
    timeline is the plain one (F&B = F + B)."""
    name, pp, m = case
    schedule = build(name, pp, m)
    exchanges = {s: 2 * layers for s in range(schedule.num_stages)}
    costs = Costs(F=1, I=1, W=1, A=A)
    sequential = simulate(schedule, costs, steady_state=False, exchanges=exchanges, overlap=False)
    overlapped = simulate(schedule, costs, steady_state=False, exchanges=exchanges, overlap=True)
    assert sequential.exposed_all_to_all == [n * A for n in sequential.all_to_all]
    assert sequential.all_to_all == overlapped.all_to_all
    assert all(o <= s for o, s in zip(overlapped.exposed_all_to_all, sequential.exposed_all_to_all))
    assert overlapped.makespan <= sequential.makespan
    if not any(isinstance(step, Overlapped) for steps in schedule.ranks for step in steps):
        assert overlapped.intervals == sequential.intervals
    plain = simulate(schedule, Costs(F=1, I=1, W=1), steady_state=False)
    with_experts = simulate(schedule, Costs(F=1, I=1, W=1), steady_state=False, exchanges=exchanges)
    assert with_experts.intervals == plain.intervals


def test_costs_carry_the_link_delays():
    costs = Costs.parse("F=0.02,I=0.02,W=0.02,P=0.005,A=0.01")
    assert (costs.P, costs.A) == (Fraction(1, 200), Fraction(1, 100))
    assert costs.scaled(Fraction(1, 2)).P == costs.P and costs.scaled(2).A == costs.A  # per message: not scaled
    assert Costs().as_dict() == {"F": 1, "B": 2, "I": 1, "W": 1, "FB": 3}  # P, A only when set
    assert tl.describe_costs(costs).endswith("P=0.005,A=0.01 s)")
    for bad in ("F=1,P=-1", "F=1,A=61"):
        with pytest.raises(ValueError):
            tl.parse_costs(bad)


# --- the executor's observer Pacing, without MPI ---------------------------------------------------


class Done:
    """A request that is already complete (as on one node: shared memory)."""

    def __init__(self, buf="rows"):
        self.buf = buf

    def wait(self):
        return self.buf

    def test(self):
        return True


class Executor:
    """What Pacing reads of the executor whose runs it watches."""

    schedule = build("dualpipe", 4, 8)
    stages = {0: None, 3: None}


class VirtualClock:
    """Pacing's clock with time.sleep advancing it: no real time passes, so a paced run lasts exactly
    its costs and delays (computation takes no time here), as in the simulator."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        assert seconds > 0
        self.now += seconds


@pytest.fixture
def virtual_clock(monkeypatch):
    clock = VirtualClock()
    monkeypatch.setattr("refimpl.tools.pacing.time", SimpleNamespace(sleep=clock.sleep, perf_counter=clock))
    return clock


ROUNDING = 1e-9  # seconds: float rounding of times taken as differences from t0, not a tolerance for speed


def run_paced_fb(clock=time.perf_counter):
    """The simulator's FB example in milliseconds (F = 30 ms, B = 60 ms, A = 15 ms), run by two tasks
    as the executor runs an overlapped F&B step: each action's all-to-alls through its all_to_all."""
    costs = Costs(F=Fraction(3, 100), I=Fraction(3, 100), W=Fraction(3, 100), A=Fraction(15, 1000))
    pacing = Pacing(costs, TWO, clock=clock)
    pacing.run_started(Executor())
    interleaver = Interleaver()

    def task(action):
        with pacing.action(action):
            for _ in range(2):
                pacing.all_to_all_starts()
                interleaver.pause(Done())
                pacing.all_to_all_wait(Done())

    with pacing.step(FB):
        interleaver.run(lambda: task(FB.f), lambda: task(FB.b))
    return pacing


def test_pacing_follows_the_simulators_chunk_model_exactly_on_a_virtual_clock(virtual_clock):
    """With a clock that only sleeps advance, Pacing's step, chunks and waits are the simulator's
    run_step figures to the last bit of float rounding: 100 ms, 10 ms exposed, the same segments.
    No wall clock is read, so this holds under any load."""
    pacing = run_paced_fb(virtual_clock)
    run = run_step(FB, Costs(F=Fraction(3, 100), I=Fraction(3, 100), W=Fraction(3, 100), A=Fraction(15, 1000)),
                   TWO, overlap=True)
    (step,) = pacing.steps
    assert pacing.exchanges == run.exchanges == 4 and step.kind == "F&B" and len(step.parts) == 2
    assert step.end - step.start == pytest.approx(float(run.duration), abs=1e-12)  # 0.100
    assert pacing.exposed["all_to_all"] == pytest.approx(float(run.exposed), abs=1e-12)  # 0.010
    assert pacing.overruns == 0
    for lane in ("compute", "wait"):  # Pacing also records the waits that found the all-to-all complete (empty)
        measured = [t for name, _, start, end in pacing.events if name == lane and end > start for t in (start, end)]
        simulated = [float(t) for s in run.segments if s.lane == lane for t in (s.start, s.end)]
        assert measured == pytest.approx(simulated, abs=1e-12), lane
    assert [label for lane, label, *_ in pacing.events if lane == "compute"] == [
        s.label for s in run.segments if s.lane == "compute"]


def test_pacing_pads_chunks_and_delays_all_to_alls_in_an_interleaved_step():
    """The same step on the real clock: what holds under any delay. Sleeps only overshoot and an
    all-to-all never completes before A after its start, so the step lasts at least the simulated
    100 ms; the counts and the order of the chunks are those of the chunk model; every wait is
    non-negative. (How close measured comes to simulated is benchmarks/bench_overlap.py's figure.)"""
    pacing = run_paced_fb()
    (step,) = pacing.steps
    assert pacing.exchanges == 4 and step.kind == "F&B" and len(step.parts) == 2
    assert step.end - step.start >= 0.100 - ROUNDING  # 100 ms simulated; sleeps only overshoot
    assert pacing.exposed["all_to_all"] >= 0 and pacing.exposed["pipeline"] == 0
    assert {lane for lane, *_ in pacing.events} == {"compute", "all_to_all", "wait"}
    compute = [(label, start, end) for lane, label, start, end in pacing.events if lane == "compute"]
    assert [label for label, *_ in compute] == ["F3 1/3", "B1 1/3", "F3 2/3", "B1 2/3", "F3 3/3", "B1 3/3"]
    assert all(start <= end <= later for (_, start, end), (_, later, _) in zip(compute, compute[1:]))  # one at a time
    for lane, _, start, end in pacing.events:
        if lane == "all_to_all":
            assert end - start >= 0.015 - ROUNDING  # completes no earlier than A after its start
        assert 0 <= start <= end


def test_pacing_delivers_a_message_its_delay_after_the_send_time_it_carries(virtual_clock):
    """A message sent at t0 with P = 20 ms, on a virtual clock: the receiver's wait is exactly 20 ms,
    and the message lane shows it in flight from its send time to its delivery."""
    pacing = Pacing(Costs(F=1, I=1, W=1, P=Fraction(2, 100)), clock=virtual_clock)
    pacing.run_started(Executor())
    assert pacing.trailer == 1 and pacing.stamp(None) == [0.0]  # the send time, since t0
    buf = pacing.receive_wait(Done([1.0, 0.0]), Message("act", 0, 1, 0, 1, 0))  # sent at t0, P = 20 ms
    assert buf == [1.0, 0.0] and virtual_clock.now == pytest.approx(0.02) and pacing.exposed["pipeline"] == 0.02
    assert [e[0] for e in pacing.events] == ["message", "pipeline"]
    assert [t for e in pacing.events for t in e[2:]] == pytest.approx([0, 0.02, 0, 0.02])


def test_on_the_real_clock_a_message_is_never_delivered_before_its_delay():
    """The same message on the real clock: the receiver's wait ends no earlier than t0 + P, however
    late the receive is called or the sleep wakes (delays only overshoot)."""
    pacing = Pacing(Costs(F=1, I=1, W=1, P=Fraction(2, 100)))
    pacing.run_started(Executor())
    sent = pacing.stamp(None)[0]
    assert 0 <= sent <= time.perf_counter() - pacing.t0
    buf = pacing.receive_wait(Done([1.0, 0.0]), Message("act", 0, 1, 0, 1, 0))  # sent at t0
    assert buf == [1.0, 0.0] and time.perf_counter() - pacing.t0 >= 0.02 - ROUNDING and pacing.exposed["pipeline"] >= 0
    (message, blocked) = pacing.events
    assert message[0] == "message" and blocked[0] == "pipeline" and blocked[3] >= 0.02 - ROUNDING


def test_lanes_picture():
    run = run_step(FB, Costs(F=30, I=30, W=30, A=15), TWO)
    lanes = step_lanes((s.lane, s.label, float(s.start), float(s.end)) for s in run.segments)
    assert [title for title, _ in lanes] == ["compute", "F3 all-to-all", "B1 all-to-all", "blocked (exposed)"]
    assert [len(boxes) for _, boxes in lanes] == [6, 2, 2, 2]
    svg = render_lanes_svg("F&B", [("simulated", lanes)], unit="units", per_unit=1)
    assert svg.startswith("<svg") and svg.count("<rect") == 12 and "F&amp;B" in svg


# --- over MPI ---------------------------------------------------------------------------------------

COSTS = "F=0.01,I=0.01,W=0.01,P=0.002,A=0.004"
TIMED = [SMALL[:-2] + f.split() for f in (
    f"--dtype float32 --model gpt --experts 4 --ep 2 --pp 2 --schedule zb1p --micro-batches 4 --batch-size 16 "
    f"--n-layer 2 --action-costs {COSTS}",
    f"--dtype float64 --model gpt --experts 4 --ep 2 --pp 2 --schedule dualpipe --micro-batches 4 --batch-size 16 "
    f"--n-layer 2 --action-costs {COSTS}",
    f"--dtype float64 --model gpt --experts 4 --ep 2 --pp 2 --schedule dualpipe --micro-batches 4 --batch-size 16 "
    f"--n-layer 2 --action-costs {COSTS} --no-overlap",
)]


@pytest.mark.mpi
def test_sleep_cost_and_link_delay_mode_reports_exposed_communication(tmp_path):
    """What holds under any delay: the delays change no number; the reported fields are present, per
    rank, finite and non-negative; the all-to-alls counted are the simulator's; the simulator's own
    figures are exact (F then B: every all-to-all exposed in full, n * A; the overlap: some hidden);
    the trace has every lane. Not asserted: how much of the communication was hidden on the wall
    clock -- a busy machine wakes sleepers late and moves that figure either way (measured within
    10 % of simulated is benchmarks/bench_overlap.py's table, its ratio columns)."""
    path = tmp_path / "configs.json"
    path.write_text(json.dumps(TIMED))
    results = last_json(run_mpi(4, [PROGRAMS / "overlap_timing.py", path, tmp_path], timeout=300))
    assert len(results) == len(TIMED)
    A = 0.004
    for r in results:
        timing, flags = r["timing"], r["flags"]
        assert r["identical"], flags  # send times on the wire, sleeps and delays change no number
        assert timing["link_delay_s"] == 0.002 and timing["all_to_all_delay_s"] == A
        assert timing["all_to_all_exchanges"] == r["simulated_exchanges"]  # 2 per MoE layer in F, B, I; none in W
        for what in ("pipeline", "all_to_all"):
            measured = timing[f"measured_exposed_{what}_s"]
            assert len(measured) == len(timing[f"simulated_exposed_{what}_s"]) == 2
            assert all(math.isfinite(e) and e >= 0 for e in measured), (what, measured)
        simulated_a2a = timing["simulated_exposed_all_to_all_s"]
        hidden, simulated = timing["measured_hidden_fraction"], timing["simulated_hidden_fraction"]
        assert math.isfinite(hidden) and hidden <= 1  # 1 - exposed / (n * A), exposed >= 0; < 0 when woken late
        if "--no-overlap" in flags or "zb1p" in flags:  # every all-to-all waited for in full
            assert simulated == 0
            assert simulated_a2a == pytest.approx([n * A for n in timing["all_to_all_exchanges"]])
        else:  # the other task's chunk hides part of each all-to-all
            assert 0 < simulated < 1
            assert all(0 <= e < n * A for e, n in zip(simulated_a2a, timing["all_to_all_exchanges"]))
        kinds = {tuple(k) for k in r["trace"]}
        assert {(0, "chunk"), (0, "all_to_all"), (0, "wait"), (0, "pipeline"), (0, "message"),
                (2, "all_to_all"), (2, "wait"), (2, "pipeline")} <= kinds
