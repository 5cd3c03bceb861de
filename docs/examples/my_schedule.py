"""A pipeline schedule of my own: 1F1B with the input gradients first in the cool-down.

    python -m refimpl schedule docs/examples/my_schedule.py:early_backward --pp 4 --micro-batches 8 --costs F=1,I=1,W=1
    mpiexec -n 2 python -m refimpl verify --pp 2 --schedule docs/examples/my_schedule.py:early_backward

The idea. In 1F1B (refimpl/parallel/pipeline/schedules/one_f_one_b.py) every backward is one full
B, so in the cool-down rank r-1 waits for rank r's whole backward before it can start its own.
Only the input-gradient half (I) is on that path; the weight-gradient half (W) is not needed by
anybody until the optimizer step. So this schedule splits B into I then W, keeps 1F1B's order in
the warm-up and the steady state (each I followed at once by its W: the same activations in
flight as 1F1B), and in the cool-down runs the remaining I's first, as early as their gradients
arrive, and the W's last, where they fill what would have been idle time.

Targets (docs/capstone.md checks them, and so does tests/test_schedule_plugin.py): at pp=4,
8 micro-batches, F = I = W = 1 (B = 2),

    bubble     less than 1F1B's: 0.2500 vs 0.2727 (idle per rank (p-1)(F+B) - W = 8 vs 9)
    memory     peak activations per rank no more than 1F1B's (p - r on rank r)
"""

from refimpl.parallel.pipeline.schedules import Action, check_counts, fixed_chunks, linear_placement, make_schedule


def early_backward(pp, micro_batches, chunks=None):
    """1F1B on pp ranks (stage r on rank r) with B split into I and W; cool-down: I's first, then W's."""
    check_counts("early_backward", pp, micro_batches)  # one-line errors for a bad --pp / --micro-batches
    fixed_chunks("early_backward", chunks, 1)  # one stage per rank: refuse --chunks 2
    m = micro_batches
    ranks = []
    for r in range(pp):
        warmup = min(pp - r - 1, m)  # forwards before the first backward, as in 1F1B
        steps = [Action("F", r, k) for k in range(warmup)]
        for k in range(m - warmup):  # steady state: one forward, one backward (I then W at once)
            steps += [Action("F", r, warmup + k), Action("I", r, k), Action("W", r, k)]
        cooldown = range(m - warmup, m)
        steps += [Action("I", r, k) for k in cooldown]  # the critical path first...
        steps += [Action("W", r, k) for k in cooldown]  # ...the weight gradients fill the tail
        ranks.append(steps)
    return make_schedule("early_backward", pp, m, linear_placement(pp), ranks)
