"""Checks for tutorial 09 (everything together): the pp x dp x tp grid, the split of the layers into
stages, and which ranks sum a stage's gradients."""

from __future__ import annotations

from itertools import permutations

from refimpl.parallel.mesh import Mesh
from refimpl.parallel.pipeline import build
from refimpl.parallel.pipeline.stage import stage_sizes

from . import Wrong, plain, shown


class _World:
    """Just enough of a communicator for Mesh to lay out its grid (no sub-communicators)."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size

    def split(self, color, key=None):
        return None


# (dp, pp, tp) shapes for exercise 1: tp = 1 first (where the old pp-fastest order is caught), then tp > 1
MESH_SHAPES = [(1, 1, 1), (2, 3, 1), (3, 2, 1), (1, 4, 1), (4, 1, 1), (1, 1, 4), (2, 1, 2), (1, 2, 2), (2, 2, 2),
               (3, 2, 2), (2, 3, 2), (2, 2, 3), (1, 3, 2), (3, 1, 2)]
_INDEX = {"pp": "p", "dp": "d", "tp": "t"}


def _numbering(order: tuple, dp: int, pp: int, tp: int) -> dict:
    """{rank: (d, p, t)} when the ranks are numbered with the axes in `order`, slowest first."""
    size = {"dp": dp, "pp": pp, "tp": tp}
    table = {}
    for rank in range(dp * pp * tp):
        index, rest = {}, rank
        for axis in reversed(order):  # fastest first
            rest, index[axis] = divmod(rest, size[axis])
        table[rank] = (index["dp"], index["pp"], index["tp"])
    return table


def _formula(order: tuple, dp: int, pp: int, tp: int) -> str:
    """'rank = (d·pp + p)·tp + t' for the axes in `order` (slowest first), leaving out axes of size 1."""
    size = {"dp": dp, "pp": pp, "tp": tp}
    text = ""
    for axis in (a for a in order if size[a] > 1):
        if not text:
            text = _INDEX[axis]
        else:
            outer = f"({text})" if "+" in text else text
            text = f"{outer}·{axis} + {_INDEX[axis]}"
    return "rank = " + (text or "0")


def _slowest_to_fastest(order: tuple, dp: int, pp: int, tp: int) -> str:
    size = {"dp": dp, "pp": pp, "tp": tp}
    return ", ".join(a for a in order if size[a] > 1)


def check_mesh_coordinates(mesh_coordinates) -> None:
    """Check: a rank's place in the pp x dp x tp grid."""
    megatron = ("pp", "dp", "tp")  # slowest to fastest: refimpl.parallel.mesh.AXES
    for dp, pp, tp in MESH_SHAPES:
        n = dp * pp * tp
        shape = f"dp={dp}, pp={pp}, tp={tp}"
        expected, got = {}, {}
        for rank in range(n):
            mesh = Mesh(_World(rank, n), dp=dp, pp=pp, tp=tp)
            expected[rank] = (mesh.dp_index, mesh.pp_index, mesh.tp_index)
            answer = mesh_coordinates(rank, dp, pp, tp)
            try:
                got[rank] = tuple(int(i) for i in answer)
            except TypeError:
                raise Wrong(f"{shape}: return the three indices (d, p, t) of rank {rank}; you returned "
                            f"{shown(answer)}") from None
            if len(got[rank]) != 3:
                raise Wrong(f"{shape}: return three indices (d, p, t) -- replica, stage, tensor-parallel shard -- "
                            f"not {len(got[rank])}; you said {plain(got[rank])} for rank {rank}")
        if got == expected:
            continue
        for order in permutations(megatron):  # a whole table in another order: name that order
            if order != megatron and got == _numbering(order, dp, pp, tp):
                old_layout = tp == 1 and order.index("pp") > order.index("dp")
                old = " (the old dp x pp layout, stage fastest)" if old_layout else ""
                raise Wrong(f"{shape}: you numbered the ranks {_formula(order, dp, pp, tp)}, axes slowest to fastest "
                            f"{_slowest_to_fastest(order, dp, pp, tp)}{old}; refimpl uses Megatron-LM's order, "
                            f"tensor parallel fastest, then data parallel, pipeline slowest: "
                            f"{_formula(megatron, dp, pp, tp)}")
        rank = next(r for r in range(n) if got[r] != expected[r])
        d, p, t = expected[rank]
        raise Wrong(f"{shape}: rank {rank} is replica d={d}, stage p={p}, tensor-parallel shard t={t}, that is "
                    f"(d, p, t) = {expected[rank]}; you said {plain(got[rank])}")


def check_stage_layers(stage_layers) -> None:
    """Check: layers per pipeline stage."""
    for layers in (1, 4, 7, 8, 10):
        for stages in range(1, layers + 1):
            expected = stage_sizes(layers, stages)
            got = list(stage_layers(layers, stages))
            if got != expected:
                raise Wrong(f"{layers} layers over {stages} stages are split {expected}; you said {plain(got)}")


def reference_gradient_group(rank: int, dp: int, pp: int, schedule: str) -> list[int]:
    """The world ranks that sum their gradients with `rank` (as the trainer forms the group; tp = 1):
    the data-parallel group of every pipeline rank holding the same stages."""
    placement = build(schedule, pp, 2 * pp).placement
    primary = {s: min(placement.ranks_of(s)) for s in range(placement.num_stages)}  # pipeline rank
    mesh = Mesh(_World(0, dp * pp), dp=dp, pp=pp)

    def color(world_rank):
        _, p, _ = mesh.coords_of(world_rank)  # its pipeline rank
        return min(primary[s] for s in placement.stages_of(p))

    return [r for r in range(dp * pp) if color(r) == color(rank)]


def check_gradient_group(gradient_group) -> None:
    """Check: the ranks that sum a stage's gradients."""
    for schedule in ("1f1b", "zbv", "dualpipe"):
        for dp, pp in [(1, 2), (2, 2), (2, 4), (3, 4)]:
            for rank in range(dp * pp):
                expected = reference_gradient_group(rank, dp, pp, schedule)
                got = list(gradient_group(rank, dp, pp, schedule))
                if sorted(got) == expected and got != expected:
                    raise Wrong(f"{schedule}, dp={dp}, pp={pp}: rank {rank}'s group is the right ranks, but return "
                                f"them sorted, in increasing order: {expected}; you said {plain(got)}")
                if got != expected:
                    raise Wrong(f"{schedule}, dp={dp}, pp={pp}: rank {rank} sums its gradients with ranks {expected} "
                                f"(every rank that holds the same stages); you said {plain(got)}")


# ------------------------------------------------------------------------------------------------
# Exercise 4: the model states each pipeline rank holds, with ZeRO inside each stage's group
# ------------------------------------------------------------------------------------------------

BUCKET_BYTES = 1 << 20  # train's default --bucket-bytes: every stage of the check's models fits one bucket
MODEL_STATE_KINDS = ("parameters", "gradients", "optimizer_states")

# (n_layer, d_model, seq_len, vocab_size, dp, pp): uneven splits, dp not dividing Ψ, pp = 1, dp = 1
MODEL_STATE_CASES = [(4, 32, 8, 11, 2, 2), (3, 20, 6, 11, 3, 2), (5, 16, 10, 13, 3, 3), (2, 24, 4, 7, 1, 2),
                     (3, 12, 6, 9, 4, 1), (7, 8, 12, 17, 5, 4), (6, 28, 14, 31, 3, 4)]


def _stage_parameters(n_layer: int, d_model: int, seq_len: int, vocab_size: int, pp: int) -> list:
    """[[(name, Parameter)] of each stage], as the trainer splits refimpl's GPT (float32, untied)."""
    from refimpl.nn import GPT, GPTConfig  # noqa: PLC0415
    from refimpl.parallel.pipeline.stage import split_model  # noqa: PLC0415

    model = GPT(GPTConfig(vocab_size=vocab_size, seq_len=seq_len, n_layer=n_layer, n_head=1, d_model=d_model,
                          dtype="float32"), seed=0)
    stages = split_model(model, pp)
    return [stages[s].named_parameters() for s in range(pp)]


def reference_stage_model_states(n_layer, d_model, seq_len, vocab_size, dp, pp, zero, *, padded=True,
                                    split=None) -> list:
    """The bytes the memory ledger reports per pipeline rank (train --json's pipeline.model_state_bytes) for
    float32 AdamW, ZeRO-`zero` (0, 1 or 2) over each stage's dp copies: ZeRO's flat buffers are padded to a
    multiple of dp (refimpl/parallel/zero/flat.py), and with ZeRO-1/2 the whole parameters and (ZeRO-1)
    gradients are those padded buffers."""
    from refimpl.parallel.zero.flat import bucket_groups  # noqa: PLC0415

    result = []
    for named in split or _stage_parameters(n_layer, d_model, seq_len, vocab_size, pp):
        psi = sum(p.data.size for _, p in named)
        if zero == 0:
            whole = shard = psi
        else:
            whole = sum(g.length for g in bucket_groups(named, BUCKET_BYTES, dp, 0)) if padded else psi
            shard = whole // dp if padded else psi / dp
        result.append({"parameters": 4 * whole, "gradients": 4 * (shard if zero >= 2 else whole),
                       "optimizer_states": 8 * (shard if zero >= 1 else whole)})
    return result


def _model_state_mistakes(case, zero) -> dict:
    """{description: answer} of the usual wrong derivations."""
    L, C, T, V, dp, pp = case
    params = _stage_parameters(L, C, T, V, pp)
    mistakes = {}
    if zero >= 1 and dp > 1:
        mistakes["ZeRO's flat buffers are padded to a multiple of dp, so that every rank owns an equal shard; the "
                 "padding is held too: the whole buffers (parameters, and gradients below ZeRO-2) and each "
                 "rank's shard are ⌈Ψ/dp⌉·dp and ⌈Ψ/dp⌉ elements"] = reference_stage_model_states(
            L, C, T, V, dp, pp, zero, padded=False, split=params)
        unpadded_whole = []
        for named, right in zip(params, reference_stage_model_states(L, C, T, V, dp, pp, zero, split=params)):
            psi = sum(p.data.size for _, p in named)
            unpadded_whole.append({**right, "parameters": 4 * psi, **({"gradients": 4 * psi} if zero == 1 else {})})
        mistakes["the whole buffers are padded too: with ZeRO-1 or 2 the parameters (and ZeRO-1's gradients) are "
                 "the flat buffer of ⌈Ψ/dp⌉·dp elements"] = unpadded_whole
    for other in (0, 1, 2):
        if other != zero:
            mistakes[f"that is ZeRO-{other}'s split: ZeRO-1 shards the optimizer states, ZeRO-2 the gradients as well, "
                     "the parameters stay whole"] = reference_stage_model_states(L, C, T, V, dp, pp, other,
                                                                                    split=params)
    if pp > 1 and L % pp:
        sizes = stage_sizes(L, pp)[::-1]  # the extra layers on the last stages instead of the first
        blocks = [[(n, p) for n, p in named if n.startswith("blocks.")] for named in params]
        flat = [b for stage in blocks for b in stage]
        per_block = len(flat) // L
        start, redone = 0, []
        for s, size in enumerate(sizes):
            mine = flat[start * per_block:(start + size) * per_block]
            start += size
            redone.append([(n, p) for n, p in params[s] if not n.startswith("blocks.")] + mine)
        mistakes["the first L mod pp stages get one layer more (exercise 2), not the last ones"] = (
            reference_stage_model_states(L, C, T, V, dp, pp, zero, split=redone))
    if pp > 1:
        swapped = [[(n, p) for n, p in params[0] if n.startswith("blocks.")]
                   + [(n, p) for n, p in params[-1] if not n.startswith("blocks.")]]
        swapped += params[1:-1] + [[(n, p) for n, p in params[-1] if n.startswith("blocks.")]
                                   + [(n, p) for n, p in params[0] if not n.startswith("blocks.")]]
        mistakes["the embeddings (token and position) are on the first stage, the final layer norm and the head "
                 "on the last"] = reference_stage_model_states(L, C, T, V, dp, pp, zero, split=swapped)
    for missing, why in (("wpe.", "the position embedding, seq_len × C, is a parameter of the first stage"),
                         ("ln_f.", "the final layer norm's weight and bias, 2C, are on the last stage"),
                         ("lm_head.", "the head, V × C without a bias (untied from the embedding), is on the last "
                                      "stage")):
        mistakes[why] = reference_stage_model_states(
            L, C, T, V, dp, pp, zero, split=[[(n, p) for n, p in named if not n.startswith(missing)]
                                             for named in params])
    return mistakes


def check_stage_model_states(stage_model_states) -> None:
    """Check: the model-state bytes of each pipeline rank under dp x pp with ZeRO."""
    answers = []  # (case, zero, where, expected, got), every case first: a mistake is named if it explains them all
    for case in MODEL_STATE_CASES:
        L, C, T, V, dp, pp = case
        for zero in (0, 1, 2):
            expected = reference_stage_model_states(L, C, T, V, dp, pp, zero)
            where = f"n_layer={L}, d_model={C}, seq_len={T}, vocab_size={V}, dp={dp}, pp={pp}, ZeRO-{zero}"
            got = stage_model_states(L, C, T, V, dp, pp, zero)
            try:
                got = [{kind: plain(rank[kind]) for kind in MODEL_STATE_KINDS} for rank in got]
            except (TypeError, KeyError, IndexError):
                raise Wrong(f"{where}: return a list with one dict per pipeline rank, keys "
                            f"{', '.join(MODEL_STATE_KINDS)}; you returned {shown(got)}") from None
            if len(got) != pp:
                raise Wrong(f"{where}: return one dict per pipeline rank, {pp} of them, not {len(got)}")
            answers.append((case, zero, where, expected, got))
    wrong = [answer for answer in answers if answer[4] != answer[3]]
    if not wrong:
        return
    case, zero, where, expected, got = wrong[0]
    p = next(r for r in range(len(got)) if got[r] != expected[r])
    kind = next(k for k in MODEL_STATE_KINDS if got[p][k] != expected[p][k])
    mistakes = _model_state_mistakes(case, zero)
    table = {(c, z): _model_state_mistakes(c, z) for c, z, *_ in answers}
    everywhere = [why for why in mistakes if all(table[c, z].get(why, e) == g for c, z, _, e, g in answers)]
    here = [why for why, guess in mistakes.items() if guess == got]
    field = [why for why, guess in mistakes.items()
             if [w[kind] for w in guess] == [g[kind] for g in got] and guess[p][kind] != expected[p][kind]]
    hint = (everywhere or here or field or [None])[0]
    raise Wrong(f"{where}: pipeline rank {p} holds {expected[p][kind]:,} bytes of {kind.replace('_', ' ')} "
                f"(the memory ledger's count); you said {shown(got[p][kind])}" + (f": {hint}" if hint else ""))
