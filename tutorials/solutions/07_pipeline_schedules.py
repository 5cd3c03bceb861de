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
