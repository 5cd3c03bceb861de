"""Reference solutions to tutorial 11's exercises (REFIMPL_TUTORIAL_SOLUTIONS=1 selects them), and a
model answer to its question (at the end)."""

import numpy as np
from harness.experts import is_alltoall


def dispatch_indices(chosen, n_experts):
    flat = np.asarray(chosen).reshape(-1)  # (N·K,) the expert of assignment a = token·K + choice
    order = np.argsort(flat, kind="stable")  # grouped by expert, token order inside (a stable sort)
    counts = np.bincount(flat, minlength=n_experts)  # (E,) assignments per expert, zeros included
    inverse = np.empty_like(order)
    inverse[order] = np.arange(len(order))  # assignment order[i] sits at row i
    return order, counts, inverse.reshape(np.shape(chosen))


def overlapped_order(forward, backward):
    tasks = {"F": list(forward), "B": list(backward)}
    pos = {"F": 0, "B": 0}
    other = {"F": "B", "B": "F"}
    turn, order = "F", []
    while len(order) < len(tasks["F"]) + len(tasks["B"]):
        if pos[turn] == len(tasks[turn]):  # this task has finished: the other runs to its end
            turn = other[turn]
            continue
        chunk = tasks[turn][pos[turn]]
        pos[turn] += 1
        order.append((turn, chunk))
        if is_alltoall(chunk) and pos[other[turn]] < len(tasks[other[turn]]):
            turn = other[turn]  # pause() right after starting the all-to-all
    return order


def exposed_time(order, cost):
    clock = busy = 0  # when the engine is free; the compute it has done
    arrives = {"F": 0, "B": 0}  # when each task's last all-to-all arrives
    for task, chunk in order:
        start = max(clock, arrives[task])  # the task's next chunk waits for its all-to-all
        if is_alltoall(chunk):
            clock, arrives[task] = start, start + cost(task, chunk)  # starting it takes no engine time
        else:
            clock = start + cost(task, chunk)
            busy += cost(task, chunk)
    return max(clock, *arrives.values()) - busy


def alltoall_bytes(chosen, n_experts, width, itemsize):
    P = len(chosen)
    home = [np.asarray(c).reshape(-1) // (n_experts // P) for c in chosen]  # the rank of each assignment's expert
    result = []
    for r in range(P):
        away = int((home[r] != r).sum())  # rows r dispatches to the other ranks (and gets back in the combine)
        back = sum(int((home[s] == r).sum()) for s in range(P) if s != r)  # rows others dispatch to r: r combines them
        counts = 8 * (n_experts - n_experts // P)  # int64 counts, E/P to each other rank, in forward only
        # forward: dispatch `away` rows, combine `back` rows; backward: the transposes, the same blocks reversed
        result.append({"alltoall": counts, "alltoallv": 2 * (away + back) * width * itemsize})
    return result


ANSWER = """
Model answer to the question (measure and explain).

(a) All logits are 0, the softmax is uniform and top-2 breaks ties by index: every token picks experts 0 and
1, both on rank 0. Rank 0 sends its 20 assignments to itself (rows to each rank [20, 0], from each [20, 20]);
rank 1 sends its 20 to rank 0 and receives none. Both count 2,560 bytes of all-to-all(v) = 2 · 8 · 8 · 20 and
16 of counts, and the outputs equal one process's. Rank 0's experts process all 40 assignments, rank 1's none.
A step lasts as long as its most loaded rank: imbalance turns P ranks into one (its compute, its activation
memory, its link), or drops tokens under a capacity factor; the balance loss keeps each rank near N·K/P,
which is what makes expert parallelism's speed-up and memory split real.
(b) F then B exposes 8s (0, 8, ... 96): each of the 8 all-to-alls is waited for in full, as the only running
task needs its rows next. Interleaved: 0 for s ≤ 1, then 1, 3, 7, 11, ... 39 at s = 12: slope 4. Exposure
starts where the other task has least compute before it starts an all-to-all itself: at the end F has only
gates 1 (1 unit) to run behind B's last dispatch. For large s both tasks are blocked at once with one
all-to-all in flight each, so the 8 waits overlap pairwise into 4. Two tasks can hide an all-to-all only
behind the other's compute up to its next switch; beyond that nothing is left to run: halved, not removed.
(c) Grad mode: backward runs with recording off. Leaked into F's later chunks, F would record no graph for
its experts and combine: gradients missing or an error, and verify fails. F's recording-on leaked into B
would record the backward itself: same gradients, verify passes, only memory shows it. Batch rows: dropout
draws its masks by rows of the global batch; F's chunks under B's rows would draw another micro-batch's
masks, so with dropout verify fails, and without dropout nothing reads the rows and nothing is seen.
"""
