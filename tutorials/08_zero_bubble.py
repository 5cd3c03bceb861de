# %% [markdown]
# # 08 · Zero bubble and DualPipe
#
# **Launch:** `python tutorials/08_zero_bubble.py` from the repository root, in the virtual
# environment (part 5 starts `mpiexec -n 4` through `subprocess`).
#
# Tutorial 07 ended with 1F1B's bubble, (p − 1)(F + B) per rank. Two ideas shrink it further:
#
# - **Split the backward** (Qi et al., *Zero Bubble Pipeline Parallelism*, arXiv 2401.10241). A
#   stage's backward is I, the gradient for its input, which the previous stage waits for, plus W,
#   the gradient for its weights, which nobody waits for (tutorial 01, part 3). Run I at once and
#   W later, in what would have been idle time.
# - **Feed the pipeline from both ends** (DeepSeek-V3's DualPipe, arXiv 2412.19437). Each rank
#   holds two stages, one of each of two pipelines running in opposite directions, and runs a
#   forward of one together with a backward of the other (F&B), so that one's communication hides
#   behind the other's computation.
#
# Throughout, costs are per rank's share of the model with the backward split evenly:
# F = I = W = 1, so B = I + W = 2 and F&B = F + B = 3.

# %%
import subprocess
import sys

from refimpl.parallel.pipeline import Costs, build, closed_form, simulate
from refimpl.tools.render import render_text

p, m = 4, 8
costs = Costs(F=1, I=1, W=1)


def show(name, chunk_costs=costs):
    timeline = simulate(build(name, p, m), chunk_costs)
    print(render_text(timeline))
    print(f"{name}: makespan {timeline.makespan}, idle per rank {[str(x) for x in timeline.idle]}, "
          f"steady-state idle {[str(x) for x in timeline.steady_state_idle]}, "
          f"peak activations {timeline.peak_activations}\n")
    return timeline


# %% [markdown] slideshow={"slide_type": "slide"}
# ## 1. ZB-H1: 1F1B with deferred W
#
# ZB-H1 keeps 1F1B's order of forwards and input-gradient passes, but rank r holds back its
# weight-gradient passes: it starts issuing W's only after r steady-state iterations and runs the
# r + 1 it still owes at the very end. Input gradients therefore race down the pipeline without
# waiting for weight work, and the deferred W's fill the tail that 1F1B leaves idle.

# %%
one_f_one_b = show("1f1b")
zb1p = show("zb1p")
assert zb1p.idle[0] == (p - 1) * (costs.F + costs.I - costs.W) == 3 and one_f_one_b.idle[0] == 9

# %% [markdown] slideshow={"slide_type": "subslide"}
# Idle per rank drops from (p − 1)(F + B) = 9 to (p − 1)(F + I − W) = (p − 1)(F + B − 2W) = 3. The
# price is memory: an activation is needed until its W, so every rank now holds p micro-batches'
# activations, where 1F1B's rank r held p − r.
#
# ## 2. ZB-H2 and ZB-V: no bubble in steady state
#
# ZB-H2 runs more warm-up forwards (p − 1 more on rank 0), so that no rank ever waits in the
# middle; within one iteration the last rank still cannot start before (p − 1)F, but when
# iterations run back to back without a global synchronisation between them ("steady state",
# the zero-bubble paper's post-update validation), the idle per iteration is zero. ZB-V cuts the
# model into 2p stages in a V: rank r holds stage r and stage 2p − 1 − r, so the last rank turns
# the pipeline around without a message and rank 0 holds both the first stage and the loss. Its
# actions are half as large (each costs 1/2).

# %%
zbh2 = show("zbh2")
half = Costs(F=costs.F / 2, I=costs.I / 2, W=costs.W / 2)
zbv = show("zbv", half)
assert all(x == 0 for x in zbh2.steady_state_idle + zbv.steady_state_idle)

# %% [markdown] slideshow={"slide_type": "slide"}
# ## 3. DualPipe and DualPipeV
#
# In DualPipe each of the p ranks holds two stages: stage r of pipeline 0 (micro-batches enter at
# rank 0) and stage p − 1 − r of pipeline 1 (they enter at rank p − 1). Both halves of the batch
# flow at once, one in each direction. In the text picture lower case is direction 1, and `F&B` is
# an overlapped pair. The cost is two copies of the parameters per rank; the bubble is
# (PP/2 − 1)(F&B + B − 3W). DualPipeV cuts DualPipe in half: 2p stages in a V on p ranks, no
# copies.

# %%
dualpipe = show("dualpipe")
print("closed form:", closed_form(build("dualpipe", p, m), costs).formula, "=",
      closed_form(build("dualpipe", p, m), costs).idle)
print("parameters per rank, in units of 1/p of the model:",
      [build("dualpipe", p, m).parameter_share(r) for r in range(p)])

# %% [markdown] slideshow={"slide_type": "slide"}
# ## 4. Side by side, and where the formulas stop being exact
#
# The `schedule` command compares every schedule on one table (costs per rank's share of the
# model, scaled for schedules with more stages than ranks):

# %%
print(subprocess.run([sys.executable, "-m", "refimpl", "schedule", "--compare", "--pp", str(p),
                      "--micro-batches", str(m), "--costs", "F=1,I=1,W=1"],
                     capture_output=True, text=True, check=True).stdout)

# %% [markdown] slideshow={"slide_type": "subslide"}
# The published closed forms assume balanced costs. The simulator is exact arithmetic, so it
# shows where they stop holding. DualPipe on 8 ranks with 20 micro-batches:

# %%
for F_, I_, W_ in [(1, 1, 1), (2, 1, 1), (1, 2, 1)]:
    c = Costs(F=F_, I=I_, W=W_)
    schedule = build("dualpipe", 8, 20)
    simulated = simulate(schedule, c, steady_state=False).idle
    print(f"F={F_} I={I_} W={W_}: simulated idle per rank {sorted(set(str(x) for x in simulated))}, "
          f"formula {closed_form(schedule, c).idle}")

# %% [markdown] slideshow={"slide_type": "subslide"}
# With an expensive forward the ranks idle more than the formula says; with an expensive input
# gradient, less. `docs/pipeline_schedules.md` lists these cases and the tests pin them.
#
# ## 5. On real processes
#
# The executor runs these schedules over MPI, I and W included (the engine's
# `backward(defer_weight_grads=True)` of tutorial 01), and DualPipe's two parameter copies have
# their gradients summed before the optimizer step. `verify` compares the result with one process:

# %%
from harness import last_json, run_mpi

FLAGS = ["--model", "gpt", "--n-layer", "4", "--d-model", "16", "--seq-len", "8", "--batch-size", "8", "--steps", "2"]
result = last_json(run_mpi(4, "-m", "refimpl", "verify", *FLAGS, "--pp", "4", "--schedule", "dualpipe",
                           "--micro-batches", "8", "--json"))
print("verify ok:", result["ok"], "| stages of each rank:", result["trainer_report"]["pipeline"]["stages_of_rank"])
assert result["ok"]

# %% [markdown] slideshow={"slide_type": "subslide"}
# verify's report reads as in tutorial 04: the JSON's `max_rel_diff` (near 1e-03 beside
# `"rtol":1e-10`) is the worst |diff| / max(|reference|, atol), large only for gradients that are
# zero up to rounding; the verdict compares every |diff| with atol + rtol·|reference|, and the
# PASS line's ratio (*tolerance used*) is far below the 1 it may reach.
#
# **Question (measure and explain).** Part 2 shows ZB-H2 with no steady-state bubble at F = I = W.
# Measure ZB-H1's and ZB-H2's idle per rank, and ZB-H2's `steady_state_idle`, at p = 4, m = 8 for
# (F, I, W) = (1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (3, 1, 1), and check a few at p = 3 and
# 6. Find ZB-H2's steady-state idle as a formula in p, F, I and W, and explain it from the
# schedule's programs (`build("zbh2", 4, 8).text(short=True)`), as part 1 explains ZB-H1's. What
# does ZB-H2 pay for it?
#
# ## Exercises
#
# **Exercise 1.** `zb1p_idle(pp, F, I, W)`: the idle time per rank of ZB-H1 (when m ≥ pp,
# W ≤ F and W ≤ I). The check compares with the simulator.
#
# **Exercise 2.** `peak_activations(program, free_at)`: given one rank's actions in order, as
# strings such as `"F3s2"`, `"B0s5"`, `"I1s0"`, `"W1s0"` (kind, micro-batch, `s` stage), return the
# largest number of activations held at once. A forward allocates one; a full backward B frees
# one; with a split backward the activation is freed at `"I"` or at `"W"`, as `free_at` says. The
# check runs it on every rank of six schedules.
#
# **Exercise 3.** `zb_h1(pp, m)`: write ZB-H1 as one list of `"F3"`, `"I3"`, `"W3"` strings per rank
# (stage r on rank r). Start from your 1F1B of tutorial 07 with each B replaced by I; then let
# rank r emit W(j) for j = 0, 1, ... right after each I of micro-batch k ≥ r, and the remaining
# W's at the end. The check validates it and compares idle time (at three cost settings) and peak
# activations with refimpl's `zb1p`.
#
# **Exercise 4.** `zb1p_idle_any(pp, F, I, W)`: ZB-H1's idle time per rank for *any* positive
# costs (m ≥ pp). Exercise 1's formula assumes W ≤ F and W ≤ I; with W > F + I it even goes
# negative. Measure with `simulate(build("zb1p", pp, 2 * pp), Costs(F=..., I=..., W=...))` at costs
# where W is longer than F, than I, or than both, find the pattern, and explain it to yourself from
# the gap a deferred W fills. The check compares with the simulator at fourteen cost settings.

# %%
from harness import Exercises
from harness.schedules import check_peak_activations, check_zb1p_idle, check_zb1p_idle_any, check_zb_h1

ex = Exercises("08_zero_bubble")


@ex.stub
def zb1p_idle(pp, F, I, W):  # noqa: E741 - the paper's names
    raise NotImplementedError("exercise 1")


@ex.stub
def peak_activations(program, free_at):
    raise NotImplementedError("exercise 2")


@ex.stub
def zb_h1(pp, m):
    raise NotImplementedError("exercise 3")


@ex.stub
def zb1p_idle_any(pp, F, I, W):  # noqa: E741 - the paper's names
    raise NotImplementedError("exercise 4")


# %%
# Your answer to this tutorial's question (measure and explain): the grader reads this string
# without running the file (tutorials/grade.py FOLDER --gradebook OUT).
ANSWER = """
(your answer)
"""

ex.check(1, check_zb1p_idle, zb1p_idle)
ex.check(2, check_peak_activations, peak_activations)
ex.check(3, check_zb_h1, zb_h1)
ex.check(4, check_zb1p_idle_any, zb1p_idle_any)
ex.summary();  # noqa: E703 - the `;` keeps a notebook from echoing the returned True/False
