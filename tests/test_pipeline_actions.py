"""Actions as plain data: the text form, placements, and the messages an action implies."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refimpl.parallel.pipeline import (
    Action,
    Message,
    Overlapped,
    build,
    format_action,
    format_rank,
    messages_of,
    parse_action,
    parse_rank,
)
from refimpl.parallel.pipeline.actions import dual_placement, linear_placement, looped_placement, v_placement

actions = st.builds(
    Action,
    kind=st.sampled_from("FBIW"),
    stage=st.integers(0, 40),
    mb=st.integers(0, 200),
    direction=st.sampled_from([None, 0, 1]),
)


@settings(max_examples=200, deadline=None)
@given(actions)
def test_text_form_round_trips(action):
    assert parse_action(format_action(action)) == action
    assert parse_action(format_action(action, short=True), stage=action.stage, direction=action.direction) == action


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 9), st.integers(0, 9), st.integers(0, 30), st.integers(0, 30), st.sampled_from([None, 0, 1]))
def test_pair_text_form_round_trips(s1, s2, m1, m2, d):
    pair = Overlapped(Action("F", s1, m1, d), Action("B", s2, m2, d))
    assert parse_action(format_action(pair)) == pair
    assert pair.kind == "F&B" and pair.parts == (pair.f, pair.b)


def test_examples_from_the_issue():
    assert format_action(Action("F", 2, 3), short=True) == "F3"
    assert format_action(Action("F", 2, 3)) == "F3s2"
    assert format_action(Action("B", 5, 0, 1)) == "B0s5d1"
    pair = Overlapped(Action("F", 1, 5), Action("B", 6, 1))
    assert format_action(pair, short=True) == "F5&B1"
    assert format_action(pair) == "F5s1&B1s6"
    assert parse_action("I2", stage=4) == Action("I", 4, 2)
    assert parse_action("W2s3") == Action("W", 3, 2)


def test_rank_text_round_trips_for_every_schedule():
    sizes = {"1f1b": (3, 5), "interleaved": (2, 4), "zbv": (3, 6), "dualpipe": (4, 8), "dualpipev": (2, 4)}
    for name, (pp, m) in sizes.items():
        schedule = build(name, pp, m)
        for steps in schedule.ranks:
            assert parse_rank(format_rank(steps)) == list(steps)


@pytest.mark.parametrize("text", ["X3", "F", "F3s", "F-1", "F3&B1&W2", "F3s2d2", "3F"])
def test_bad_text_is_rejected(text):
    with pytest.raises(ValueError):
        parse_action(text)


def test_short_form_needs_a_stage():
    with pytest.raises(ValueError, match="names no stage"):
        parse_action("F3")


def test_invalid_actions_are_rejected():
    with pytest.raises(ValueError):
        Action("Q", 0, 0)
    with pytest.raises(ValueError):
        Action("F", -1, 0)
    with pytest.raises(ValueError):
        Overlapped(Action("B", 0, 0), Action("F", 1, 1))
    with pytest.raises(ValueError):
        Overlapped(Action("F", 0, 0), Action("I", 1, 1))


def test_placements():
    line = linear_placement(4)
    assert [line.rank_of(s) for s in range(4)] == [0, 1, 2, 3]
    assert line.neighbours(0) == (None, 1) and line.neighbours(3) == (2, None)

    looped = looped_placement(3, 2)  # 6 stages, stage s on rank s mod 3
    assert looped.num_stages == 6 and looped.stages_of(1) == (1, 4)
    assert looped.neighbours(2) == (1, 0)  # stage 3 lives on rank 0

    v = v_placement(3)  # 6 stages in a V
    assert [v.rank_of(s) for s in range(6)] == [0, 1, 2, 2, 1, 0]
    assert v.stages_of(0) == (0, 5) and v.stages_of(2) == (2, 3)

    dual = dual_placement(4)
    assert dual.num_directions == 2 and dual.num_stages == 4
    assert [dual.rank_of(s, 0) for s in range(4)] == [0, 1, 2, 3]
    assert [dual.rank_of(s, 1) for s in range(4)] == [3, 2, 1, 0]
    assert dual.ranks_of(1) == (1, 2) and dual.stages_of(0) == (0, 3)
    assert dual.neighbours(1, 1) == (3, 1)


def test_messages_of_a_forward_and_a_backward():
    line = linear_placement(3)
    recvs, sends = messages_of(line, Action("F", 1, 7))
    assert recvs == [Message("act", 0, 1, 0, 1, 7)] and sends == [Message("act", 1, 2, 1, 2, 7)]
    recvs, sends = messages_of(line, Action("I", 1, 7))
    assert recvs == [Message("grad", 2, 1, 2, 1, 7)] and sends == [Message("grad", 1, 0, 1, 0, 7)]
    assert messages_of(line, Action("W", 1, 7)) == ([], [])
    # the first stage receives no activation, the last no gradient
    assert messages_of(line, Action("F", 0, 0))[0] == [] and messages_of(line, Action("B", 2, 0))[0] == []


def test_the_turn_of_a_v_is_local():
    v = v_placement(2)  # stages 0,1,2,3 on ranks 0,1,1,0
    recvs, sends = messages_of(v, Action("F", 1, 0))
    assert recvs == [Message("act", 0, 1, 0, 1, 0)] and sends == []  # stage 2 is on rank 1 too
    recvs, sends = messages_of(v, Action("F", 2, 0))
    assert recvs == [] and sends == [Message("act", 1, 0, 2, 3, 0)]


def test_dualpipe_direction_one_flows_from_the_last_rank():
    dual = dual_placement(4)
    recvs, sends = messages_of(dual, Action("F", 1, 5, 1))  # direction 1: stage 1 on rank 2
    assert recvs == [Message("act", 3, 2, 0, 1, 5, 1)] and sends == [Message("act", 2, 1, 1, 2, 5, 1)]
    recvs, sends = messages_of(dual, Action("B", 1, 5, 1))
    assert recvs == [Message("grad", 1, 2, 2, 1, 5, 1)] and sends == [Message("grad", 2, 3, 1, 0, 5, 1)]


def test_parameter_share():
    assert build("1f1b", 4, 4).parameter_share(0) == 1.0
    assert build("interleaved", 4, 4, 2).parameter_share(3) == 1.0
    assert build("zbv", 4, 8).parameter_share(0) == 1.0
    assert build("dualpipev", 4, 8).parameter_share(2) == 1.0
    assert build("dualpipe", 4, 8).parameter_share(1) == 2.0
