"""The validator rejects every kind of broken schedule, with a message that says where."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refimpl.parallel.pipeline import Action, Overlapped, ScheduleError, build, validate
from refimpl.parallel.pipeline.actions import linear_placement, make_schedule, v_placement
from refimpl.parallel.pipeline.validate import completes, rendezvous_run


def one_f_one_b_by_hand():
    return [
        [Action("F", 0, 0), Action("F", 0, 1), Action("B", 0, 0), Action("B", 0, 1)],
        [Action("F", 1, 0), Action("B", 1, 0), Action("F", 1, 1), Action("B", 1, 1)],
    ]


def schedule_of(ranks, name="hand", pp=2, m=2, placement=None):
    return make_schedule(name, pp, m, placement or linear_placement(pp), ranks)


def test_a_hand_written_schedule_validates():
    report = validate(schedule_of(one_f_one_b_by_hand()))
    assert (report.actions, report.messages, report.rendezvous_lookahead) == (8, 4, 0)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda r: r[0].pop(1), "stage 0 micro-batch 1 has 0 forwards"),
        (lambda r: r[1].append(Action("F", 1, 0)), "stage 1 micro-batch 0 has 2 forwards"),
        (lambda r: r[1].remove(Action("B", 1, 1)), "stage 1 micro-batch 1 has B=0, I=0, W=0"),
        (lambda r: r[0].__setitem__(2, Action("I", 0, 0)), "stage 0 micro-batch 0 has B=0, I=1, W=0"),
        (lambda r: r[0].append(Action("W", 0, 0)), "has B=1, I=0, W=1"),
        (lambda r: r[0].__setitem__(0, Action("F", 1, 0)), "rank 0 step 0 (F0s1): stage 1 lives on rank 1"),
        (lambda r: r[1].append(Action("F", 2, 0)), "stage 2 is outside 0..1"),
        (lambda r: r[1].append(Action("F", 1, 5)), "micro-batch 5 is outside 0..1"),
        (lambda r: r[1].reverse(), "rank 1 step 0 (B1s1) runs before its own F"),
    ],
)
def test_broken_schedules_are_rejected(edit, message):
    ranks = one_f_one_b_by_hand()
    edit(ranks)
    with pytest.raises(ScheduleError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate(schedule_of(ranks))


def test_w_before_its_i_is_rejected():
    ranks = [
        [Action("F", 0, 0), Action("W", 0, 0), Action("I", 0, 0)],
    ]
    with pytest.raises(ScheduleError, match="runs before its own I"):
        validate(schedule_of(ranks, pp=1, m=1))


def test_a_dependency_cycle_is_a_rendezvous_deadlock():
    ranks = [
        [Action("F", 0, 0), Action("B", 0, 0), Action("F", 0, 1), Action("B", 0, 1)],
        [Action("F", 1, 1), Action("B", 1, 1), Action("F", 1, 0), Action("B", 1, 0)],
    ]
    with pytest.raises(ScheduleError, match=r"rendezvous deadlock \(lookahead 0\): rank 0 before B0s0"):
        validate(schedule_of(ranks))


def test_interleaved_needs_receives_one_step_ahead():
    """Megatron-LM's interleaved order exchanges messages one iteration before they are used:
    with receives posted just in time and rendezvous sends, two neighbours wait on each other."""
    schedule = build("interleaved", 2, 4, 2)
    with pytest.raises(ScheduleError, match="rendezvous deadlock"):
        rendezvous_run(schedule, lookahead=0)
    assert completes(schedule, lookahead=1)
    assert completes(schedule, per_channel=True)


def test_per_channel_posting_needs_fifo_channels():
    """Two micro-batches sent in one order and consumed in the other on the same channel: fine
    with receives posted just before use (messages are matched by identity), but an executor
    that keeps one receive per channel posted would wait for the wrong message."""
    ranks = [
        [Action("F", 0, 0), Action("F", 0, 1), Action("B", 0, 1), Action("B", 0, 0)],
        [Action("F", 1, 1), Action("F", 1, 0), Action("B", 1, 0), Action("B", 1, 1)],
    ]
    schedule = schedule_of(ranks)
    report = validate(schedule)
    assert not report.fifo_channels and not report.per_channel_ok
    assert report.rendezvous_lookahead == 1


def test_pairs_are_validated_part_by_part():
    pp = 1
    F, B = (lambda s, m: Action("F", s, m)), (lambda s, m: Action("B", s, m))
    good = [F(0, 0), F(1, 0), Overlapped(F(0, 1), B(1, 0)), F(1, 1), B(0, 0), B(1, 1), B(0, 1)]
    validate(make_schedule("pair", pp, 2, v_placement(1), [good]))
    # the pair's backward B1s1 has no forward yet
    bad = [F(0, 0), F(1, 0), Overlapped(F(0, 1), B(1, 1)), F(1, 1), B(1, 0), B(0, 0), B(0, 1)]
    with pytest.raises(ScheduleError, match=r"step 2 \(F1s0&B1s1\) runs before its own F"):
        validate(make_schedule("pair", pp, 2, v_placement(1), [bad]))


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(["1f1b", "zb1p", "zbv", "dualpipe", "dualpipev", "interleaved"]), st.data())
def test_dropping_or_duplicating_any_action_is_caught(name, data):
    pp = 4 if name == "dualpipe" else 2
    schedule = build(name, pp, 2 * pp)
    ranks = [list(steps) for steps in schedule.ranks]
    rank = data.draw(st.integers(0, pp - 1))
    index = data.draw(st.integers(0, len(ranks[rank]) - 1))
    if data.draw(st.booleans()):
        del ranks[rank][index]
    else:
        ranks[rank].insert(index, ranks[rank][index])
    broken = make_schedule(name, pp, schedule.micro_batches, schedule.placement, ranks, schedule.chunks)
    with pytest.raises(ScheduleError):
        validate(broken)
