"""Simulated ranks with all-to-all, and the checks of tutorial 11 (experts, expert parallelism, overlap).

Expert parallelism moves tokens with all-to-alls inside forward and backward. tutorial 10's
simulated ranks (harness/tensor_parallel.py: each rank a thread of this process, one running at a
time, switching inside collectives) have no all-to-all, so this module adds it:

    def program(comm):                                   # comm.alltoall(send, recv), comm.alltoallv(...),
        ...                                              # comm.ialltoallv(...) -> request.test() / .wait()
    results = run_ranks(2, program)                      # [program(comm of rank 0), program(comm of rank 1)]

`AllToAllThreadComm` is tutorial 10's ThreadComm, a refimpl `Comm`, with the two missing
primitives of refimpl/parallel/comm.py's interface: `alltoall(sendbuf, recvbuf)` (equal blocks)
and `alltoallv(sendbuf, sendcounts, recvbuf, recvcounts)` (blocks of any length, counted in
elements), blocking and non-blocking (`ialltoall`, `ialltoallv`: a `Request` with test() and
wait()). The argument checks and the byte counters are the base class's, as with MPI's built-ins:
a rank counts every block it sends but its own. A non-blocking all-to-all here completes when it
is started (every rank has to reach it first), so test() is at once true; the order of the calls,
which MPI needs the same on every rank, is checked: a rank that calls another collective, or sends
a block whose length its receiver did not expect, gets a message that says so, never a hang.

The checks: exercise 1 (the dispatch bookkeeping of refimpl/nn/experts.py's `route`), exercise 2
(an overlapped F&B order, as refimpl/parallel/pipeline/overlap.py's Interleaver runs it) and
exercise 3 (the communication time such an order leaves exposed).
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np

from refimpl.nn.experts import route
from refimpl.parallel import ring

from . import Wrong, plain, shown, tensor_parallel
from .tensor_parallel import ThreadComm

# ------------------------------------------------------------------------------------------------
# Simulated ranks with all-to-all
# ------------------------------------------------------------------------------------------------


class AllToAllThreadComm(ThreadComm):
    """tutorial 10's ThreadComm plus all-to-all(v): refimpl's Comm interface, counted like MPI's built-ins."""

    def _mpi_alltoall(self, send, recv, blocking):
        counts = ring.block_counts(send.size, self.size)  # (N,) equal blocks
        self._blocks("alltoall", send, counts, recv, counts)

    def _mpi_alltoallv(self, send, sendcounts, recv, recvcounts, blocking):
        self._blocks("alltoallv", send, sendcounts, recv, recvcounts)

    def _blocks(self, kind: str, send, sendcounts, recv, recvcounts) -> None:
        """Every rank's send buffer and counts meet; this rank keeps block `rank` of each, in rank order."""
        what = (kind, None, None)  # the ranks' sizes differ in an all-to-all(v): only the kind must agree
        parts = self._group.exchange(self.rank, what, (send.copy(), np.array(sendcounts, dtype=np.int64)))
        blocks = []
        for source, (buf, counts) in enumerate(parts):
            start = int(counts[:self.rank].sum())
            if int(counts[self.rank]) != int(recvcounts[source]):
                raise Wrong(f"{kind}: rank {source} sends {int(counts[self.rank])} elements to rank {self.rank}, but "
                            f"rank {self.rank} expects {int(recvcounts[source])} from it (recvcounts[{source}]): "
                            f"exchange the counts first (alltoall), as refimpl's ExpertParallel does")
            blocks.append(buf[start:start + int(counts[self.rank])])
        recv[...] = np.concatenate(blocks)


def run_ranks(size: int, program, *args) -> list:
    """[program(comm, *args) on rank r for r in range(size)], each rank a thread with an AllToAllThreadComm
    (harness/tensor_parallel.run_ranks: the first exception raised by a rank's own code is raised here)."""
    return tensor_parallel.run_ranks(size, program, *args, comm_class=AllToAllThreadComm)


# ------------------------------------------------------------------------------------------------
# Exercise 1: dispatch and combine as a sort and its inverse
# ------------------------------------------------------------------------------------------------


def reference_dispatch_indices(chosen, n_experts: int) -> tuple:
    """refimpl's bookkeeping for chosen experts (N, K): (order (N·K,), counts (E,), inverse (N, K)).

    order and counts are what refimpl/nn/experts.py's `route` computes; inverse is the layer's
    `slot` (the row of the sorted outputs each (token, choice) reads back), shaped (N, K)."""
    chosen = np.asarray(chosen)
    flat = chosen.reshape(-1)
    order = np.argsort(flat, kind="stable")
    counts = np.bincount(flat, minlength=n_experts)
    inverse = np.empty_like(order)
    inverse[order] = np.arange(len(order))
    return order, counts, inverse.reshape(chosen.shape)


def _dispatch_cases():
    """(what, probs (N, E), K): router probabilities from which route() draws the chosen experts."""
    rng = np.random.default_rng(110)
    cases = []
    tie = np.array([[0.1, 0.5, 0.3, 0.1], [0.4, 0.1, 0.4, 0.1], [0.2, 0.6, 0.1, 0.1], [0.25, 0.25, 0.25, 0.25],
                    [0.05, 0.15, 0.3, 0.5], [0.1, 0.2, 0.2, 0.5]])
    cases.append(("the 6 tokens of part 1 (E = 4, K = 2, with ties)", tie, 2))
    cases.append(("a zero router (every probability 1/E: experts 2 and 3 get no token)", np.full((5, 4), 0.25), 2))
    one = np.full((7, 4), 0.1)
    one[:, 2] = 0.7
    cases.append(("one expert taking every token (E = 4, K = 1)", one, 1))
    for n, e, k in ((5, 2, 1), (6, 4, 2), (9, 8, 2), (8, 8, 3), (12, 4, 2), (64, 4, 2), (50, 8, 3)):
        logits = rng.integers(0, 3, (n, e)).astype(np.float64)  # few distinct values: many ties
        probs = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
        cases.append((f"{n} tokens, E = {e}, K = {k}", probs, k))
    return cases


def _as_int_array(value, name: str, what: str) -> np.ndarray:
    if value is None:
        raise Wrong(f"{what}: {name} is None")
    array = np.asarray(value)
    if array.dtype.kind not in "iu":
        if array.dtype.kind == "f" and np.all(array == np.round(array)):
            return array.astype(np.int64)
        raise Wrong(f"{what}: {name} must hold integer indices, not {array.dtype}")
    return array.astype(np.int64)


def _check_order(order, expected, chosen, what: str) -> None:
    N, K = chosen.shape
    flat = chosen.reshape(-1)
    if order.shape != expected.shape:
        raise Wrong(f"{what}: order must have one entry per assignment, shape (N·K,) = {expected.shape}; yours has "
                    f"shape {order.shape}")
    if np.array_equal(order, expected):
        return
    if K > 1 and np.array_equal(order, expected // K):
        raise Wrong(f"{what}: your order holds token indices ({order[:8].tolist()} ...); it must hold assignment "
                    f"indices a = token·K + choice ({expected[:8].tolist()} ...): with K = {K} a token appears once "
                    f"per chosen expert, and the token of assignment a is a // K")
    if sorted(order.tolist()) != list(range(N * K)):
        raise Wrong(f"{what}: order must be a permutation of the N·K = {N * K} assignments 0 … {N * K - 1}; yours "
                    f"is {order.tolist()}")
    experts = flat[order]
    for i in range(1, len(order)):
        if experts[i] < experts[i - 1]:
            raise Wrong(f"{what}: order is not grouped by expert: row {i - 1} holds assignment {order[i - 1]} "
                        f"(expert {experts[i - 1]}) and row {i} assignment {order[i]} (expert {experts[i]}); rows "
                        f"must come expert 0's first, then expert 1's, … so that each expert's rows are one block")
    for e in range(int(flat.max()) + 1):
        mine = order[experts == e]
        if np.any(np.diff(mine) < 0):
            raise Wrong(f"{what}: expert {e}'s rows hold the assignments {mine.tolist()}, not in token order "
                        f"({sorted(mine.tolist())}): the sort must be stable (np.argsort(..., kind='stable'); "
                        f"NumPy's default sort is not), so that every implementation -- and every rank of a "
                        f"distributed run -- feeds each expert its rows in the same order")
    raise Wrong(f"{what}: order is {order.tolist()}, expected {expected.tolist()}")


def _check_counts(counts, expected, chosen, what: str) -> None:
    N, K = chosen.shape
    if counts.shape != expected.shape:
        raise Wrong(f"{what}: counts must have one entry per expert, E = {len(expected)} of them, zeros included "
                    f"(experts {np.flatnonzero(expected == 0).tolist() or 'none'} get no row here, and an expert "
                    f"with no row still needs its block, of length 0); yours has shape {counts.shape}")
    if np.array_equal(counts, expected):
        return
    if K > 1 and int(counts.sum()) == N:
        raise Wrong(f"{what}: your counts {counts.tolist()} add up to N = {N}, the tokens; the sorted rows are the "
                    f"N·K = {N * K} assignments (token, choice): a token with K = {K} chosen experts has a row in "
                    f"each of their blocks. Expected {expected.tolist()}")
    raise Wrong(f"{what}: counts {counts.tolist()}, expected {expected.tolist()} (rows per expert: its assignments)")


def _check_inverse(inverse, expected, order, chosen, what: str) -> None:
    N, K = chosen.shape
    flat = chosen.reshape(-1)
    if inverse.size == expected.size and not np.array_equal(inverse.reshape(-1), expected.reshape(-1)) \
            and np.array_equal(inverse.reshape(-1), order):
        raise Wrong(f"{what}: your inverse is the order itself. order[i] is the assignment at sorted row i (row → "
                    f"assignment); the combine needs the other direction, assignment → row: inverse[t, c] = the i "
                    f"with order[i] = t·K + c, the inverse permutation. Expected {expected.reshape(-1).tolist()}, "
                    f"yours {inverse.reshape(-1).tolist()}")
    if inverse.shape != expected.shape:
        raise Wrong(f"{what}: inverse must be shaped (N, K) = {expected.shape}, one row index per (token, choice), "
                    f"so that y_sorted[inverse] is (N, K, C); yours has shape {inverse.shape}")
    if np.array_equal(inverse, expected):
        return
    bad = np.argwhere(inverse != expected)[0]
    t, c = int(bad[0]), int(bad[1])
    a = t * K + c
    got = int(inverse[t, c])
    holds = (f"row {plain(got)} holds assignment {int(order[got])} (token {int(order[got]) // K}, expert "
             f"{int(flat[order[got]])})") if 0 <= got < len(order) else f"there is no row {plain(got)}"
    raise Wrong(f"{what}: token {t}'s choice {c} (assignment {a}, expert {int(flat[a])}) sits at sorted row "
                f"{int(expected[t, c])}; your inverse reads row {plain(got)}, and {holds}")


def check_dispatch_indices(dispatch_indices) -> None:
    """Check: dispatch and combine as a sort and its inverse."""
    for what, probs, K in _dispatch_cases():
        chosen, order, counts = route(probs, K)
        N, E = probs.shape
        expected_inverse = reference_dispatch_indices(chosen, E)[2]
        where = f"{what}, chosen = {chosen.tolist()}" if N <= 9 else what
        got = dispatch_indices(chosen.copy(), E)
        if not isinstance(got, (tuple, list)) or len(got) != 3:
            raise Wrong(f"return the 3 arrays (order, counts, inverse); got {shown(got)}")
        g_order, g_counts, g_inverse = (_as_int_array(v, n, where) for v, n in zip(got, ("order", "counts", "inverse")))
        _check_order(g_order, order, chosen, where)
        _check_counts(g_counts, counts, chosen, where)
        _check_inverse(g_inverse, expected_inverse, order, chosen, where)


# ------------------------------------------------------------------------------------------------
# Exercises 2 and 3: an overlapped F&B step
# ------------------------------------------------------------------------------------------------

ALLTOALL_KINDS = ("dispatch", "combine")


def is_alltoall(chunk: str) -> bool:
    """Whether a chunk ("dispatch 0", "combine 1", ...) starts an all-to-all (in F, or its transpose in B)."""
    return str(chunk).split()[0] in ALLTOALL_KINDS


def moe_forward(layers, head: bool = False) -> list:
    """The chunks of a forward through `layers`, in order, then the head (the loss) if asked. A layer is
    its number l, an MoE layer: attention, dispatch (all-to-all), experts, combine (all-to-all), gates
    (the gate-weighted sum of each token's K outputs, which needs the combine's rows); or ("dense", l):
    attention, mlp."""
    chunks = []
    for layer in layers:
        if isinstance(layer, tuple):  # ("dense", l): attention, then an ordinary MLP
            chunks += [f"attention {layer[1]}", f"mlp {layer[1]}"]
        else:
            chunks += [f"attention {layer}", f"dispatch {layer}", f"experts {layer}", f"combine {layer}",
                       f"gates {layer}"]
    return chunks + (["head"] if head else [])


def moe_backward(layers, head: bool = False) -> list:
    """The chunks of the backward of moe_forward(layers, head): the same chunks in reverse order (each
    chunk's transpose: the backward of a combine is an all-to-all too, the gradients going to the experts)."""
    return list(reversed(moe_forward(layers, head)))


def reference_interleave(forward, backward) -> list:
    """The order overlap.Interleaver runs an F&B step in: F first; a task gives way right after it starts
    an all-to-all, if the other task has chunks left; a task that has finished hands over."""
    tasks = {"F": list(forward), "B": list(backward)}
    pos = {"F": 0, "B": 0}
    other = {"F": "B", "B": "F"}
    turn, order = "F", []
    while len(order) < len(tasks["F"]) + len(tasks["B"]):
        if pos[turn] == len(tasks[turn]):
            turn = other[turn]
            continue
        chunk = tasks[turn][pos[turn]]
        pos[turn] += 1
        order.append((turn, chunk))
        if is_alltoall(chunk) and pos[other[turn]] < len(tasks[other[turn]]):
            turn = other[turn]
    return order


def _show(order) -> str:
    return ", ".join(f"{t}:{c}" for t, c in order)


def _interleave_cases() -> list:
    return [
        ("one MoE layer each", moe_forward([0]), moe_backward([0])),
        ("two MoE layers each, with the head (the loss) at the end of F and the start of B",
         moe_forward([0, 1], head=True), moe_backward([0, 1], head=True)),
        ("F through two MoE layers, B through one (in DualPipe a rank's F and B may belong to its two "
         "different stages)", moe_forward([2, 3]), moe_backward([0])),
        ("a dense layer then an MoE layer (--moe-every 2)", moe_forward([("dense", 0), 1]),
         moe_backward([("dense", 0), 1])),
        ("F through an MoE layer, B through dense layers only (no all-to-all in B)", moe_forward([1]),
         moe_backward([("dense", 0), ("dense", 1)])),
        ("dense layers only (nothing to overlap)", moe_forward([("dense", 0)]), moe_backward([("dense", 0)])),
        ("three MoE layers each", moe_forward([0, 1, 2]), moe_backward([0, 1, 2])),
        ("F of a stage that sends its output as soon as its last combine arrives (no gates chunk after it)",
         moe_forward([0, 1])[:-1], moe_backward([0, 1])),
    ]


def check_overlapped_order(overlapped_order) -> None:
    """Check: an overlapped F&B order."""
    for what, forward, backward in _interleave_cases():
        got = overlapped_order(list(forward), list(backward))
        where = f"{what}: F = {forward}, B = {backward}"
        if not isinstance(got, (list, tuple)) or not all(isinstance(x, (list, tuple)) and len(x) == 2 for x in got):
            raise Wrong(f"{where}: return a list of (task, chunk) pairs, task 'F' or 'B'; got {shown(got)}")
        got = [(str(t), c) for t, c in got]
        if any(t not in ("F", "B") for t, _ in got):
            raise Wrong(f"{where}: every pair's task must be 'F' or 'B'; yours has {sorted({t for t, _ in got})}")
        for task, own in (("F", forward), ("B", backward)):
            mine = [c for t, c in got if t == task]
            if mine == own:
                continue
            if sorted(mine) == sorted(own):
                i = next(i for i, (a, b) in enumerate(zip(mine, own)) if a != b)
                raise Wrong(f"{where}: {task}'s chunks run out of order: its chunk {i + 1} is '{mine[i]}' where "
                            f"'{own[i]}' comes first. A task's own chunks keep their order (each needs the one "
                            f"before: experts the rows its dispatch brings, the next layer the combine's output); "
                            f"only the two tasks' chunks are interleaved")
            raise Wrong(f"{where}: {task}'s chunks in your order are {mine}; they must be exactly {own}, each "
                        f"once")
        if got and got[0] != ("F", forward[0]):
            raise Wrong(f"{where}: your order starts with {got[0][0]}:{got[0][1]}; the F&B step starts with its "
                        f"forward (Interleaver.run(F, B)): F runs until it starts its first all-to-all")
        remaining = {"F": len(forward), "B": len(backward)}
        other = {"F": "B", "B": "F"}
        if any(is_alltoall(c) for c in forward + backward) and backward and forward \
                and [t for t, _ in got] == ["F"] * len(forward) + ["B"] * len(backward):
            first = next((c for c in forward if is_alltoall(c)), None)
            if first is not None:
                raise Wrong(f"{where}: your order never switches: F runs all its chunks, then B (that is F then B, "
                            f"--no-overlap). Every all-to-all of F then travels while nothing computes -- F's next "
                            f"chunk waits for it. Right after F starts '{first}', B should run")
        for i, (task, chunk) in enumerate(got):
            remaining[task] -= 1
            nxt = got[i + 1][0] if i + 1 < len(got) else None
            if nxt is None:
                break
            if nxt != task and remaining[task] > 0 and not is_alltoall(chunk):
                upcoming = [c for t, c in got[i + 1:] if t == task]
                hint = ""
                if upcoming and is_alltoall(upcoming[0]):
                    hint = (f" -- its next chunk, '{upcoming[0]}', starts the all-to-all: switching before it "
                            f"starts leaves nothing in flight for {other[task]}'s computation to hide")
                raise Wrong(f"{where}: after {task}:{chunk}, a computation, your order switches to {other[task]}; "
                            f"a task gives way only right after it starts an all-to-all (pause() follows "
                            f"ialltoallv){hint}. Your order: {_show(got)}")
            if nxt == task and is_alltoall(chunk) and remaining[other[task]] > 0:
                raise Wrong(f"{where}: after {task} starts '{chunk}', your order goes on with {task}:{got[i + 1][1]} "
                            f"although {other[task]} still has {remaining[other[task]]} chunks: {task}'s next chunk "
                            f"needs what the all-to-all brings, so it would wait; give way to {other[task]} right "
                            f"after the start, as Interleaver.pause() does. Your order: {_show(got)}")
        expected = reference_interleave(forward, backward)
        if got != expected:
            raise Wrong(f"{where}: your order is {_show(got)}; expected {_show(expected)}")


# ------------------------------------------------------------------------------------------------
# Exercise 3: the communication time an order leaves exposed
# ------------------------------------------------------------------------------------------------


def reference_exposed_time(order, cost):
    """Time the one compute engine waits for all-to-alls when the chunks run in `order`.

    A compute chunk takes cost(task, chunk) of the engine; starting an all-to-all takes none, and it
    arrives cost(task, chunk) later; a task's next chunk, and the task's end, wait for its
    all-to-all. Exposed = makespan − Σ compute."""
    clock, busy = 0, 0  # when the engine is free; its compute so far
    ready = {"F": 0, "B": 0}  # when each task's last all-to-all arrives (its next chunk may start)
    for task, chunk in order:
        start = max(clock, ready[task])
        if is_alltoall(chunk):
            clock, ready[task] = start, start + cost(task, chunk)
        else:
            clock = start + cost(task, chunk)
            busy += cost(task, chunk)
            ready[task] = clock
    return max(clock, *ready.values()) - busy


def _without_final_wait(order, cost):
    clock, busy, ready = 0, 0, {"F": 0, "B": 0}
    for task, chunk in order:
        start = max(clock, ready[task])
        if is_alltoall(chunk):
            clock, ready[task] = start, start + cost(task, chunk)
        else:
            clock, busy = start + cost(task, chunk), busy + cost(task, chunk)
            ready[task] = clock
    return clock - busy


def _in_flight_only(order, cost):
    """Σ max(0, transfer − the compute that runs between an all-to-all's start and its task's next chunk)."""
    total = 0
    for i, (task, chunk) in enumerate(order):
        if not is_alltoall(chunk):
            continue
        hidden = 0
        for t, c in order[i + 1:]:
            if t == task:
                break
            if not is_alltoall(c):
                hidden += cost(t, c)
        total += max(0, cost(task, chunk) - hidden)
    return total


def _costs(table: dict):
    def cost(task, chunk):
        return table[(task, str(chunk).split()[0])]
    return cost


def _exposed_cases() -> list:
    base = {("F", "attention"): 2, ("F", "experts"): 3, ("F", "gates"): 1, ("F", "mlp"): 3, ("F", "head"): 1,
            ("B", "attention"): 4, ("B", "experts"): 6, ("B", "gates"): 1, ("B", "mlp"): 6, ("B", "head"): 2,
            ("F", "dispatch"): 3, ("F", "combine"): 3, ("B", "dispatch"): 3, ("B", "combine"): 3}
    slow = {**base, **{(t, k): 8 for t in "FB" for k in ALLTOALL_KINDS}}
    cases = []
    one_f, one_b = moe_forward([0]), moe_backward([0])
    cases.append(("one MoE layer each, F then B (no overlap)", [("F", c) for c in one_f] + [("B", c) for c in one_b],
                  base))
    cases.append(("one MoE layer each, interleaved", reference_interleave(one_f, one_b), base))
    two_f, two_b = moe_forward([0, 1], head=True), moe_backward([0, 1], head=True)
    cases.append(("two MoE layers each, interleaved", reference_interleave(two_f, two_b), base))
    cases.append(("two MoE layers each, interleaved, all-to-alls slower than any computation",
                  reference_interleave(two_f, two_b), slow))
    cases.append(("F through one MoE layer, B through dense layers only",
                  reference_interleave(moe_forward([1]), moe_backward([("dense", 0), ("dense", 1)])), base))
    cases.append(("F of a stage that sends its output as soon as its last combine arrives (no gates chunk after "
                  "it), B through one MoE layer", reference_interleave(moe_forward([0, 1])[:-1], moe_backward([0])),
                  slow))
    rng = np.random.default_rng(111)
    for n in range(24):  # arbitrary merges of the two tasks' chunks, random whole-number costs
        f = moe_forward(range(rng.integers(1, 3)), head=bool(rng.integers(2)))
        b = moe_backward(range(rng.integers(1, 3)), head=bool(rng.integers(2)))
        slots = sorted(rng.choice(len(f) + len(b), len(f), replace=False).tolist())
        fi, bi, order = iter(f), iter(b), []
        for i in range(len(f) + len(b)):
            order.append(("F", next(fi)) if i in slots else ("B", next(bi)))
        table = {key: int(rng.integers(0, 7)) for key in base}
        cases.append((f"a drawn order, case {n}", order, table))
    return cases


def _describe_costs(table: dict, order) -> str:
    used = {(t, str(c).split()[0]) for t, c in order}
    compute = ", ".join(f"{t} {k} {v}" for (t, k), v in table.items() if (t, k) in used and k not in ALLTOALL_KINDS)
    comm = ", ".join(f"{t} {k} {v}" for (t, k), v in table.items() if (t, k) in used and k in ALLTOALL_KINDS)
    return f"compute: {compute}; all-to-all in flight: {comm}"


def check_exposed_time(exposed_time) -> None:
    """Check: the communication time an F&B order leaves exposed."""
    for what, order, table in _exposed_cases():
        cost = _costs(table)
        expected = reference_exposed_time(order, cost)
        got = exposed_time(list(order), cost)
        if got is None:
            raise Wrong(f"{what}: exposed_time returned None")
        try:
            value = Fraction(got).limit_denominator(10**6) if not isinstance(got, Fraction) else got
        except (TypeError, ValueError):
            raise Wrong(f"{what}: return a number; got {shown(got)}") from None
        if value == expected:
            continue
        where = f"{what}: order {_show(order)}; {_describe_costs(table, order)}"
        total = sum(cost(t, c) for t, c in order if is_alltoall(c))
        if value == total and total != expected:
            raise Wrong(f"{where}. You counted every all-to-all as exposed ({total}), but while one task's "
                        f"all-to-all is in flight the other task's chunks compute: the answer is {expected}")
        if value == _without_final_wait(order, cost) != expected:
            raise Wrong(f"{where}. You returned {value}, the engine's idle time up to its last chunk; but a task's "
                        f"last all-to-all may still be in flight then, and the step ends only when it has "
                        f"arrived (the task waits for it): {expected}")
        if value == _in_flight_only(order, cost) != expected:
            raise Wrong(f"{where}. You returned {value}: each all-to-all minus the computation that runs while it "
                        f"travels. But time also passes while the engine waits for another all-to-all in between "
                        f"(that waiting hides this one too), and all-to-alls can be in flight at once: simulate "
                        f"one clock. Expected {expected}")
        raise Wrong(f"{where}. You returned {value}, expected {expected}")


__all__ = ["AllToAllThreadComm", "run_ranks", "reference_dispatch_indices", "check_dispatch_indices", "is_alltoall",
           "moe_forward", "moe_backward", "reference_interleave", "check_overlapped_order", "reference_exposed_time",
           "check_exposed_time"]


# ------------------------------------------------------------------------------------------------
# Exercise 4: the bytes a rank's all-to-alls send, for a given routing
# ------------------------------------------------------------------------------------------------


def measured_alltoall_bytes(chosen, n_experts: int, width: int, dtype: str) -> list:
    """[{"alltoall": bytes, "alltoallv": bytes}] per rank, counted by the simulated ranks' counters over one
    forward and backward of refimpl's ExpertParallel with the experts of `chosen[r]` (rank r's (N_r, K) choices)."""
    from refimpl.autograd import Tensor  # noqa: PLC0415
    from refimpl.nn.experts import MoE  # noqa: PLC0415
    from refimpl.parallel.experts import ExpertParallel  # noqa: PLC0415

    def program(comm):
        moe = MoE(d_model=width, n_experts=n_experts, top_k=1, rng=np.random.default_rng(0), dtype=dtype)
        runner = ExpertParallel(moe, comm)  # keeps experts rank·E/P ... (rank+1)·E/P − 1
        counts = np.bincount(np.asarray(chosen[comm.rank]).reshape(-1), minlength=n_experts)  # as MoE.forward sorts
        x_sorted = Tensor(np.ones((int(counts.sum()), width), dtype=dtype), requires_grad=True)
        y = runner(moe, x_sorted, counts)  # counts, dispatch, experts, combine
        y.backward(np.ones_like(y.data))  # the transposes: combine's gradients out, dispatch's back
        sent = comm.counters.snapshot()
        return {kind: int(sent.get(kind, {}).get("bytes", 0)) for kind in ("alltoall", "alltoallv")}

    return run_ranks(len(chosen), program)


def _alltoall_cases() -> list:
    """(chosen per rank, E, C, dtype): uneven routing, a rank whose tokens stay home, K choices on one rank."""
    rng = np.random.default_rng(11)
    skewed = [np.array([[0, 1], [2, 3], [1, 3]]), np.array([[0, 2], [0, 1], [2, 0], [1, 0]])]
    three = [rng.integers(0, 6, (5, 1)), np.array([[0], [1], [0]]), np.array([[5], [4], [5], [4]])]
    hot = [np.zeros((4, 1), dtype=np.int64), np.zeros((6, 1), dtype=np.int64)]  # every token to expert 0 on rank 0
    wide = [np.array([[4, 5, 6], [0, 1, 7], [2, 3, 4]]), np.array([[0, 1, 2], [5, 6, 7]])]  # K = 3, E = 8
    four = [np.stack([rng.permutation(8)[:2] for _ in range(n)]) for n in (3, 5, 2, 4)]
    return [(skewed, 4, 8, "float32"), (three, 6, 4, "float64"), (hot, 2, 3, "float32"), (wide, 8, 5, "float64"),
            (four, 8, 6, "float32")]


def _alltoall_mistakes(chosen, E: int, C: int, item: int, r: int) -> dict:
    """{description: (alltoall, alltoallv)} of the usual wrong derivations, for rank r."""
    P = len(chosen)
    home = [np.asarray(c).reshape(-1) // (E // P) for c in chosen]  # the rank of each assignment's expert
    away = int((home[r] != r).sum())  # rows rank r dispatches to other ranks
    back = sum(int((home[s] == r).sum()) for s in range(P) if s != r)  # rows it receives, and combines back
    local = int((home[r] == r).sum())
    counts_right = 8 * (E - E // P)
    rows = 2 * C * item * (away + back)
    dedup_away = sum(len(set(row.tolist()) - {r}) for row in np.asarray(chosen[r]).reshape(len(chosen[r]), -1)
                     // (E // P))
    dedup_back = sum(len({r} & set(row.tolist())) for s in range(P) if s != r
                     for row in np.asarray(chosen[s]).reshape(len(chosen[s]), -1) // (E // P))
    return {
        "the counts are int64, 8 bytes each whatever the rows' itemsize": (item * (E - E // P), rows),
        "the counts all-to-all sends E/P counts to each other rank, E − E/P in all, not all E (a rank does not "
        "send to itself)": (8 * E, rows),
        "the counts are exchanged once, in forward: the backward reuses them": (2 * counts_right, rows),
        "the combine returns the rows this rank received from the others (its back), not its own: the bytes "
        "depend on the other ranks' routing too, not only on this rank's": (counts_right, 4 * C * item * away),
        "rows bound for this rank's own experts never leave it":
            (counts_right, 2 * C * item * (away + back + 2 * local)),
        "the backward sends as much as the forward: the transposes of dispatch and combine":
            (counts_right, C * item * (away + back)),
        "each of a token's K choices travels separately, even to the same rank (no de-duplication here)":
            (counts_right, 2 * C * item * (dedup_away + dedup_back)),
        "bytes, not elements: multiply by itemsize": (counts_right, 2 * C * (away + back)),
    }


def check_alltoall_bytes(alltoall_bytes) -> None:
    """Check: the bytes of expert parallelism's all-to-alls, per rank, measured."""
    answers = []  # (case, expected, got), every case first: a mistake is named only if it explains them all
    for chosen, E, C, dtype in _alltoall_cases():
        P, item = len(chosen), np.dtype(dtype).itemsize
        expected = measured_alltoall_bytes(chosen, E, C, dtype)
        got = alltoall_bytes([np.array(c) for c in chosen], E, C, item)
        where = (f"P = {P} ranks, E = {E} experts, C = {C}, itemsize {item}, rank r's choices "
                 f"{[np.asarray(c).tolist() for c in chosen]}")
        if not isinstance(got, (list, tuple)) or len(got) != P:
            raise Wrong(f"{where}: return a list of {P} dicts, one per rank, {{'alltoall': bytes, "
                        f"'alltoallv': bytes}}; you returned {shown(got)}")
        mine = []
        for r in range(P):
            try:
                mine.append((int(got[r]["alltoall"]), int(got[r]["alltoallv"])))
            except (TypeError, KeyError, IndexError):
                raise Wrong(f"{where}: rank {r}'s entry should be a dict {{'alltoall': bytes, 'alltoallv': bytes}}; "
                            f"you returned {shown(got[r])}") from None
        answers.append(((chosen, E, C, item), where, [(e["alltoall"], e["alltoallv"]) for e in expected], mine))
    wrong = [(case, where, r, right[r], mine[r]) for case, where, right, mine in answers
             for r in range(len(right)) if mine[r] != right[r]]
    if not wrong:
        return
    (chosen, E, C, item), where, r, right, mine = wrong[0]
    mistakes = _alltoall_mistakes(chosen, E, C, item, r)
    everywhere = [why for why in mistakes if all(
        _alltoall_mistakes(*case, q)[why] == got_q[q] for case, _, _, got_q in answers for q in range(len(got_q)))]
    field = 0 if mine[0] != right[0] else 1
    here = [why for why, guess in mistakes.items() if guess[field] == mine[field] and guess[field] != right[field]]
    hint = (everywhere or here or [None])[0]
    raise Wrong(f"{where}: rank {r} sends {right[0]} bytes of counts (alltoall) and {right[1]} bytes of rows "
                f"(alltoallv) in one forward and backward, as measured; you said {mine[0]} and {mine[1]}"
                + (f": {hint}" if hint else ""))
