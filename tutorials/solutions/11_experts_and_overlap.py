"""Reference solutions to tutorial 11's exercises (REFIMPL_TUTORIAL_SOLUTIONS=1 selects them)."""

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
