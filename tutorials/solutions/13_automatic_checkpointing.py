"""Reference solutions to tutorial 13's exercises (REFIMPL_TUTORIAL_SOLUTIONS=1 selects them)."""

import math

from refimpl.checkpointing.auto import inner_articulation_points


def articulation_points_of(n, edges):
    # Keep the vertices on some 0 -> n-1 path; with values numbered topologically, v is a cut
    # exactly when no relevant edge (u, w) jumps over it (u < v < w).
    forward = {0}
    for u, w in sorted(edges, key=lambda e: e[1]):
        if u in forward:
            forward.add(w)
    backward = {n - 1}
    for u, w in sorted(edges, key=lambda e: -e[0]):
        if w in backward:
            backward.add(u)
    relevant = forward & backward
    reach, cuts = 0, []
    for v in sorted(relevant):
        if reach <= v:
            cuts.append(v)
        reach = max([reach] + [w for u, w in edges if u == v and w in relevant] + ([n] if v == n - 1 else []))
    return cuts


def my_rule(graph):
    # About √m of the m inner articulation points, evenly spaced by count (auto:memory spaces them
    # by bytes; in these networks every tensor has the same size).
    cuts = inner_articulation_points(graph)
    if not cuts:
        return []
    k = math.isqrt(len(cuts) - 1) + 1
    return [cuts[min(len(cuts) - 1, round(j * len(cuts) / (k + 1)))] for j in range(1, k + 1)]


def speed_checkpoints(graph):
    return [w for node in graph.nodes if node.in_graph and node.op in ("MatMul", "LinearFunction")
            for w in node.outputs]


def memory_checkpoints(graph):
    cuts = inner_articulation_points(graph)
    if not cuts:
        return []
    k = math.isqrt(len(cuts) - 1) + 1
    total = sum(graph.values[v].nbytes for v in cuts)
    chosen, held = [], []
    running = 0
    for v in cuts:
        running += graph.values[v].nbytes
        held.append(running)
    for j in range(1, k + 1):
        pick = next((v for v, h in zip(cuts, held) if h >= j * total / (k + 1)), cuts[-1])
        if pick not in chosen:
            chosen.append(pick)
    return chosen


ANSWER = """
Model answer to the question (measure and explain).

(a) Measured (second step, float64, batch 4): with dropout 0.1, auto:memory peaks at 1,305,088
bytes for 140 extra operation forwards and sqrt at 1,273,344 for 121; with dropout 0, 698,880
and 962,048 bytes (122 and 106 extra forwards). Dropout adds 606,208 bytes to auto:memory's
peak and 311,296 to sqrt's. A block draws three masks: attention's (B·H·T² = 4·4·16·16 numbers)
and two of (B, T, C) = 4·16·32, together 8,192 float64 numbers, 65,536 bytes. auto:memory
recomputes by running the recorded operations again, and a mask is drawn outside any operation
(the Dropout module passes it to DropoutFunction as a constant), so the trace keeps every block's
masks for the whole step: 8 × 65,536 = 524,288 bytes, most of the 606,208 (the rest: the dropout
operations' own saved arrays in the segment being recomputed when the peak is reached). sqrt
recomputes by calling the blocks again with their generators' state replayed, so a mask exists
only while its block is recorded: the last segment (3 blocks) in the forward pass, one segment at
a time in backward, 311,296 bytes at the peak. So without dropout auto:memory wins clearly (0.29
of the plain peak against 0.40: it keeps 4 residual sums and only about 2 blocks recorded, where
sqrt keeps the last 3 blocks recorded), and with dropout the masks it keeps cost it the lead
(0.41 against 0.40).

(b) In the chain, each layer is Linear then tanh: Linear saves its input x, tanh saves its output.
The articulation points alternate: Linear outputs z and tanh outputs a (= the next Linear's x).
[1::2] picks every tanh output: then every tensor a backward reads (each a, as tanh's output and
as the next Linear's input) is a checkpoint, stored anyway; nothing saved is a recomputed tensor,
so nothing is recomputed and the peak is the plain run's. Checkpoints help only where they let
the tensors between them be forgotten.
"""
