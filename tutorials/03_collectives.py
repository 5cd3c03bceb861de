# %% [markdown]
# # 03 · Collectives by hand: the ring
#
# **Launch:** `python tutorials/03_collectives.py` from the repository root, in the virtual
# environment (installed with the `mpi` or `test` extra, which provides `mpiexec`). Part 4 starts
# `mpiexec -n 4` itself, through `subprocess`.
#
# Data parallelism (tutorial 04) ends every step with an **all-reduce**: each of N ranks holds a
# gradient of L numbers, and every rank must end with the sum over ranks. ZeRO (tutorial 05) uses
# its two halves separately: **reduce-scatter** (rank r ends with block r of the sum) and
# **all-gather** (every rank ends with every rank's block). This tutorial builds them the way
# refimpl's `refimpl/parallel/ring.py` does, on a ring where each rank talks only to its
# neighbours, and counts the bytes.

# %%
import numpy as np
from harness import last_json, run_mpi
from harness.collectives import run_ring

from refimpl.parallel import ring

# %% [markdown] slideshow={"slide_type": "slide"}
# ## 1. Why a ring
#
# The obvious all-reduce sends everything to rank 0, which adds and sends the result back: rank 0
# receives (N − 1)·L numbers and sends (N − 1)·L, so its link is the bottleneck and the time grows
# with N. In a ring, rank r sends only to r + 1 and receives only from r − 1 (mod N). The buffer
# is cut into N blocks; block b has `L // N + (1 if b < L % N else 0)` elements, the layout of
# `numpy.array_split`:

# %%
counts = ring.block_counts(10, 4)
print("L = 10 over N = 4 ranks: block sizes", counts, "offsets", ring.block_offsets(counts))

# %% [markdown] slideshow={"slide_type": "subslide"}
# **Reduce-scatter**, N − 1 steps: in step s rank r sends its running sum of block (r − s − 1) to
# the right, receives the left neighbour's running sum of block (r − s − 2) and adds its own
# contribution. Each block travels once around the ring, collecting one contribution per rank, and
# ends at its owner. **All-gather**, N − 1 more steps: each rank forwards the block it received in
# the previous step (its own in the first), until every rank has every block. All-reduce is the
# two in sequence.
#
# ## 2. Watching it run
#
# refimpl writes each algorithm as a generator: it posts one step's messages
# (`link.exchange(send=..., recv=...)`), `yield`s, and continues when they have arrived.
# `run_ring` (in `tutorials/harness/collectives.py`) runs one such generator per rank on a ring
# simulated in this process, so we can print every message. Three ranks, three elements each:
# rank 0 holds [1, 2, 3], rank 1 ten times that, rank 2 a hundred times.

# %%
buffers = [np.array([1.0, 2.0, 3.0]) * 10**r for r in range(3)]
trace = []
sent = run_ring(ring.allreduce, buffers, np.add, trace=trace)
for step in range(1, 5):
    phase = "reduce-scatter" if step <= 2 else "all-gather"
    moves = ", ".join(f"rank {r} sends {data}" for s, r, data in trace if s == step - 1)
    print(f"step {step} ({phase}): {moves}")
for r, buf in enumerate(buffers):
    print(f"rank {r} ends with {buf}, sent {sent[r]} bytes")
assert all(np.array_equal(b, [111, 222, 333]) for b in buffers)

# %% [markdown] slideshow={"slide_type": "subslide"}
# In step 2 each rank receives a block that already carries two contributions and adds the third:
# after the reduce-scatter rank r holds the finished block r (rank 0: 111, rank 1: 222, rank 2:
# 333). The all-gather then circulates the finished blocks.
#
# ## 3. Counting bytes
#
# In the reduce-scatter rank r sends every block except its own; in the all-gather every block
# except the one its right neighbour owns. When N divides L that is 2(N − 1)/N · L elements per
# rank, **almost independent of N**: this is the bandwidth-optimal all-reduce (Patarasuk and Yuan,
# 2009), and the "2Ψ" in the ZeRO paper's communication analysis. `ring.bytes_sent` is the
# formula; the simulation measures it:

# %%
L, itemsize = 12, 8
print(" N   ring: bytes per rank (measured)   formula 2(N-1)/N*L*8   naive: rank 0 sends (N-1)*L*8")
for N in (2, 3, 4, 6):
    buffers = [np.ones(L) for _ in range(N)]
    measured = run_ring(ring.allreduce, buffers, np.add)
    formula = 2 * (N - 1) * L * itemsize // N
    assert measured == [ring.bytes_sent("allreduce", L, N, r, itemsize) for r in range(N)] == [formula] * N
    print(f"{N:2d}   {measured[0]:31d}   {formula:20d}   {(N - 1) * L * itemsize:29d}")

# %% [markdown] slideshow={"slide_type": "slide"}
# ## 4. On real processes
#
# refimpl's communicator (`refimpl/parallel/comm.py`) runs the same generators under MPI, with
# `collectives="ring"`; with `collectives="mpi"` it calls MPI's own tuned `Allreduce`. Either way
# it counts the bytes each rank sends, by the same formulas. The program below runs on 4 processes
# with L = 10 (not divisible by 4: blocks of 3, 3, 2, 2), checks the result against the sum and
# against MPI's built-in all-reduce, and reports the counters. A notebook cannot itself run under
# `mpiexec`, so `run_mpi` (from `tutorials/harness/__init__.py`) starts
# `mpiexec -n 4 python -c PROGRAM` with `subprocess`, using the `mpiexec` next to this Python.

# %%
PROGRAM = """
import json
import numpy as np
from refimpl.parallel.comm import get_world

world = get_world(collectives="ring")
L = 10
x = np.arange(L, dtype=np.float64) * 10.0**world.rank
world.allreduce(x)                                   # the ring, in place
ring_bytes = world.counters.bytes("allreduce")
y = np.arange(L, dtype=np.float64) * 10.0**world.rank
get_world(collectives="mpi").allreduce(y)            # MPI's built-in Allreduce
expected = sum(np.arange(L) * 10.0**r for r in range(world.size))
report = world.allgather_object({"rank": world.rank, "sum_ok": bool(np.array_equal(x, expected)),
                                 "same_as_mpi": bool(np.array_equal(x, y)), "bytes": ring_bytes})
if world.rank == 0:
    print(json.dumps(report))
"""
done = run_mpi(4, "-c", PROGRAM)
for row in last_json(done):
    formula = ring.bytes_sent("allreduce", 10, 4, row["rank"], 8)
    print(f"rank {row['rank']}: sum correct {row['sum_ok']}, equal to MPI's {row['same_as_mpi']}, "
          f"sent {row['bytes']} bytes (formula {formula})")
    assert row["sum_ok"] and row["bytes"] == formula

# %% [markdown] slideshow={"slide_type": "subslide"}
# The ranks send 112, 120, 128 and 120 bytes: (2L − count_r − count_{r+1}) · 8, since rank r does
# not send its own block in the reduce-scatter nor block r + 1 in the all-gather. Summed over ranks
# it is 2(N − 1)·L elements, whatever L is. In floating point the ring's sums may differ from MPI's
# in the last bit (MPI picks its own summation order); with these integer-valued inputs they are
# equal. `docs/data_parallel.md` measures the ring against MPI's tuned algorithm.
#
# **Question (measure and explain).** With random float64 inputs the ring's sums are not those of
# `x0 + x1 + … + x(N−1)`. Run `ring.allreduce` with `run_ring` on 4 ranks of 1000 random normal
# numbers each and measure (a) whether the four ranks end with the same bits, and (b) in how many
# elements, in which blocks and by how much the result differs from `((x0 + x1) + x2) + x3`.
# Explain both from the order in which the reduce-scatter adds each block's contributions (which
# block comes out bit-identical to the reference, and why?), and say what (a) and (b) mean for
# data parallelism: for the ranks' weights, and for how `verify` must compare a distributed run
# with one process.
#
# ## Exercises
#
# Write the two halves as generators with the same interface as `ring.py`'s: `link.rank`,
# `link.size`, `yield link.exchange(send=array, recv=array)` to send to the right and receive from
# the left in one step, and `link.empty(n, dtype)` for a scratch buffer. `buf` is a flat float64
# array of L elements; use `ring.block_counts(L, N)` and `ring.block_offsets(counts)` for the
# blocks. The checks run your generators on simulated rings of 1 to 5 ranks, with L divisible by N
# or not (and L < N, where some blocks are empty), and compare the results and the bytes each rank
# sent with refimpl's.
#
# **Exercise 1.** `ring_allgather(link, buf)`: on entry rank r's `buf` holds only block r (the
# rest is garbage); afterwards every block. N − 1 steps; in step s send block (r − s) mod N.
#
# **Exercise 2.** `ring_reduce_scatter(link, buf)`: on entry each rank's `buf` is its
# contribution; afterwards block r of rank r's `buf` holds the sum over ranks (other blocks may
# hold anything). Receive into a scratch buffer, then add it into your own block of `buf`.
#
# **Exercise 3.** `allreduce_bytes(length, size, rank, itemsize)`: the bytes rank `rank` sends in
# a ring all-reduce of `length` elements (zero for one rank).
#
# **Exercise 4.** `bottleneck_bytes(length, size, itemsize)`: an all-reduce ends when its busiest
# rank has sent everything. Return the most bytes that any one rank sends in a ring all-reduce of
# `length` elements over `size` ranks, as a closed form in `length // size` and `length % size`,
# without a loop over the ranks (the check asks about rings of a million ranks). Work out which
# ranks are busiest for every remainder, including L < N. The check compares with the bytes the
# simulated ring measures and with `ring.bytes_sent` over every rank.
#
# Once exercises 1 and 2 pass, your generators would run unchanged under `mpiexec`: comm.py's
# `_RingLink` has the same methods as the simulated link.

# %%
from harness import Exercises
from harness.collectives import (
    check_allreduce_bytes,
    check_bottleneck_bytes,
    check_ring_allgather,
    check_ring_reduce_scatter,
)

ex = Exercises("03_collectives")


@ex.stub
def ring_allgather(link, buf):
    raise NotImplementedError("exercise 1")


@ex.stub
def ring_reduce_scatter(link, buf):
    raise NotImplementedError("exercise 2")


@ex.stub
def allreduce_bytes(length, size, rank, itemsize):
    raise NotImplementedError("exercise 3")


@ex.stub
def bottleneck_bytes(length, size, itemsize):
    raise NotImplementedError("exercise 4")


# %%
# Your answer to this tutorial's question (measure and explain): the grader reads this string
# without running the file (tutorials/grade.py FOLDER --gradebook OUT).
ANSWER = """
(your answer)
"""

ex.check(1, check_ring_allgather, ring_allgather)
ex.check(2, check_ring_reduce_scatter, ring_reduce_scatter)
ex.check(3, check_allreduce_bytes, allreduce_bytes)
ex.check(4, check_bottleneck_bytes, bottleneck_bytes)
ex.summary();  # noqa: E703 - the `;` keeps a notebook from echoing the returned True/False
