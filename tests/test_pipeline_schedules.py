"""Schedule generators: every schedule validates, its structure matches the papers, and every
constraint violation raises its documented error."""

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refimpl.parallel.pipeline import SCHEDULES, Action, Overlapped, build, simulate, validate
from refimpl.parallel.pipeline.schedules.dualpipe import dualpipe


@st.composite
def configs(draw):
    """(name, pp, micro_batches, chunks) satisfying the schedule's constraints."""
    name = draw(st.sampled_from(sorted(SCHEDULES)))
    if name == "dualpipe":
        pp = 2 * draw(st.integers(1, 4))
        return name, pp, 2 * pp + 2 * draw(st.integers(0, 4)), None
    pp = draw(st.integers(1, 6))
    if name == "interleaved":
        return name, pp, pp * draw(st.integers(1, 3)), draw(st.integers(2, 3))
    if name == "dualpipev":
        return name, pp, 2 * pp + draw(st.integers(0, 6)), None
    return name, pp, draw(st.integers(1, 14)), None


@settings(max_examples=150, deadline=None)
@given(configs())
def test_every_generated_schedule_validates_and_simulates(config):
    name, pp, m, chunks = config
    schedule = build(name, pp, m, chunks)
    report = validate(schedule)  # raises on any defect, including a rendezvous deadlock
    assert report.per_channel_ok and report.fifo_channels
    timeline = simulate(schedule, steady_state=False)  # raises Deadlock if stuck
    assert timeline.makespan > 0
    assert all(idle >= 0 for idle in timeline.idle)
    kinds = [a.kind for r in range(pp) for a in schedule.actions(r)]
    units = schedule.num_stages * m  # every (stage, micro-batch) once, DualPipe's copies included
    assert kinds.count("F") == units and kinds.count("B") + kinds.count("I") == units
    assert kinds.count("W") == kinds.count("I") and report.actions == len(kinds)
    if name in ("zb1p", "zbh2", "zbv"):
        assert kinds.count("B") == 0


@pytest.mark.parametrize(
    "name, pp, m, chunks, lookahead",
    [
        ("gpipe", 4, 8, None, 0),
        ("1f1b", 4, 8, None, 0),
        ("zb1p", 4, 8, None, 0),
        ("zbh2", 4, 8, None, 1),
        ("interleaved", 4, 8, 2, 1),
        ("zbv", 4, 8, None, 8),
        ("dualpipe", 4, 8, None, 1),
        ("dualpipe", 8, 16, None, 6),
        ("dualpipev", 4, 8, None, 6),
    ],
)
def test_rendezvous_lookahead_an_executor_needs(name, pp, m, chunks, lookahead):
    """Receives posted just in time suffice for 1F1B-like schedules; the others need receives
    pre-posted some steps ahead (or one pre-posted receive per channel, which works for all)."""
    assert validate(build(name, pp, m, chunks)).rendezvous_lookahead == lookahead


def test_one_f_one_b_phases():
    schedule = build("1f1b", 4, 6)
    assert [str(a) for a in schedule.ranks[1]] == (
        "F0s1 F1s1 F2s1 B0s1 F3s1 B1s1 F4s1 B2s1 F5s1 B3s1 B4s1 B5s1".split()
    )
    for r, steps in enumerate(schedule.ranks):
        warmup = next(i for i, a in enumerate(steps) if a.kind == "B") - 1
        assert warmup == min(4 - r - 1, 6)


def test_gpipe_is_all_forwards_then_all_backwards():
    for steps in build("gpipe", 3, 4).ranks:
        assert "".join(a.kind for a in steps) == "FFFFBBBB"


def test_interleaved_places_stage_s_on_rank_s_mod_pp():
    schedule = build("interleaved", 3, 6, 2)
    for r in range(3):
        assert {a.stage for a in schedule.actions(r)} == {r, r + 3}
    # forward order of rank 0: chunk 0 for micro-batches 0..2, then chunk 1 for 0..2, then the next group
    forwards = [(a.stage, a.mb) for a in schedule.actions(0) if a.kind == "F"]
    assert forwards[:6] == [(0, 0), (0, 1), (0, 2), (3, 0), (3, 1), (3, 2)]


def test_zb1p_defers_r_weight_gradients_on_rank_r():
    schedule = build("zb1p", 4, 8)
    for r, steps in enumerate(schedule.ranks):
        kinds = "".join(a.kind for a in steps)
        first_w = kinds.index("W")
        assert kinds[:first_w].count("I") == r + 1  # W(0) comes after I(r)
        assert kinds.endswith("W" * (r + 1)) and not kinds.endswith("W" * (r + 2))


def test_zbh2_warmup_and_tail():
    pp = 4
    schedule = build("zbh2", pp, 12)
    for r, steps in enumerate(schedule.ranks):
        kinds = "".join(a.kind for a in steps)
        assert kinds.index("I") == 2 * (pp - 1 - r) + 1  # warm-up forwards
        assert kinds.endswith("I" + "W" * (2 * r + 1))  # parallelogram tail


def test_zbv_places_two_chunks_in_a_v():
    pp = 3
    schedule = build("zbv", pp, 6)
    for r in range(pp):
        assert {a.stage for a in schedule.actions(r)} == {r, 2 * pp - 1 - r}
        kinds = [a.kind for a in schedule.actions(r)]
        assert kinds[: 2 * (pp - r) - 1] == ["F"] * (2 * (pp - r) - 1)


# --------------------------------------------------------------------------------------------
# DualPipe: the eight steps of REFERENCE.md, checked against an independent token form
# --------------------------------------------------------------------------------------------


def eight_step_tokens(pp: int, m: int, rank: int) -> list[str]:
    """The expected step shapes of one DualPipe rank, written straight from REFERENCE.md:
    'F0' forward of phase 0, 'I1' split backward of phase 1, 'W' a deferred weight half,
    'F0&B1' an overlapped pair, and so on."""
    H, M2, h = pp // 2, m // 2, min(rank, pp - 1 - rank)
    tokens = ["F0"] * (2 * (H - h - 1))  # 1
    tokens += ["F0", "F1"] * (h + 1)  # 2
    tokens += ["I1", "W", "F1"] * (H - h - 1)  # 3
    for i in range(M2 - pp + h + 1):  # 4
        tokens += ["F0", "B1"] if (i == 0 and h == H - 1) else ["F0&B1"]
        tokens += ["F1&B0"]
    tokens += ["B1", "F1&B0"] * (H - h - 1)  # 5
    split = False
    for i in range(h + 1):  # 6
        if i == (h + 1) // 2 and h % 2 == 1:
            split = True
        tokens.append("I1" if split else "B1")
        if i == (h + 1) // 2 and h % 2 == 0:
            split = True
        tokens.append("I0" if split else "B0")
    tokens += ["W", "I0"] * (H - h - 1)  # 7
    tokens += ["W"] * (h + 1)  # 8
    return tokens


def as_tokens(schedule, rank: int) -> list[str]:
    early = 0 if rank < schedule.pp // 2 else 1  # the direction that enters at this rank's end

    def token(a: Action) -> str:
        return "W" if a.kind == "W" else f"{a.kind}{0 if a.direction == early else 1}"

    return ["&".join(token(a) for a in step.parts) for step in schedule.ranks[rank]]


@pytest.mark.parametrize("pp, m", [(2, 4), (2, 10), (4, 8), (4, 12), (6, 12), (6, 20), (8, 16), (8, 20), (10, 24)])
def test_dualpipe_follows_the_eight_steps(pp, m):
    schedule = build("dualpipe", pp, m)
    for rank in range(pp):
        assert as_tokens(schedule, rank) == eight_step_tokens(pp, m, rank)


@pytest.mark.parametrize("pp, m", [(4, 8), (6, 14), (8, 20)])
def test_dualpipe_details(pp, m):
    schedule = build("dualpipe", pp, m)
    M2 = m // 2
    for rank in range(pp):
        actions = list(schedule.actions(rank))
        # stages: direction 0 runs stage r here, direction 1 runs stage pp-1-r
        assert all(a.stage == (rank if a.direction == 0 else pp - 1 - rank) for a in actions)
        # micro-batch halves: direction d owns micro-batches d*M2 .. d*M2 + M2 - 1
        assert all(a.direction * M2 <= a.mb < (a.direction + 1) * M2 for a in actions)
        for d in (0, 1):
            for kinds in ("F", "BI"):
                mbs = [a.mb for a in actions if a.direction == d and a.kind in kinds]
                assert mbs == sorted(mbs) and len(mbs) == M2  # increasing order per phase
        # the deferred weight halves run first-in first-out
        split = [(a.stage, a.mb) for a in actions if a.kind == "I"]
        weights = [(a.stage, a.mb) for a in actions if a.kind == "W"]
        assert split == weights
    # rank r mirrors rank pp-1-r with the directions swapped
    for rank in range(pp):
        mirror = as_tokens(schedule, pp - 1 - rank)
        assert as_tokens(schedule, rank) == mirror


def strip_direction(step, m):
    """A DualPipe(2R, 2m) step in DualPipeV(R, m) terms: direction-1 micro-batch m+k -> k."""
    if isinstance(step, Overlapped):
        return Overlapped(strip_direction(step.f, m), strip_direction(step.b, m))
    return Action(step.kind, step.stage, step.mb - m * step.direction)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.integers(0, 8))
def test_dualpipev_is_the_first_half_of_dualpipe(R, extra):
    m = 2 * R + extra
    v = build("dualpipev", R, m)
    d = dualpipe(2 * R, 2 * m)
    for r in range(R):
        assert [strip_direction(step, m) for step in d.ranks[r]] == list(v.ranks[r])


def test_dualpipev_layout():
    pp = 3
    schedule = build("dualpipev", pp, 6)
    assert [schedule.placement.rank_of(s) for s in range(6)] == [0, 1, 2, 2, 1, 0]
    # the loss stage (5) and the input stage (0) are both on rank 0
    assert {a.stage for a in schedule.actions(0)} == {0, 5}


# --------------------------------------------------------------------------------------------
# Constraints
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, pp, m, chunks, message",
    [
        ("dualpipe", 3, 12, None, "dualpipe needs an even --pp"),
        ("dualpipe", 4, 9, None, "dualpipe needs --micro-batches even and >= 2*pp = 8"),
        ("dualpipe", 4, 6, None, "dualpipe needs --micro-batches even and >= 2*pp = 8"),
        ("dualpipev", 4, 7, None, "dualpipev needs --micro-batches >= 2*pp = 8"),
        ("interleaved", 4, 6, 2, "interleaved needs --micro-batches to be a multiple of --pp 4"),
        ("interleaved", 4, 8, 1, "interleaved needs --chunks >= 2"),
        ("1f1b", 0, 4, None, "--pp must be a positive integer"),
        ("gpipe", 2, 0, None, "--micro-batches must be a positive integer"),
        ("zb1p", 2, 4, 2, "drop --chunks 2"),
        ("zbv", 2, 4, 3, "drop --chunks 3"),
        ("pipedream", 2, 4, None, "unknown schedule 'pipedream'"),
    ],
)
def test_constraint_violations_raise_their_documented_error(name, pp, m, chunks, message):
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        build(name, pp, m, chunks)
    assert "\n" not in str(info.value)  # one line, for `error: ...`


def test_constraint_messages_say_how_to_fix():
    with pytest.raises(ValueError, match="try 8"):
        build("dualpipe", 4, 6)
    with pytest.raises(ValueError, match="try 4 or 6"):
        build("dualpipe", 5, 12)
    with pytest.raises(ValueError, match=r"try 4 or 8"):
        build("interleaved", 4, 6, 2)
