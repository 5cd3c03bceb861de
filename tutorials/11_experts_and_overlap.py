# %% [markdown]
# # 11 · Mixture of experts, expert parallelism and DualPipe's overlap
#
# **Launch:** `python tutorials/11_experts_and_overlap.py` from the repository root, in the
# virtual environment with `mpiexec` (the `mpi` or `test` extra). Part 5 starts `mpiexec -n 4`
# through `subprocess`; parts 1 to 4 run inside this process, part 3 on simulated ranks.
#
# A dense transformer block runs every token through one MLP. A **mixture-of-experts** (MoE) block
# has E MLPs, the *experts*, and a small *router* that sends each token to K of them (GShard,
# Lepikhin et al., arXiv 2006.16668; Switch Transformer, Fedus et al., arXiv 2101.03961): E times
# the MLP parameters for about K MLPs of arithmetic per token. **Expert parallelism** puts
# different experts on different ranks and moves every token to its experts and back by two
# all-to-alls, inside every forward and every backward. **DualPipe** (DeepSeek-V3, arXiv
# 2412.19437) hides those all-to-alls behind computation: it runs one micro-batch's forward and
# another's backward together and switches between them at the all-to-alls. refimpl's versions
# are `refimpl/nn/experts.py` (the layer), `refimpl/parallel/experts.py` (expert parallelism) and
# `refimpl/parallel/pipeline/overlap.py` (the overlap); the reference is `docs/experts.md`. This
# tutorial shows
#
# 1. the router, top-K with ties to the lower index, renormalised gates, the balance loss per sequence;
# 2. dispatch and combine as a sort and its inverse permutation;
# 3. the all-to-alls of expert parallelism on simulated ranks, and their bytes, exactly;
# 4. the overlapped F&B step: two tasks, one running at a time, switching after each all-to-all starts;
# 5. `verify` on 4 processes (DualPipe, experts over 2 ranks), and overlap on against off, bit for bit.
#
# Legend for shapes: B sequences, T tokens per sequence, C width, N = B·T tokens, E experts, K experts
# per token, P expert-parallel ranks.

# %%
import numpy as np
from harness import last_json, run_mpi
from harness.experts import moe_backward, moe_forward, run_ranks

from refimpl.autograd import Tensor, grad_mode
from refimpl.nn import functional as F
from refimpl.nn.experts import MoE, route
from refimpl.parallel.comm import LocalComm
from refimpl.parallel.experts import ExpertParallel
from refimpl.parallel.pipeline.overlap import Interleaver

np.set_printoptions(precision=3, suppress=True)

# %% [markdown] slideshow={"slide_type": "slide"}
# ## 1. The router and top-K
#
# For a token x (C,) the router is a linear layer without bias, W_r (E, C), and a softmax:
#
#     p       = softmax(x W_rᵀ)                  (E,)   router probabilities
#     chosen  = the K largest p_e                        ties go to the lower expert index
#     gate_e  = p_e / Σ_(e' chosen) p_e'          (K,)   renormalised over the chosen experts
#     y       = Σ_(e chosen) gate_e · MLP_e(x)    (C,)
#
# Ties are rare with a trained router but certain with a zero one (every p_e = 1/E); with one
# fixed rule every implementation, and every rank of a distributed run, routes them alike. Six
# tokens, E = 4, K = 2; token 1 ties experts 0 and 2, token 3 ties all four, token 5 ties
# experts 1 and 2 for second place. `route` is refimpl's (it returns the chosen experts, and the
# sort of part 2):

# %%
E, K = 4, 2
p_given = np.array([[0.10, 0.50, 0.30, 0.10],
                    [0.40, 0.10, 0.40, 0.10],
                    [0.20, 0.60, 0.10, 0.10],
                    [0.25, 0.25, 0.25, 0.25],
                    [0.05, 0.15, 0.30, 0.50],
                    [0.10, 0.20, 0.20, 0.50]])
logits = np.log(p_given)  # (N, E): as if x W_rᵀ; equal logits give exactly equal probabilities
probs = F.softmax(Tensor(logits), axis=-1).data  # (N, E)
chosen, order, counts = route(probs, K)  # chosen (N, K)
gates = np.take_along_axis(probs, chosen, axis=1)  # (N, K): p of the chosen experts
gates = gates / gates.sum(axis=1, keepdims=True)  # renormalised
for t in range(len(probs)):
    print(f"token {t}: p = {probs[t]}  chosen {chosen[t].tolist()}  gates {gates[t]}")

# %% [markdown] slideshow={"slide_type": "subslide"}
# Renormalising is Mixtral's recipe (Jiang et al., arXiv 2401.04088: a softmax over the chosen
# logits only, the same numbers). It has a consequence at K = 1: the gate is p_e / p_e = 1 whatever
# the router says, so the task's loss gives the router no gradient, and it learns only from the
# balance loss (Switch Transformer keeps gate = p_e at K = 1 for that reason).
#
# **The balance loss, per sequence.** Nothing makes a router spread its tokens; left alone it sends
# most to a few experts, which get most of the training and win even more tokens. Switch
# Transformer's loss (its eq. 4) is α · E · Σ_e f_e · P_e, with f_e the fraction of the assignments
# that chose expert e (no gradient: a discrete choice) and P_e the mean router probability of e
# (the gradient goes through it, lowering the probability of the busy experts). refimpl computes it
# **per sequence** (as DeepSeek-V3's sequence-wise loss) and averages over the global batch:
#
#     L_aux = α · (1/B) · Σ_sequences E · Σ_e f_e · P_e,   f_e = (assignments of the sequence to e) / (K·T)
#
# Read the six tokens as B = 2 sequences of T = 3:

# %%
Bs, T = 2, 3
alpha = 0.01
terms = []
for s in range(Bs):
    rows = slice(s * T, (s + 1) * T)
    f = np.bincount(chosen[rows].ravel(), minlength=E) / (K * T)  # (E,) fractions of the sequence's assignments
    P = probs[rows].mean(axis=0)  # (E,) mean probabilities
    terms.append(E * np.sum(f * P))
    print(f"sequence {s}: f = {f}, P = {P}, E·Σ f·P = {terms[-1]:.6f}")
moe = MoE(d_model=8, n_experts=E, top_k=K, rng=np.random.default_rng(0), aux_coef=alpha)
refimpl_aux = moe.balance_loss(Tensor(probs), chosen, Bs, T).item()
print(f"L_aux = α/B · Σ = {alpha / Bs * sum(terms):.9f}; refimpl's MoE.balance_loss: {refimpl_aux:.9f}")
uniform, collapsed = np.full(E, 1 / E), np.eye(E)[0]
print(f"for comparison: E·Σ f·P = {E * np.sum(uniform * uniform):.3f} when routing and probabilities are uniform, "
      f"{E * np.sum(collapsed * collapsed):.3f} when everything goes to one expert (K = 1)")

# %% [markdown] slideshow={"slide_type": "subslide"}
# Per sequence, because a sequence's f and P depend on that sequence alone: however the global
# batch is cut into ranks, micro-batches and pipeline stages, every piece computes its own
# sequences' terms, and the sum is one process's loss with no communication. A loss over the whole
# batch would need 2E numbers summed over the data-parallel group before any backward could start,
# which a pipeline cannot wait for.
#
# The loss is made deep inside the model but belongs in the objective. Rather than hand it up
# through every module, stage and schedule, the layer returns `AddAuxiliaryLoss.apply(y, L_aux)`:
# forward is y itself; backward passes y's gradient through and **seeds** L_aux's own backward
# with 1, the way the engine seeds the loss. So every backward that reaches the layer adds
# ∂L_aux/∂W_r to the router's gradient, with pipelines, accumulation and recomputation unchanged;
# the training loss printed is the cross-entropy alone.
#
# ## 2. Dispatch and combine: a sort and its inverse
#
# Running each expert on "its" tokens means regrouping the N·K (token, choice) **assignments**,
# numbered a = token·K + choice, by expert. refimpl's layer sorts them by expert (`order`: the
# assignment at each row of the sorted input, token order within an expert), gathers the tokens
# in that order, `tokens[order // K]`, so that expert 0's rows come first, then expert 1's
# (`counts` rows each), runs each expert on its block, and then puts the outputs back where each
# (token, choice) belongs, weights them by the gates and sums over K. For the six tokens above:

# %%
print(f"assignments a = token·K + choice, their experts: {chosen.reshape(-1).tolist()}")
print(f"order (route's):  {order.tolist()}   counts: {counts.tolist()}")
print(f"token of each sorted row: {(order // K).tolist()}")
print(f"expert of each sorted row: {chosen.reshape(-1)[order].tolist()}")
y_sorted = 100 * chosen.reshape(-1)[order] + order // K  # (N·K,) stand-in outputs: 100·expert + token
y_back = np.empty(len(order), dtype=np.int64)
for i, a in enumerate(order):  # the combine, as a scatter: row i's output goes back to assignment order[i]
    y_back[a] = y_sorted[i]
print(f"back in (token, choice) order, 100·expert + token:\n{y_back.reshape(-1, K)}")

# %% [markdown] slideshow={"slide_type": "subslide"}
# The loop is a scatter. The layer does it as one gather instead, `y_sorted[inverse]` (N, K, C),
# with an index array `inverse` (N, K) that says, for each (token, choice), which sorted row to read
# back: exercise 1 asks for it, with `order` and `counts`. Every step is an
# ordinary differentiable operation (a gather, slices, the experts, a gather, a product and a sum),
# so backward needs nothing special. The routing itself is a discrete choice made on the host.
#
# Does all this bookkeeping compute the textbook definition? refimpl's `MoE` layer against a loop
# over tokens and their chosen experts, C = 8, E = 4, K = 2, B = 2 sequences of T = 5:

# %%
C = 8
moe = MoE(d_model=C, n_experts=E, top_k=K, rng=np.random.default_rng(1))
x = np.random.default_rng(2).standard_normal((2, 5, C))  # (B, T, C)
y = moe(Tensor(x)).data.reshape(-1, C)  # (N, C): the layer (sort, experts on blocks, inverse, gates)

loop = np.zeros_like(y)
for t, token in enumerate(x.reshape(-1, C)):
    p = F.softmax(moe.router(Tensor(token[None])), axis=-1).data[0]  # (E,)
    top = sorted(range(E), key=lambda e: (-p[e], e))[:K]  # the K largest, ties to the lower index
    for e in top:
        loop[t] += p[e] / p[top].sum() * moe.experts[e](Tensor(token[None])).data[0]
stats = moe.take_stats()
print(f"|layer - loop| = {np.abs(y - loop).max():.1e}; assignments per expert {stats['counts'].tolist()} "
      f"(N·K = {len(y) * K}); balance loss {stats['aux_loss']:.6f}")

# %% [markdown] slideshow={"slide_type": "subslide"}
# One more rule: every expert runs, one that got no token on a (0, C) input, so its parameters get
# a (zero) gradient in every backward, on every rank. Data parallelism's buckets and ZeRO's flat
# groups start a reduction when all their gradients have arrived; an expert used on one rank and not
# on another would make the ranks start their reductions in different orders.
#
# **Capacity** (`--capacity-factor c`, off by default): each expert takes at most ⌈c·K·T/E⌉
# assignments of each sequence, queued in token order; the rest are dropped (the token keeps its
# other experts' outputs, gates not renormalised again). Per sequence again, so a distributed run
# drops exactly what one process drops.
#
# ## 3. Expert parallelism: all-to-all
#
# With `--ep P`, rank j of an expert-parallel group (P data-parallel ranks, each with its own
# micro-batches) holds experts j·E/P … (j+1)·E/P − 1. Since the layer sorted its assignments by
# expert, the rows bound for rank j are one contiguous block, and an **all-to-all** moves them:
# `alltoallv(sendbuf, sendcounts, recvbuf, recvcounts)` sends block j of sendbuf (sendcounts[j]
# elements) to rank j and receives rank i's block into block i of recvbuf; `alltoall(sendbuf,
# recvbuf)` is the case of equal blocks, and `ialltoallv` the non-blocking form, which returns a
# request with `test()` and `wait()`. An all-to-all(v) needs the receive counts before the data
# arrive, so they are exchanged first.
#
# *Simulated ranks.* `run_ranks(P, program)` runs `program(comm)` on P ranks, threads of this
# process, as in tutorial 10; here `comm` also has refimpl's all-to-alls, counted as MPI's built-ins
# are: every block but the rank's own (`harness/experts.py`). Three ranks, rank r sending r + j + 1
# copies of r to rank j:

# %%
def exchange_demo(comm):
    r, n = comm.rank, comm.size
    sendcounts = np.array([r + j + 1 for j in range(n)])  # to each rank j
    recvcounts = np.empty(n, dtype=np.int64)
    comm.alltoall(sendcounts.copy(), recvcounts)  # 1. the counts: entry j to rank j
    sendbuf = np.full(sendcounts.sum(), float(r))
    recvbuf = np.empty(recvcounts.sum())
    request = comm.ialltoallv(sendbuf, sendcounts, recvbuf, recvcounts)  # 2. the rows, non-blocking
    request.wait()
    return recvcounts, recvbuf, comm.counters.snapshot()


for r, (recvcounts, recvbuf, sent) in enumerate(run_ranks(3, exchange_demo)):
    print(f"rank {r} received counts {recvcounts.tolist()}: {recvbuf.astype(int).tolist()}; bytes sent "
          f"{ {kind: c['bytes'] for kind, c in sent.items()} }")

# %% [markdown] slideshow={"slide_type": "subslide"}
# `ExpertParallel` (refimpl/parallel/experts.py) replaces the layer's "run each expert on its block"
# with four steps: **counts** (an all-to-all of the E counts, E/P to each rank), **dispatch** (an
# all-to-all(v) of the rows: rank j receives, from every source, its rows for j's experts), the
# **experts** (rows reordered from (source, expert) to (expert, source) order, each local expert on
# its rows, and back), **combine** (an all-to-all(v) back: every row returns to the rank and
# position it came from). The two exchanges are `AllToAll` autograd Functions: the backward of a
# dispatch is a combine of the gradients and vice versa.
#
# refimpl's layer with its experts split over P = 2 simulated ranks, each rank with its own 2
# sequences, against one process holding all 4 experts and all 4 sequences:

# %%
C, E, K, P = 8, 4, 2, 2
rng = np.random.default_rng(3)
xs = [rng.standard_normal((2, 5, C)) for _ in range(P)]  # (B, T, C): rank r's own sequences
dys = [rng.standard_normal((2, 5, C)) for _ in range(P)]  # dL/dy for them

whole = MoE(d_model=C, n_experts=E, top_k=K, rng=np.random.default_rng(4))  # one process, the same seed
y_whole = whole(Tensor(np.concatenate(xs), requires_grad=True))  # (2B, T, C)
y_whole.backward(np.concatenate(dys))


def expert_parallel(comm):
    moe = MoE(d_model=C, n_experts=E, top_k=K, rng=np.random.default_rng(4))  # every rank builds all from the seed
    runner = ExpertParallel(moe, comm)  # ... and keeps experts rank·E/P ... (rank+1)·E/P − 1
    moe.experts_runner = runner
    y = moe(Tensor(xs[comm.rank], requires_grad=True))  # its input comes from attention: it needs a gradient
    y.backward(dys[comm.rank])
    kept = range(runner.first, runner.first + runner.per_rank)  # the experts this rank holds
    grads = {e: [p.grad for p in moe.experts[e].parameters()] for e in kept}
    return y.data, grads, runner.traffic[0], comm.counters.snapshot()


itemsize, remote = 8, 0
results = run_ranks(P, expert_parallel)
for r, (y_r, grads, (send, recv, _), sent) in enumerate(results):
    worst = max(np.abs(g - w.grad).max() for e, gs in grads.items()
                for g, w in zip(gs, whole.experts[e].parameters()))
    print(f"rank {r} holds experts {sorted(grads)}: |y - one process| "
          f"{np.abs(y_r - y_whole.data[2 * r:2 * r + 2]).max():.1e}, its experts' gradients {worst:.1e}")
    away = int(send.sum() - send[r])  # rows to the other rank (assignments to its experts)
    back = int(recv.sum() - recv[r])  # rows from the other rank, which the combine returns
    remote += away
    formula = {"alltoall": itemsize * (E - E // P), "alltoallv": 2 * itemsize * C * (away + back)}
    print(f"  rows to each rank {send.tolist()}, from each rank {recv.tolist()}; bytes sent "
          f"{ {kind: sent[kind]['bytes'] for kind in formula} }, the formula {formula}")
    assert all(sent[kind]["bytes"] == formula[kind] for kind in formula)
total = sum(sent["alltoallv"]["bytes"] for *_, sent in results)
print(f"both ranks' all-to-all(v) bytes: {total} = 4 · C · {itemsize} · {remote} remote assignments = "
      f"{4 * C * itemsize * remote}")

# %% [markdown] slideshow={"slide_type": "subslide"}
# The differences are exactly zero: each expert sees its rows source by source, and in token order
# within a source, which is the order of one process's concatenated batch, so it computes the very
# same sums. Each expert's gradient on its rank covers both ranks' rows (they were dispatched to
# it), so it equals one process's; in a real run it is summed only over the ranks that hold the same expert
# (`edp_comm`), every other gradient over the whole data-parallel group. The bytes: each
# (token, chosen expert) assignment whose expert lives on another rank crosses the network **four
# times**, C elements each (dispatch and combine forward, their transposes backward), and a token's
# K choices travel separately; assignments to the rank's own experts never leave it. With balanced
# routing a rank sends 4·N·K·C·(P − 1)/P elements per MoE layer and micro-batch, and it is traffic
# from every rank to every other rank of the group, inside the critical path of forward and of
# backward. That is what DualPipe hides.
#
# ## 4. DualPipe's overlap: F&B interleaved at the all-to-alls
#
# In DualPipe (tutorial 08) a rank's steady state runs **F&B** steps: the forward of one
# micro-batch together with the backward of another. DeepSeek-V3 cuts each into chunks --
# attention, dispatch, experts, combine -- and arranges them so that while one chunk's all-to-all
# travels, the other chunk computes. refimpl's executor does the same for the F&B steps of
# `dualpipe` and `dualpipev` with `overlap.Interleaver`: the F and the B run as two cooperative
# threads of which **exactly one runs at any time**. Every all-to-all is non-blocking (`exchange`
# in refimpl/parallel/experts.py starts `ialltoallv` through the runner's `all_to_all` hook, which
# the trainer points at its executor's), and right after starting one a task calls `pause()`: the
# other task resumes where it paused and computes while the rows travel, until it starts its own
# all-to-all and pauses in turn, or finishes.
#
# Here is the real thing, in one process: refimpl's layer with `ExpertParallel` over a group of one
# (`LocalComm`: the all-to-alls are copies, but they are started, paused at and waited for exactly
# as on P ranks). F is micro-batch a's forward, B the backward of micro-batch b, whose forward ran
# earlier. Hooks and a communicator that logs each all-to-all it starts show who runs when (B is the
# task running without recording operations, as the engine's backward does):

# %%
trace = []


def who():
    return "F" if grad_mode.is_enabled() else "B"


class LoggingComm(LocalComm):
    def ialltoallv(self, *args):
        trace.append(f"{who()}: starts an all-to-all, pauses")
        return super().ialltoallv(*args)


def build_layer():
    moe = MoE(d_model=C, n_experts=E, top_k=K, rng=np.random.default_rng(5))
    moe.experts_runner = ExpertParallel(moe, LoggingComm())
    moe.router.register_forward_pre_hook(lambda m, a: trace.append(f"{who()}: router"))
    moe.experts[0].register_forward_pre_hook(lambda m, a: trace.append(f"{who()}: experts"))
    moe.experts[0].register_full_backward_pre_hook(lambda m, g: trace.append(f"{who()}: experts' backward"))
    moe.router.register_full_backward_pre_hook(lambda m, g: trace.append(f"{who()}: router's backward"))
    return moe


rng = np.random.default_rng(6)
xa, xb, dyb = (rng.standard_normal((2, 3, C)) for _ in range(3))


def f_and_b(overlap: bool):
    moe = build_layer()
    yb = moe(Tensor(xb, requires_grad=True))  # micro-batch b's forward, earlier in the schedule
    trace.clear()
    out = {}

    def forward():
        out["ya"] = moe(Tensor(xa, requires_grad=True)).data
        trace.append("F: done")

    def backward():
        yb.backward(dyb)
        trace.append("B: done")

    if overlap:
        interleaver = Interleaver()
        moe.experts_runner.all_to_all = interleaver.all_to_all  # start, pause(), wait (the executor's does the same)
        interleaver.run(forward, backward)  # F first; they switch at every pause()
        out["switches"] = interleaver.switches
    else:
        forward()  # --no-overlap: F then B
        backward()
    return out, [p.grad for p in moe.parameters()], list(trace)


on, grads_on, trace_on = f_and_b(overlap=True)
print("\n".join(trace_on))
off, grads_off, _ = f_and_b(overlap=False)
same = np.array_equal(on["ya"], off["ya"]) and all(np.array_equal(a, b) for a, b in zip(grads_on, grads_off))
print(f"{on['switches']} switches; F's output and every gradient equal to F-then-B's bit for bit: {same}")

# %% [markdown] slideshow={"slide_type": "subslide"}
# F's dispatch travels while B starts the transpose of its combine; F's experts run while B's rows
# travel; B's expert backward runs while F's combine travels, and so on. (The counts all-to-all is
# blocking and not a switch point.) Each task computes exactly what it would alone, in the same
# order, and the switches happen at the same points on every rank, so both tasks start their
# collectives in the same order everywhere (MPI needs it) and the numbers are **bitwise** the same
# with the overlap on and off. Two pieces of refimpl's state are global and must follow each task
# across a switch: the grad-recording switch (the forward records, the engine's backward does
# not) and the rows of the global batch that are running (dropout masks); the Interleaver saves
# the outgoing task's and restores the incoming one's. MPI advances non-blocking collectives only
# inside MPI calls, so every switch also `test()`s the requests in flight.
#
# **Chunks, orders and exposed time.** Exercises 2 and 3 look at an F&B step as two lists of
# chunks, strings such as `"attention 0"`, `"dispatch 0"`, `"experts 0"`, `"combine 0"`, `"gates 0"`
# (the gate-weighted sum of each token's K outputs, which needs the combine's rows), `"mlp 1"` (a
# dense layer's MLP) or `"head"` (the loss). A chunk whose name starts with `dispatch` or `combine`
# *starts an all-to-all* -- in B it is the transpose: the backward of a combine sends output
# gradients to the experts' ranks -- and `is_alltoall(chunk)` says so; every other chunk computes.
# B's chunks are F's in reverse:

# %%
print("F:", moe_forward([0, 1]))
print("B:", moe_backward([0, 1]))

# %% [markdown] slideshow={"slide_type": "subslide"}
# While a task's all-to-all is in flight, that task can do nothing: its next chunk needs the rows.
# The only way to hide the transfer is for the *other* task to compute meanwhile; how much of the
# transfer that hides depends on the order of the chunks and on their costs.
#
# ## 5. Verify: DualPipe with experts over 2 ranks, 4 processes
#
# With `--pp 2` on 4 ranks there are two data-parallel replicas of a two-rank pipeline: ranks 0
# and 1 are position 0 of the two replicas, ranks 2 and 3 position 1 (tutorial 09's grid). Under
# DualPipe each rank holds two stages, one of each direction (tutorial 08), and `--ep 2` splits
# the experts of each of its MoE layers over the two replicas at the same position: expert-parallel
# groups {0, 1} and {2, 3}, 2 of the 4 experts per rank. DualPipe's F&B steps run overlapped.
# `verify` trains it and compares the loss, every gradient and every parameter after each step
# with single-process training from the same weights and batches:

# %%
SMALL = ["--model", "gpt", "--n-layer", "2", "--d-model", "16", "--n-head", "2", "--seq-len", "8"]
MOE = ["--experts", "4", "--ep", "2", "--pp", "2", "--schedule", "dualpipe", "--micro-batches", "4",
       "--batch-size", "16"]
done = run_mpi(4, "-m", "refimpl", "verify", *SMALL, *MOE, "--steps", "2", "--json", show=False)
print(done.stderr.strip())  # verify's report; the JSON summary is stdout's last line
result = last_json(done)
assert result["ok"] and "verify PASS" in done.stderr
print(f"expert parallel {result['trainer_report']['expert_parallel']}; all-to-all(v) bytes per rank "
      f"{[b['alltoallv']['bytes'] for b in result['bytes_sent']]}")

# %% [markdown] slideshow={"slide_type": "subslide"}
# Overlap on against off (`--no-overlap`), on the same 4 processes: two trainers from the same seed
# take two steps on the same batches, and the program compares losses, gradients and parameters
# bit for bit, as `tests/test_overlap.py` does (with dropout, checkpointing, ZeRO-1 and -2, a
# capacity factor and ring collectives there):

# %%
PROGRAM = f"""
import json
import numpy as np
from refimpl.tools.flags import config_from_flags
from refimpl.parallel.comm import get_world
from refimpl.tools.run import build_model, build_task, make_trainer

def run(world, flags):
    cfg = config_from_flags(flags)
    task = build_task(cfg)
    trainer = make_trainer(cfg, build_model(cfg, task), world, distributed=True)
    trainer.record_grads = True
    losses = [trainer.step(*task.batch(step, cfg.batch_size)) for step in range(2)]
    return losses, trainer.last_grads, trainer.full_parameters(), trainer.executor.switches

world = get_world()
flags = {SMALL + MOE + ["--dropout", "0.1"]!r}
on, off = run(world, flags), run(world, flags + ["--no-overlap"])
same = lambda a, b: a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
identical = on[0] == off[0] and same(on[1], off[1]) and same(on[2], off[2])
report = {{"identical": world.allgather_object(identical), "switches_on": world.allgather_object(on[3]),
          "switches_off": world.allgather_object(off[3]), "losses": on[0]}}
if world.rank == 0:
    print(json.dumps(report))
"""
report = last_json(run_mpi(4, "-c", PROGRAM, show=False))
print(f"losses {report['losses']}; bitwise identical on every rank: {report['identical']}; task switches per rank "
      f"with the overlap {report['switches_on']}, without {report['switches_off']}")
assert all(report["identical"]) and all(n > 0 for n in report["switches_on"])

# %% [markdown] slideshow={"slide_type": "subslide"}
# On one machine an all-to-all over shared memory takes microseconds, so there is little to hide
# here; the point of these runs is that the reordering is free of any numerical effect.
# Production systems overlap on separate CUDA streams (compute and communication kernels at the
# same time; DeepSeek-V3 dedicates 20 of an H800's 132 streaming multiprocessors to its all-to-all
# kernels); refimpl overlaps in the order of operations only.
#
# **Question (measure and explain).** (a) In part 3, give the router a zero weight
# (`moe.router.weight.data[...] = 0`, in `expert_parallel` before the forward and in `whole`) and
# run the cell again. Which experts does every token choose, which rank sends how many rows to
# which, what are the bytes, and which rank's experts do all the work? Beyond the model's quality,
# what does this say about why the balance loss matters for expert parallelism? (b) With your
# `exposed_time` of exercise 3 and your order of exercise 2, measure the exposed time of two MoE
# layers each (`moe_forward([0, 1])`, `moe_backward([0, 1])`) with F's attention 2, experts 3 and
# gates 1, B's chunks twice as long, and every all-to-all in flight for s, s = 0 … 12: F then B
# against interleaved. At which s does the interleaved step start to expose communication, and
# what are the two slopes for large s? Explain both from the chunk lists: which computation is
# there to hide each all-to-all behind, and why does interleaving halve the slope rather than
# remove it? (c) The Interleaver saves and restores the grad-recording switch and the batch rows
# per task. For each, say what would go wrong in part 4's step (or with dropout) if it did not, and
# whether `verify` would notice.
#
# ## Exercises
#
# **Exercise 1.** `dispatch_indices(chosen, n_experts)`: given the experts chosen for N tokens,
# an integer array (N, K) (row t: token t's K experts, all different), return `(order, counts,
# inverse)`: `order` (N·K,), the assignments a = t·K + c sorted by expert, token order within an
# expert; `counts` (E,), the rows each expert gets (zeros included); `inverse` (N, K), for each
# (token t, choice c) the row of the sorted outputs that holds its expert's output, so that
# `y_sorted[inverse]` is (N, K, C) in (token, choice) order. The check compares with refimpl's
# `route` and the layer's inverse on drawn cases: ties, experts with no token, one expert taking
# every token, K from 1 to 3, and sizes where NumPy's default sort is not stable.
#
# **Exercise 2.** `overlapped_order(forward, backward)`: the two chunk lists of an F&B step (part
# 4); return the order the Interleaver runs them in, a list of `(task, chunk)` pairs, task "F" or
# "B": F starts; a task runs its own chunks in order until it has started an all-to-all, then gives
# way to the other task, which resumes where it stopped; a task that has finished gives way for
# good (and an all-to-all started when the other task has finished is simply waited for). The
# check runs dense layers, layers of experts, a B without any all-to-all, and F and B of different
# lengths, and says where an order switches before an all-to-all starts, runs a task's chunks out
# of order, or never switches.
#
# **Exercise 3.** `exposed_time(order, cost)`: the communication time an F&B `order` (a list of
# `(task, chunk)` pairs, any interleaving of the two lists) leaves exposed, where `cost(task,
# chunk)` is a compute chunk's time, or for a chunk that starts an all-to-all the time the
# all-to-all is in flight. The model: one compute engine runs the chunks one after another, in
# the order given; starting an all-to-all takes no engine time; a task's next chunk cannot start
# before the task's all-to-all has arrived, and the step ends when the engine is done and every
# all-to-all has arrived. Return that end time minus the total compute time: how long the engine
# waited. Use exact arithmetic (the check's costs are whole numbers).
#
# **Exercise 4.** `alltoall_bytes(chosen, n_experts, width, itemsize)`: `chosen` is a list of P
# integer arrays, `chosen[r]` (N_r, K) the experts rank r's own tokens chose; the E = `n_experts`
# experts are split over the P ranks as in part 3, and the rows have `width` C elements of
# `itemsize` bytes. Return, for every rank, the bytes it sends in one forward and backward of the
# layer, as a list of P dicts `{"alltoall": bytes, "alltoallv": bytes}` (the counts exchange and
# the rows' exchanges, the counters' kinds). Part 3 measured one balanced case between two ranks;
# derive the general rule from what `ExpertParallel.__call__` and `AllToAll` do: which blocks leave
# a rank in each of the four steps and in backward, what the counts are stored as, and whose routing
# decides what a rank sends in the combine. The check runs refimpl's `ExpertParallel` on simulated
# ranks with exactly these choices (uneven routing, every token to one expert, K = 3 choices on one
# rank, P = 2 to 4, float32 and float64) and compares with the counters, rank by rank.

# %%
from harness import Exercises
from harness.experts import (
    check_alltoall_bytes,
    check_dispatch_indices,
    check_exposed_time,
    check_overlapped_order,
    is_alltoall,  # noqa: F401 - for exercises 2 and 3
)

ex = Exercises("11_experts_and_overlap")


@ex.stub
def dispatch_indices(chosen, n_experts):
    raise NotImplementedError("exercise 1")


@ex.stub
def overlapped_order(forward, backward):
    raise NotImplementedError("exercise 2")


@ex.stub
def exposed_time(order, cost):
    raise NotImplementedError("exercise 3")


@ex.stub
def alltoall_bytes(chosen, n_experts, width, itemsize):
    raise NotImplementedError("exercise 4")


# %%
# Your answer to this tutorial's question (measure and explain): the grader reads this string
# without running the file (tutorials/grade.py FOLDER --gradebook OUT).
ANSWER = """
(your answer)
"""

ex.check(1, check_dispatch_indices, dispatch_indices)
ex.check(2, check_overlapped_order, overlapped_order)
ex.check(3, check_exposed_time, exposed_time)
ex.check(4, check_alltoall_bytes, alltoall_bytes)
ex.summary();  # noqa: E703 - the `;` keeps a notebook from echoing the returned True/False
