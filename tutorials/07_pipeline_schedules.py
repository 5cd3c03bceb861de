# %% [markdown]
# # 07 · Pipeline schedules and their bubbles
#
# **Launch:** `python tutorials/07_pipeline_schedules.py` from the repository root, in the virtual
# environment (part 5 starts `mpiexec -n 4` through `subprocess`).
#
# Pipeline parallelism cuts the model into p **stages**, one per rank: rank 0 holds the first
# layers, rank p − 1 the last ones and the loss. A batch is cut into m **micro-batches**, so that
# while rank 1 works on micro-batch 0, rank 0 can already start micro-batch 1. The order in which
# each rank runs its forwards (F) and backwards (B) is the **schedule**; the time ranks spend
# waiting is the **bubble**. In refimpl a schedule is plain data (`refimpl/parallel/pipeline/`,
# `docs/pipeline_schedules.md`): one list of actions per rank, read by a validator, an exact timing
# simulator, a renderer, and the MPI executor that really trains with it.

# %%
import sys
from fractions import Fraction

from refimpl.parallel.pipeline import Costs, ScheduleError, build, simulate, validate
from refimpl.parallel.pipeline.actions import Action, linear_placement, make_schedule
from refimpl.tools.render import render_svg, render_text

# %% [markdown] slideshow={"slide_type": "slide"}
# ## 1. A schedule is a list of actions per rank
#
# GPipe (Huang et al., 2018): every rank runs all its forwards, then all its backwards.
# `F3` is the forward of micro-batch 3 at this rank's stage.

# %%
gpipe = build("gpipe", pp=4, micro_batches=4)
for rank, program in enumerate(gpipe.text(short=True)):
    print(f"rank {rank}: {program}")

# %% [markdown] slideshow={"slide_type": "slide"}
# ## 2. Simulating it
#
# The simulator runs each rank's list in order, each action as soon as its inputs are ready:
# F(s, k) needs F(s − 1, k) (the activation from the previous stage) and B(s, k) needs F(s, k)
# and B(s + 1, k) (the gradient from the next stage). With a forward costing 1 and a backward 2
# (a backward computes two products per matmul, a forward one):

# %%
costs = Costs(F=1, B=2)
timeline = simulate(gpipe, costs)
print(render_text(timeline))
print("makespan", timeline.makespan, "| idle per rank", [int(x) for x in timeline.idle],
      "| bubble fraction", timeline.bubble_fraction)

# %% [markdown] slideshow={"slide_type": "subslide"}
# Each rank idles (p − 1)(F + B) = 3 × 3 = 9 units: rank r waits r·F at the start for the first
# activation to arrive, (p − 1 − r)(F + B) between its forwards and its backwards for the first
# gradient to come back, and r·B at the end while the ranks before it finish. Every rank does
# m(F + B) of work, so the **bubble fraction** (idle over total time) is (p − 1) / (m + p − 1).
# More micro-batches amortise the bubble:

# %%
p = 4
print(" m   simulated   (p-1)/(m+p-1)")
for m in (1, 2, 4, 8, 16, 32):
    fraction = simulate(build("gpipe", p, m), costs).bubble_fraction
    assert fraction == Fraction(p - 1, m + p - 1)
    print(f"{m:2d}   {float(fraction):9.4f}   {(p - 1) / (m + p - 1):13.4f}")

# %% [markdown] slideshow={"slide_type": "slide"}
# ## 3. The price of GPipe: memory, and 1F1B
#
# A forward leaves activations behind that its backward needs. In GPipe rank 0 runs all m
# forwards before the first backward, so it holds m micro-batches' activations at once. **1F1B**
# (PipeDream-flush, Narayanan et al., 2021) runs each backward as early as possible: after a
# warm-up of p − 1 − r forwards, rank r alternates one forward, one backward. Same work, same
# dependencies, same makespan, but rank r never holds more than p − r activations:

# %%
m = 8
for name in ("gpipe", "1f1b"):
    t = simulate(build(name, p, m), costs)
    print(f"{name:6s} makespan {t.makespan}, bubble {float(t.bubble_fraction):.4f}, "
          f"peak activations per rank {t.peak_activations}")
print()
print(render_text(simulate(build("1f1b", p, m), costs)))

# %% [markdown] slideshow={"slide_type": "subslide"}
# **Interleaved 1F1B** (Megatron-LM) gives each rank v smaller stages ("chunks"): stage s runs on
# rank s mod p, so the pipeline fills v times faster and the bubble shrinks by v. Each chunk's
# action costs 1/v of a whole rank's share:

# %%
v = 2
interleaved = simulate(build("interleaved", p, m, chunks=v), Costs(F=costs.F / v, B=costs.B / v))
one_f_one_b = simulate(build("1f1b", p, m), costs)
print("idle per rank: 1f1b", one_f_one_b.idle[0], "| interleaved (v=2)", interleaved.idle[0])
assert interleaved.idle[0] * v == one_f_one_b.idle[0]

# %% [markdown] slideshow={"slide_type": "slide"}
# ## 4. What the validator catches
#
# A schedule can be wrong in ways that only show when it runs: an action missing or duplicated, a
# backward before its forward, or two ranks each waiting for the other's message. `validate`
# checks all of them, including a dry run where every send waits for its matching receive. Here
# rank 1 of a 1F1B schedule runs a backward before the forward it depends on:

# %%
good = build("1f1b", 2, 2)
ranks = [list(r) for r in good.ranks]
print("rank 1 was:", " ".join(str(a) for a in ranks[1]))
ranks[1] = [Action("B", 1, 0), Action("F", 1, 0), Action("F", 1, 1), Action("B", 1, 1)]
broken = make_schedule("broken", 2, 2, linear_placement(2), ranks)
try:
    validate(broken)
except ScheduleError as error:
    print("ScheduleError:", error)

# %% [markdown] slideshow={"slide_type": "slide"}
# ## 5. Pictures and real runs
#
# `python -m refimpl schedule NAME --pp P --micro-batches M` prints all of the above for any
# schedule; `--render svg --out FILE` draws it (the docs site's pictures are made this way). In a
# notebook the SVG shows inline:

# %%
svg = render_svg(simulate(build("1f1b", p, m), costs))
if "IPython" in sys.modules:
    from IPython.display import SVG, display

    display(SVG(svg))
print(f"an SVG of {len(svg)} characters; python -m refimpl schedule 1f1b --pp 4 --micro-batches 8 "
      "--render svg --out 1f1b.svg writes the same file")

# %% [markdown] slideshow={"slide_type": "subslide"}
# The same lists drive refimpl's pipeline executor over MPI
# (`refimpl/parallel/pipeline/executor.py`, `docs/pipeline_parallel.md`). `verify` trains a
# 4-layer GPT cut into 4 stages on 4 processes with 1F1B and compares every gradient and parameter
# with one process:

# %%
from harness import last_json, run_mpi

FLAGS = ["--model", "gpt", "--n-layer", "4", "--d-model", "16", "--seq-len", "8", "--batch-size", "8", "--steps", "2"]
result = last_json(run_mpi(4, "-m", "refimpl", "verify", *FLAGS, "--pp", "4", "--schedule", "1f1b", "--json"))
print("verify ok:", result["ok"], "| stages of each rank:", result["trainer_report"]["pipeline"]["stages_of_rank"])
assert result["ok"]

# %% [markdown] slideshow={"slide_type": "subslide"}
# verify's report reads as in tutorial 04: the JSON's `max_rel_diff` (near 1e-03 beside
# `"rtol":1e-10`) is the worst |diff| / max(|reference|, atol), large only for gradients that are
# zero up to rounding; the verdict compares every |diff| with atol + rtol·|reference|, and the
# PASS line's ratio (*tolerance used*) is far below the 1 it may reach.
#
# **Question (measure and explain).** Interleaving divides the idle time by v (part 3): what does
# it cost? Measure the peak activations per rank of 1F1B and of interleaved 1F1B with v = 2 and
# v = 4 at p = 4, m = 8 (`simulate(...).peak_activations`; a chunk's activations are 1/v of a
# stage's). Convert them to whole stages' activations and compare with 1F1B's. Explain the peak of
# rank r from the warm-up the schedule needs, as a formula in p, v and r, and check it for other p.
# What happens at m = p? Name one more cost of interleaving that the simulator's timing ignores.
#
# ## Exercises
#
# Write schedules as one list of strings per rank in the short form: `"F3"` is the forward of
# micro-batch 3 at that rank's stage (stage r on rank r), `"B3"` its backward. The checks build a
# `Schedule` from your lists, validate it, simulate it with several costs and compare idle time
# and peak activations with refimpl's generators, for several (pp, m).
#
# **Exercise 1.** `gpipe(pp, m)`: all forwards in micro-batch order, then all backwards.
#
# **Exercise 2.** `one_f_one_b(pp, m)`: rank r runs `min(pp - r - 1, m)` warm-up forwards, then
# alternates a forward and a backward while forwards remain, then the remaining backwards. Its
# peak activations must be `min(pp - r, m)`.
#
# **Exercise 3.** `bubble_fraction(pp, m)`: 1F1B's bubble fraction, as a number. The check compares
# it with the simulator for pp up to 6 and m up to 12.
#
# **Exercise 4.** `interleaved_bubble(pp, m, v)`: the bubble fraction of interleaved 1F1B with v
# chunks per rank, each chunk's forward and backward costing 1/v of a whole rank's (as in part 3).
# Part 3 shows only how the idle time changes; derive the fraction from it. The check compares
# with the simulator for pp from 2 to 5, m = pp, 2pp and 3pp (refimpl's interleaved schedule needs
# m to be a multiple of pp), v from 2 to 4, at two ratios B/F.

# %%
from harness import Exercises
from harness.schedules import check_bubble_fraction, check_gpipe, check_interleaved_bubble, check_one_f_one_b

ex = Exercises("07_pipeline_schedules")


@ex.stub
def gpipe(pp, m):
    raise NotImplementedError("exercise 1")


@ex.stub
def one_f_one_b(pp, m):
    raise NotImplementedError("exercise 2")


@ex.stub
def bubble_fraction(pp, m):
    raise NotImplementedError("exercise 3")


@ex.stub
def interleaved_bubble(pp, m, v):
    raise NotImplementedError("exercise 4")


# %%
# Your answer to this tutorial's question (measure and explain): the grader reads this string
# without running the file (tutorials/grade.py FOLDER --gradebook OUT).
ANSWER = """
(your answer)
"""

ex.check(1, check_gpipe, gpipe)
ex.check(2, check_one_f_one_b, one_f_one_b)
ex.check(3, check_bubble_fraction, bubble_fraction)
ex.check(4, check_interleaved_bubble, interleaved_bubble)
ex.summary();  # noqa: E703 - the `;` keeps a notebook from echoing the returned True/False
