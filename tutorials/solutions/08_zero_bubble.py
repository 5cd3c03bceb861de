"""Reference solutions to tutorial 08's exercises (REFIMPL_TUTORIAL_SOLUTIONS=1 selects them)."""


def zb1p_idle(pp, F, I, W):  # noqa: E741
    return (pp - 1) * (F + I - W)


def peak_activations(program, free_at):
    live = peak = 0
    for action in program:
        kind = action[0]
        if kind == "F":
            live += 1
            peak = max(peak, live)
        elif kind == "B" or kind == free_at:
            live -= 1
    return peak


def zb_h1(pp, m):
    programs = []
    for r in range(pp):
        warmup = min(pp - r - 1, m)
        steps = [f"F{k}" for k in range(warmup)]
        next_w = 0
        for k in range(m):
            if warmup + k < m:
                steps.append(f"F{warmup + k}")
            steps.append(f"I{k}")
            if k >= r:
                steps.append(f"W{next_w}")
                next_w += 1
        steps += [f"W{j}" for j in range(next_w, m)]
        programs.append(steps)
    return programs


def zb1p_idle_any(pp, F, I, W):  # noqa: E741
    # Each of the p − 1 hops leaves a gap of F + I that one deferred W fills, but only up to the
    # shortest of F, I and W: a W longer than the F or I beside it pushes the next action back.
    return (pp - 1) * (F + I - min(F, I, W))


ANSWER = """
Model answer to the question (measure and explain).

Measured at p = 4, m = 8 (3, 4 and 6 ranks give the same pattern), idle per rank in one iteration
and in steady state:
    F, I, W     ZB-H1 idle   ZB-H2 idle   ZB-H2 steady state
    1, 1, 1          3            3              0
    2, 1, 1          6            6              3
    1, 2, 1          6            3              3
    1, 1, 2          3            3              0
    3, 1, 1          9            9              6
ZB-H2's steady-state idle is (p − 1)·max(0, F + I − 2W), and within one iteration (p − 1)·max(F,
F + I − 2W). In ZB-H1 each of the p − 1 hops of the pipeline leaves a gap of F + I (a forward to
come, an input gradient to come back) that one deferred W fills: (p − 1)(F + I − W), exercise 1.
ZB-H2's p − 1 extra warm-up forwards on rank 0 (2p − 1 in all, fewer on later ranks) put two W's
in every gap, so a gap closes when 2W ≥ F + I: that is the balanced case F = I = W, where the
bubble vanishes. A slower forward or input gradient reopens it, and 2W no longer covers it. Within
one iteration the last rank still waits (p − 1)F for its first activation, which only the previous
iteration's tail can hide (steady state). The price is memory: every rank holds 2p − 1 = 7
activations at peak, against ZB-H1's p = 4 and 1F1B's p − r.
"""
