"""Checks for tutorial 12 (planning a run): memory and time of a GPT on a cluster, by hand, against
refimpl's cost model (refimpl/tools/cluster/model.py).

Each check compares the student's function with the cost model itself (model states and
activations: `memory_breakdown`, the terms `predict` reports; MFU: `predict`'s own) or with the
hand formula the tutorial states (compute time, tp's share), on configurations from GPT-3 175B on
1024 A100s down to a 7B model with an uneven pipeline. A wrong answer is compared with the usual
mistakes (forgetting /tp, counting the embedding on every stage, sharding over every GPU instead of
dp, ...): when it equals one of them, the message names it.
"""

from __future__ import annotations

from refimpl.memory import PRECISIONS, STAGE_FORMULAS
from refimpl.tools.cluster.collectives import Group, Links
from refimpl.tools.cluster.hardware import PRESETS
from refimpl.tools.cluster.model import EFFICIENCY, Run, matmul_parameters, memory_breakdown, parameters, predict
from refimpl.tools.cluster.pipeline import simulate_step

from . import Wrong, shown

A100, H100 = PRESETS["a100-80gb"], PRESETS["h100-80gb"]
ITEMSIZE = {"mixed": 2, "float32": 4, "float64": 8}
GPT3 = dict(n_layer=96, d_model=12288, n_head=96, seq_len=2048, batch_size=1536)


def describe(run: Run) -> str:
    text = (f"L={run.n_layer} h={run.d_model} a={run.n_head} s={run.seq_len} V={run.vocab_size}, dp {run.dp} × tp "
            f"{run.tp} × pp {run.pp}, ZeRO-{run.zero}, {run.dtype}")
    if run.checkpoint != "none":
        text += f", checkpoint {run.checkpoint}"
    return text + f", {run.micro_batches} micro-batches of {run.micro_batch_size}"


def _rank(first: bool, last: bool) -> str:
    return {(True, True): "the only pipeline rank", (True, False): "the first pipeline rank",
            (False, True): "the last pipeline rank", (False, False): "a middle pipeline rank"}[(first, last)]


def _close(got, expected, slack: float = 0.0, rtol: float = 1e-9) -> bool:
    try:
        return abs(float(got) - expected) <= slack + rtol * abs(expected)
    except (TypeError, ValueError):
        return False


def _diagnose(got, variants: dict, slack: float = 0.0, rtol: float = 1e-9) -> str:
    """' -- that is what you get if you <mistake>' for the first variant `got` equals, else ''."""
    for mistake, value in variants.items():
        if _close(got, value, slack, rtol):
            return f". That is what you get if you {mistake}"
    return ""


# ------------------------------------------------------------------------------------------------
# Exercise 1: model-state bytes per GPU
# ------------------------------------------------------------------------------------------------


def _psi(run: Run, first: bool, last: bool, tp_blocks=True, tp_whole=False, pad=True, stage_ends=True,
         ceil=True) -> float:
    """Parameters one GPU holds, by the tutorial's rule, with the mistakes asked for."""
    h, t, L, pp = run.d_model, run.tp, run.n_layer, run.pp
    blocks = (-(-L // pp) if ceil else L // pp) if pp > 1 else L
    psi = blocks * ((12 * h * h + 7 * h) / (t if tp_blocks else 1) + 6 * h / (t if tp_whole else 1))
    V = -(-run.vocab_size // t) * t if pad else run.vocab_size
    if first or not stage_ends:
        psi += V * h / t + run.seq_len * h
    if last or not stage_ends:
        psi += V * h / t + 2 * h
    return psi


def _states(psi: float, zero: int, n: int, dtype: str) -> float:
    p, g, k = PRECISIONS[dtype]
    if zero < 0:
        zero = 0
    return ((p if zero < 3 else p / n) + (g if zero < 2 else g / n) + (k if zero < 1 else k / n)) * psi


def _state_variants(run: Run, first: bool, last: bool) -> dict:
    z, n, d = run.zero, run.dp, run.dtype
    out = {
        "did not divide the blocks' matrices by tp (each tp rank holds 1/tp of every weight matrix)":
            _states(_psi(run, first, last, tp_blocks=False), z, n, d),
        "divided every block parameter by tp, the 6h that every tp rank keeps whole too (the row-parallel "
        "layers' biases and the two layer norms: tutorial 10)": _states(_psi(run, first, last, tp_whole=True), z, n, d),
        "counted the embedding (V'h/tp + s·h) and the head (V'h/tp + 2h) on every pipeline rank: the first stage "
        "holds the embedding, the last the head": _states(_psi(run, first, last, stage_ends=False), z, n, d),
        "used the vocabulary V without padding it to a multiple of tp (V' = ⌈V/tp⌉·tp rows)":
            _states(_psi(run, first, last, pad=False), z, n, d),
        "rounded the blocks per stage down (L // pp); the largest stage holds ⌈L/pp⌉":
            _states(_psi(run, first, last, ceil=False), z, n, d),
        f"sharded over every GPU (dp·tp·pp = {run.gpus}) instead of the {n} data-parallel ranks that hold copies of "
        "the same parameters": _states(_psi(run, first, last), z, run.gpus, d),
        "used Ψ of the whole model divided by tp·pp": _states(parameters(run) / (run.tp * run.pp), z, n, d),
    }
    for other in (z - 1, z + 1):
        if 0 <= other <= 3:
            out[f"used ZeRO-{other}'s formula, {STAGE_FORMULAS[other]}, for ZeRO-{z}, {STAGE_FORMULAS[z]}"] = (
                _states(_psi(run, first, last), other, n, d))
    return out


STATE_RUNS = [
    (Run(**GPT3, vocab_size=50257, dp=8, tp=8, pp=16, zero=1), [(True, False), (False, False), (False, True)]),
    (Run(**GPT3, vocab_size=50257, dp=8, tp=8, pp=16, zero=0), [(True, False), (False, True)]),
    (Run(**GPT3, vocab_size=50257, dp=8, tp=8, pp=16, zero=2), [(True, False)]),
    (Run(**GPT3, vocab_size=50257, dp=8, tp=8, pp=16, zero=3), [(False, True)]),
    (Run(n_layer=32, d_model=4096, n_head=32, seq_len=4096, vocab_size=32000, batch_size=512, dp=4, tp=2, pp=3,
         zero=2), [(True, False), (False, False), (False, True)]),
    (Run(n_layer=2, d_model=64, n_head=4, seq_len=16, vocab_size=11, batch_size=32, dp=2, tp=2, zero=3,
         dtype="float32"), [(True, True)]),
    (Run(n_layer=24, d_model=2048, n_head=16, seq_len=2048, vocab_size=51200, batch_size=512, dp=64, zero=1),
     [(True, True)]),
]


def check_model_state_bytes(model_state_bytes) -> None:
    """Check: model-state bytes per GPU."""
    for run, ranks in STATE_RUNS:
        for first, last in ranks:
            parts = memory_breakdown(run, A100, 1, first, last)
            expected = parts["parameters"] + parts["gradients"] + parts["optimizer_states"]
            got = model_state_bytes(run, first, last)
            if not _close(got, expected, slack=3):  # the model rounds each of its three parts down to whole bytes
                p, g, k = PRECISIONS[run.dtype]
                raise Wrong(f"{describe(run)}, {_rank(first, last)}: it holds Ψ = {_psi(run, first, last):,.0f} "
                            f"parameters and {expected:,} bytes of model states (ZeRO-{run.zero}: "
                            f"{STAGE_FORMULAS[run.zero]}, P={p} G={g} K={k}, N = dp = {run.dp}); you said {shown(got)}"
                            + _diagnose(got, _state_variants(run, first, last), slack=3))


# ------------------------------------------------------------------------------------------------
# Exercise 2: activation bytes on the first pipeline rank
# ------------------------------------------------------------------------------------------------


def in_flight_1f1b(run: Run) -> int:
    """The simulator's peak of micro-batches whose activations the first rank holds (1F1B)."""
    if run.pp == 1:
        return 1
    return simulate_step("1f1b", run.pp, run.micro_batches, None, 1.0, 1.0, 1.0, 0.0).peak_in_flight[0]


def _activations(run: Run, e=None, in_flight=None, blocks=None, split_tp=True, whole_tp=False, checkpoint=None,
                 logits=None, logit_bytes=4) -> float:
    b, s, h, a, t, V = run.micro_batch_size, run.seq_len, run.d_model, run.n_head, run.tp, run.vocab_size
    e = ITEMSIZE[run.dtype] if e is None else e
    checkpoint = run.checkpoint if checkpoint is None else checkpoint
    N = b * s
    if checkpoint == "full":
        per_block = N * h
    else:
        core = 0 if checkpoint == "selective" else b * a * s * s
        per_block = (4 * N * h + 2 * N) / (t if whole_tp else 1) + (12 * N * h + core) / (t if split_tp else 1)
    blocks = run.blocks_per_stage if blocks is None else blocks
    in_flight = in_flight_1f1b(run) if in_flight is None else in_flight
    out = e * per_block * blocks * in_flight
    if run.pp == 1 if logits is None else logits:
        out += N * V / t * logit_bytes
    return out


def _activation_variants(run: Run) -> dict:
    m = run.micro_batches
    out = {
        "did not divide the tp-split part (q, k, v, the attention output, the GeLU's input and output: 12·N·h, and "
        "the attention core b·a·s²) by tp": _activations(run, split_tp=False),
        "divided everything by tp, also the 4·N·h + 2·N that every tp rank holds whole (the layer norms' inputs "
        "and the inputs of qkv and fc; that needs sequence parallelism)": _activations(run, whole_tp=True),
        "counted elements, not bytes (× 2 for 16-bit activations)": _activations(run, e=1),
        "counted 4 bytes per element; mixed precision keeps 16-bit activations (2 bytes)": _activations(run, e=4),
        "counted all L blocks; the rank holds only its stage's ⌈L/pp⌉": _activations(run, blocks=run.n_layer),
        "kept one micro-batch in flight; 1F1B's first rank runs pp forwards before its first backward":
            _activations(run, in_flight=1),
        f"kept every micro-batch in flight ({m}): that is GPipe, not 1F1B": _activations(run, in_flight=m),
        "ignored the checkpointing: with full recomputation a block keeps only its input (N·h elements), with "
        "selective it drops the attention core's b·a·s²": _activations(run, checkpoint="none"),
        "added the head's float32 logits on the first rank; only the last pipeline rank holds them":
            _activations(run, logits=True),
        "forgot the head's float32 logits (N·V/tp · 4 bytes): with pp = 1 the first rank is also the last":
            _activations(run, logits=False),
        "counted the logits at 2 bytes; the loss keeps them in float32": _activations(run, logit_bytes=2),
    }
    return out


ACTIVATION_RUNS = [
    Run(**GPT3, vocab_size=51200, dp=8, tp=8, pp=16),
    Run(**GPT3, vocab_size=51200, dp=8, tp=8, pp=16, checkpoint="selective"),
    Run(**GPT3, vocab_size=51200, dp=8, tp=8, pp=16, checkpoint="full"),
    Run(n_layer=32, d_model=4096, n_head=32, seq_len=4096, vocab_size=32000, batch_size=512, dp=8, tp=2, pp=3,
        micro_batch_size=2),
    Run(n_layer=24, d_model=2048, n_head=16, seq_len=2048, vocab_size=51200, batch_size=512, dp=32, tp=2),
    Run(n_layer=24, d_model=2048, n_head=16, seq_len=2048, vocab_size=51200, batch_size=512, dp=64,
        checkpoint="selective", micro_batch_size=4),
]


def check_activation_bytes(activation_bytes) -> None:
    """Check: activation bytes on the first pipeline rank (1F1B)."""
    for run in ACTIVATION_RUNS:
        expected = memory_breakdown(run, A100, in_flight_1f1b(run), first=True, last=run.pp == 1)["activations"]
        got = activation_bytes(run)
        if not _close(got, expected, slack=1):  # the model rounds down to whole bytes
            raise Wrong(f"{describe(run)}: the first pipeline rank holds {expected:,} bytes of activations at its "
                        f"peak ({in_flight_1f1b(run)} micro-batches in flight × {run.blocks_per_stage} blocks"
                        + (" + the head's logits" if run.pp == 1 else "") + f"); you said {shown(got)}"
                        + _diagnose(got, _activation_variants(run), slack=1))


# ------------------------------------------------------------------------------------------------
# Exercise 3: compute seconds of one step, by hand
# ------------------------------------------------------------------------------------------------


def hand_compute_seconds(run: Run, cluster, recompute=True, head_recomputed=False, bubble=True, bubble_p=False,
                         divide_by=None, per_token=6, attention=True, all_params=False, efficiency=True,
                         selective_as_full=False) -> float:
    """The tutorial's hand estimate (part 3), with the mistakes asked for."""
    h, s, L = run.d_model, run.seq_len, run.n_layer
    n = parameters(run) if all_params else matmul_parameters(run)
    flops = per_token * n + (12 * L * h * s if attention else 0)
    if recompute and (run.checkpoint == "full" or (selective_as_full and run.checkpoint == "selective")):
        flops += 2 * 12 * h * h * L + 4 * L * h * s + (2 * run.vocab_size * h if head_recomputed else 0)
    elif recompute and run.checkpoint == "selective":
        flops += 4 * L * h * s
    tokens = run.batch_size * run.seq_len
    rate = cluster.flops(run.dtype) * (EFFICIENCY.gemm if efficiency else 1.0)
    seconds = tokens * flops / (run.gpus if divide_by is None else divide_by) / rate
    if run.pp > 1 and bubble:
        seconds *= 1 + (run.pp if bubble_p else run.pp - 1) / run.micro_batches
    return seconds


def _time_variants(run: Run, cluster) -> dict:
    f = hand_compute_seconds
    out = {
        "left out the recomputation (full: one more forward of the blocks, 24·L·h² + 4·L·h·s per token; "
        "selective: the attention core's forward, 4·L·h·s)": f(run, cluster, recompute=False),
        "recomputed the head too: full recomputation recomputes the blocks, not the head":
            f(run, cluster, head_recomputed=True),
        "costed selective recomputation as full: selective recomputes only the attention core (4·L·h·s FLOPs per "
        "token: the scores and the weighted sum), not the blocks' GEMMs (24·L·h²)":
            f(run, cluster, selective_as_full=True),
        "left out the bubble: 1F1B's step is (m + pp − 1) slots of work, not m": f(run, cluster, bubble=False),
        "took the bubble as pp/m; it is (pp − 1)/m": f(run, cluster, bubble_p=True),
        f"divided the work by dp = {run.dp} alone; it is shared by all dp·tp·pp = {run.gpus} GPUs":
            f(run, cluster, divide_by=run.dp),
        f"divided the work by dp·pp = {run.dp * run.pp}, forgetting tp = {run.tp}":
            f(run, cluster, divide_by=run.dp * run.pp),
        "counted 2 FLOPs per parameter and token (the forward only); training is 6: forward 2, backward 4":
            f(run, cluster, per_token=2),
        "left out the attention core's 12·L·h·s FLOPs per token": f(run, cluster, attention=False),
        "counted every parameter; the embedding's lookup, biases and layer norms multiply nothing (N: the blocks' "
        "12·L·h² and the head's V·h)": f(run, cluster, all_params=True),
        f"used the peak FLOP/s; GEMMs reach EFFICIENCY.gemm = {EFFICIENCY.gemm} of it":
            f(run, cluster, efficiency=False),
    }
    return out


TIME_RUNS = [
    (Run(**GPT3, vocab_size=51200, dp=8, tp=8, pp=16, checkpoint="full"), A100),
    (Run(**GPT3, vocab_size=51200, dp=8, tp=8, pp=16, checkpoint="selective"), H100),
    (Run(n_layer=32, d_model=4096, n_head=32, seq_len=4096, vocab_size=32000, batch_size=512, dp=8, tp=2, pp=4,
         micro_batch_size=2), A100),
    (Run(n_layer=24, d_model=2048, n_head=16, seq_len=2048, vocab_size=51200, batch_size=512, dp=32, tp=2,
         zero=1), H100),
]


def check_compute_seconds(compute_seconds) -> None:
    """Check: the compute time of one step, by hand."""
    for run, cluster in TIME_RUNS:
        expected = hand_compute_seconds(run, cluster)
        got = compute_seconds(run, cluster)
        if not _close(got, expected):
            raise Wrong(f"{describe(run)} on {cluster.name}: by the tutorial's rule the step computes for "
                        f"{expected:.6g} s; you said {shown(got)}" + _diagnose(got, _time_variants(run, cluster)))


# ------------------------------------------------------------------------------------------------
# Exercise 4: MFU
# ------------------------------------------------------------------------------------------------


def _mfu(run: Run, cluster, step: float, recompute=False, all_params=False, attention=True, gpus=None,
         efficiency=False) -> float:
    h, s, L = run.d_model, run.seq_len, run.n_layer
    flops = 6 * (parameters(run) if all_params else matmul_parameters(run)) + (12 * L * h * s if attention else 0)
    if recompute and run.checkpoint == "full":
        flops += 2 * 12 * h * h * L + 4 * L * h * s
    elif recompute and run.checkpoint == "selective":
        flops += 4 * L * h * s
    peak = cluster.flops(run.dtype) * (EFFICIENCY.gemm if efficiency else 1.0)
    return run.batch_size * s * flops / step / (run.gpus if gpus is None else gpus) / peak


def check_mfu(mfu) -> None:
    """Check: model FLOPs utilisation (PaLM's)."""
    for run, cluster in TIME_RUNS:
        prediction = predict(run, cluster)
        for step in (prediction.step_seconds, 10.0):
            expected = prediction.mfu if step == prediction.step_seconds else _mfu(run, cluster, step)
            got = mfu(run, cluster, step)
            if not _close(got, expected):
                variants = {
                    "counted the recomputation: that is the hardware FLOPs utilisation (HFU); MFU counts only the "
                    "FLOPs the model needs, so that recomputing more never looks more efficient":
                        _mfu(run, cluster, step, recompute=True),
                    "counted every parameter; PaLM's N is the parameters that multiply a token (the blocks' "
                    "matrices and the head)": _mfu(run, cluster, step, all_params=True),
                    "left out the attention core's 12·L·h·s per token": _mfu(run, cluster, step, attention=False),
                    f"divided by dp = {run.dp} GPUs instead of all {run.gpus}": _mfu(run, cluster, step, gpus=run.dp),
                    "divided by the sustained GEMM rate; MFU's denominator is the peak": _mfu(run, cluster, step,
                                                                                              efficiency=True),
                }
                raise Wrong(f"{describe(run)} on {cluster.name}, a step of {step:.6g} s: MFU {expected:.6g} "
                            f"(predict's), you said {shown(got)}" + _diagnose(got, variants))


# ------------------------------------------------------------------------------------------------
# Exercise 5: tensor parallelism's share of a block's forward
# ------------------------------------------------------------------------------------------------


def _tp_share(h: int, t: int, cluster, ring=True, allreduces=2, gemm_tp=True, itemsize=2, ratio=False,
              network=True) -> float:
    if t == 1:
        return 0.0
    N = 1.0  # tokens: they cancel
    beta = cluster.intra_bandwidth * (EFFICIENCY.network if network else 1.0)
    nbytes = N * h * itemsize
    if ring:
        links = Links(0.0, beta, 0.0, beta)
        comm = allreduces * links.allreduce(nbytes, Group(t, t))
    else:
        comm = allreduces * 2 * nbytes / beta
    gemm = 24 * N * h * h / (t if gemm_tp else 1) / (cluster.flops("mixed") * EFFICIENCY.gemm)
    return comm / gemm if ratio else comm / (comm + gemm)


def check_tp_share(tp_share) -> None:
    """Check: tensor parallelism's share of a block's forward."""
    for cluster in (A100, H100):
        for h in (4096, 12288, 2048):
            for t in (8, 4, 2, 1):  # the general case first; t = 1 (no group, nothing sent) last
                expected = _tp_share(h, t, cluster)
                got = tp_share(h, t, cluster)
                if t == 1 and not _close(got, expected):
                    raise Wrong(f"h = {h}, t = 1 on {cluster.name}: a group of one rank all-reduces nothing, so "
                                f"tp's share is 0; you said {shown(got)}. A ring all-reduce sends 2(t − 1)/t of the "
                                "buffer, which is 0 at t = 1: did you drop the (t − 1)/t?")
                if not _close(got, expected):
                    variants = {
                        "sent the whole buffer twice per all-reduce; a ring all-reduce sends 2(t − 1)/t of it":
                            _tp_share(h, t, cluster, ring=False),
                        "counted one all-reduce per block; Megatron's block has two in forward (after attention "
                        "and after the MLP)": _tp_share(h, t, cluster, allreduces=1),
                        "did not divide the GEMMs by t: each rank multiplies 1/t of every weight":
                            _tp_share(h, t, cluster, gemm_tp=False),
                        "counted 4 bytes per element; mixed precision sends 16-bit activations":
                            _tp_share(h, t, cluster, itemsize=4),
                        "returned communication ÷ GEMM time; the share is communication ÷ (communication + GEMMs)":
                            _tp_share(h, t, cluster, ratio=True),
                        f"used the link's peak bandwidth; collectives reach EFFICIENCY.network = "
                        f"{EFFICIENCY.network} of it": _tp_share(h, t, cluster, network=False),
                    }
                    raise Wrong(f"h = {h}, t = {t} on {cluster.name} (inside a node, α ignored): tp's all-reduces "
                                f"take {expected:.6g} of the block's forward; you said {shown(got)}"
                                + _diagnose(got, variants))
