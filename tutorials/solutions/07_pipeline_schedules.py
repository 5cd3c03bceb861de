"""Reference solutions to tutorial 07's exercises (REFIMPL_TUTORIAL_SOLUTIONS=1 selects them)."""

from fractions import Fraction


def gpipe(pp, m):
    return [[f"F{k}" for k in range(m)] + [f"B{k}" for k in range(m)] for _ in range(pp)]


def one_f_one_b(pp, m):
    programs = []
    for r in range(pp):
        warmup = min(pp - r - 1, m)
        steps = [f"F{k}" for k in range(warmup)]
        for k in range(m - warmup):
            steps += [f"F{warmup + k}", f"B{k}"]
        steps += [f"B{k}" for k in range(m - warmup, m)]
        programs.append(steps)
    return programs


def bubble_fraction(pp, m):
    return Fraction(pp - 1, m + pp - 1)


def interleaved_bubble(pp, m, v):
    # Idle per rank is 1F1B's (p − 1)(F + B) divided by v (the pipeline fills v times faster); the
    # work stays m(F + B). Idle ÷ (work + idle) = (p − 1)/v ÷ (m + (p − 1)/v).
    return Fraction(pp - 1, v * m + pp - 1)


ANSWER = """
Model answer to the question (measure and explain).

At p = 4, m = 8, costs F = 1/v, B = 2/v per chunk: 1F1B (v = 1) peaks at [4, 3, 2, 1] activations,
interleaved at [11, 9, 7, 5] chunk activations for v = 2 and [19, 17, 15, 13] for v = 4, with
bubble fractions 3/11, 3/19 and 3/35. A chunk holds 1/v of a stage's layers, so rank 0 holds 5.5
and 4.75 whole-stage activations: more than 1F1B's 4. Why: before its first backward, rank r must
run forwards until the first micro-batch has crossed all pv stages and come back. Its warm-up is
(v − 1)p forwards for its earlier chunks plus 2(p − r − 1) for the depth below it, then one
more: 2(p − r − 1) + (v − 1)p + 1 chunks (measured exactly for p = 2 … 5, m = 2p and 4p, v = 2 … 4).
For rank 0 that is p + (p − 1)/v stages' worth: the extra (p − 1)/v shrinks with v, but is never 0.
The edge case m = p: every rank holds all v·m chunks, GPipe's memory: the warm-up is longer than
the batch, so no backward starts before the last forward: interleaving pays off in memory only
when m is well above p (refimpl's generator also needs m to be a multiple of p).
What else interleaving costs: each rank sends an activation and a gradient per chunk and
micro-batch, v times 1F1B's messages (each 1/v as long to compute around, so latency is hidden less
well), and its actions are v times as many. The bubble drops from (p − 1)/(m + p − 1) to
(p − 1)/(vm + p − 1), as if the batch had v times the micro-batches, without their memory.
"""
