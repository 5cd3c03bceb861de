"""Tensor parallelism with fewer key/value heads than ranks (--tp > --kv-heads, --kv-heads dividing --tp).

Rank r of t keeps query heads [r·H/t, (r+1)·H/t), all in the group of key/value head ⌊r·Hkv/t⌋,
which R = t/Hkv ranks keep whole; wk's and wv's gradients are summed over those R replicas in
every backward (refimpl/parallel/tensor_parallel/gpt.py). Checked here:

  * verify (float64, rtol 1e-10) against one process: multi-query at tp 2 and 4, two key/value
    heads at tp 4, with sequence parallelism, dropout (the two-level mask slice), selective
    recomputation, clipping, gradient accumulation, ZeRO 1-3 over dp 2, tp x pp (1F1B, ZB-H1 whose
    weight gradients run apart from the input gradients);
  * two planted bugs fail verify far beyond its tolerance: no sum over the replicas, and a clipping
    norm that counts each replica's key/value gradient again;
  * the accounting: bytes per step on the tp group, parameters per rank and saved bytes per block
    equal their formulas (tensor_parallel_checks.py, the tensor-parallel command), the replicas stay
    equal; WeightSplit's replicated slices put back together give the whole weight.
"""

import json

import numpy as np
import pytest
from mpi_util import PROGRAMS, last_json, run_mpi
from test_llama_parallel import verify_all

from refimpl.memory import gpt_parameters
from refimpl.nn import GPT, GPTConfig
from refimpl.parallel.tensor_parallel import shard_gpt
from refimpl.parallel.tensor_parallel.gpt import WeightSplit

LLAMA = ["--arch", "llama", "--ffn-size", "24", "--d-model", "16", "--n-head", "4", "--seq-len", "8", "--steps", "2",
         "--batch-size", "8"]

ON_TWO = [LLAMA + ["--tp", "2", "--kv-heads", "1"],
          LLAMA + ["--tp", "2", "--kv-heads", "1", "--sequence-parallel", "--dropout", "0.1", "--clip", "0.05"],
          LLAMA + ["--tp", "2", "--kv-heads", "1", "--checkpoint", "selective", "--grad-accum", "2", "--n-layer", "3"]]
ON_FOUR = [LLAMA + ["--tp", "4", "--kv-heads", "2", "--clip", "0.05"],
           LLAMA + ["--tp", "4", "--kv-heads", "1", "--sequence-parallel", "--dropout", "0.1", "--checkpoint",
                    "selective", "--clip", "0.05"],
           LLAMA + ["--tp", "2", "--kv-heads", "1", "--zero", "2", "--sequence-parallel", "--clip", "0.05"],
           LLAMA + ["--tp", "2", "--kv-heads", "1", "--zero", "3", "--dropout", "0.1"],
           LLAMA + ["--tp", "2", "--kv-heads", "1", "--pp", "2", "--schedule", "1f1b", "--micro-batches", "4",
                    "--zero", "1"],
           LLAMA + ["--tp", "2", "--kv-heads", "1", "--pp", "2", "--schedule", "zb1p", "--micro-batches", "4",
                    "--sequence-parallel", "--clip", "0.05"]]


@pytest.mark.mpi
@pytest.mark.parametrize("world,configs", [(2, ON_TWO), (4, ON_FOUR)])
def test_replicated_key_value_heads_equal_one_process(world, configs, tmp_path):
    results = verify_all(world, configs, tmp_path)
    for r in results:
        assert r["ok"], (r["flags"], r["problems"], r["tolerance_used"])
    if world == 4:
        assert {r["strategy"] for r in results} >= {"ZeroStage1", "ZeroStage2", "ZeroStage3"}


PLANTED = (
    "import sys\n"
    "from refimpl.parallel.tensor_parallel import gpt\n"
    "bug = sys.argv.pop(1)\n"
    "if bug == 'no-sum':  # the replicas' key/value gradients are not summed\n"
    "    gpt._summed_over = lambda comm: (lambda grad: None)\n"
    "else:  # every replica counts its key/value gradient in the clipping norm\n"
    "    gpt.TensorParallelGPT.uncounted_names = lambda self, names: (\n"
    "        self.whole_names(list(names)) if self.rank > 0 else [])\n"
    "from refimpl.tools.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n")


@pytest.mark.mpi
@pytest.mark.parametrize("bug,flags,times", [("no-sum", [], 1e6), ("norm", ["--clip", "0.05"], 1e4)])
def test_planted_replica_bugs_fail_far_beyond_the_tolerance(tmp_path, bug, flags, times):
    """Measured once: about 9·10⁹ (no sum) and 2·10⁷ (norm) times the tolerance."""
    script = tmp_path / "planted.py"
    script.write_text(PLANTED)
    done = run_mpi(2, [script, bug, "verify", *LLAMA, "--tp", "2", "--kv-heads", "1", *flags, "--json"], timeout=300)
    assert done.returncode == 1, done.stderr[-2000:]
    assert last_json(done)["tolerance_used"] >= times


BYTES = [LLAMA + ["--model", "gpt", "--batch-size", "4", "--dtype", "float64", *f.split()] for f in (
    "--tp 4 --kv-heads 2 --n-layer 2",
    "--tp 4 --kv-heads 1 --n-layer 2 --sequence-parallel --checkpoint every:1 --dropout 0.1",
    "--tp 2 --kv-heads 1 --pp 2 --n-layer 3 --micro-batches 4 --schedule zb1p --sequence-parallel",
    "--tp 2 --kv-heads 1 --n-layer 2 --zero 3")]


@pytest.mark.mpi
def test_replica_sums_are_in_the_bytes_per_step_and_parameters_per_rank(tmp_path):
    """communication.bytes_per_step with kv_replicas (one all-reduce of 2·D·C per block and backward
    over the R replicas) and memory.gpt_parameters with kv_heads, measured on every rank; the whole
    parameters and each head's replicas equal across the group after the steps."""
    path = tmp_path / "bytes.json"
    path.write_text(json.dumps(BYTES))
    results = last_json(run_mpi(4, [PROGRAMS / "tensor_parallel_checks.py", path], timeout=600))
    assert len(results) == len(BYTES)
    for r in results:
        assert r["measured"] == r["expected"] and r["whole_equal"], r
        if "--zero" not in r["flags"] and "--pp" not in r["flags"]:
            assert all(r["ledger_equals_formula"]), r


@pytest.mark.mpi
@pytest.mark.parametrize("world,kv", [(2, 1), (4, 1), (4, 2)])
def test_the_tensor_parallel_command_measures_the_replicated_formulas(world, kv):
    done = run_mpi(world, ["-m", "refimpl", "tensor-parallel", "--arch", "llama", "--kv-heads", kv, "--ffn-size", 40,
                           "--d-model", "16", "--n-head", "4", "--seq-len", "8", "--json"], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = last_json(done)
    rows = result["activations"] + result["bytes"] + result["parameters"]
    assert all(row["formula"] == row["measured"] for row in rows), rows


@pytest.mark.parametrize("tp,kv", [(2, 1), (4, 1), (4, 2)])
def test_each_rank_keeps_its_query_groups_head_and_the_slices_join_to_the_whole(tp, kv):
    cfg = GPTConfig(11, 8, n_layer=2, n_head=4, d_model=16, arch="llama", kv_heads=kv, ffn_size=24, dtype="float64")
    whole = dict(GPT(cfg, seed=1).named_parameters())
    replicas = tp // kv
    held = gpt_parameters(11, 8, 16, 2, tp=tp, arch="llama", kv_width=kv * 4, ffn=24, kv_heads=kv)
    ranks = []
    for rank in range(tp):
        group = ReplicaAwareGroup(tp, rank, replicas)
        model = GPT(cfg, seed=1)
        tp_model = shard_gpt(model, group)
        named = dict(model.named_parameters())
        ranks.append(named)
        head = rank // replicas  # the key/value head of this rank's query group: rows [4·head, 4·head + 4)
        rows = slice(4 * head, 4 * head + 4)
        assert np.array_equal(named["blocks.0.attn.wk.weight"].data, whole["blocks.0.attn.wk.weight"].data[rows])
        assert model.blocks[0].attn.kv_heads == 1 and model.blocks[0].attn.n_head == 4 // tp
        assert sum(p.size for p in model.parameters()) == held["split"] + held["whole"]
        assert tp_model.uncounted_names(["blocks.0.attn.wv.weight"]) == ([] if rank % replicas == 0
                                                                          else ["blocks.0.attn.wv.weight"])
    for name, p in whole.items():
        pieces = [r[name].data for r in ranks]
        joined = tp_model.splits[name].join(pieces) if name in tp_model.splits else pieces[0]
        assert np.array_equal(joined, p.data), name


class ReplicaAwareGroup:
    """A stand-in tp group: size, rank, and split(color) -> the replicas group (its size is all the
    cut reads; its hooks never run here)."""

    def __init__(self, size: int, rank: int, replicas: int) -> None:
        self.size, self.rank, self.replicas = size, rank, replicas

    def split(self, color: int):
        return ReplicaAwareGroup(self.replicas, self.rank % self.replicas, 1)


def test_a_replicated_split_shards_and_joins():
    w = np.arange(24.0).reshape(6, 4)  # 3 heads of 2 rows
    split = WeightSplit(0, replicas=2)
    shards = [split.shard(w, r, 6) for r in range(6)]  # 6 ranks: head r // 2
    assert all(np.array_equal(shards[r], w[2 * (r // 2):2 * (r // 2) + 2]) for r in range(6))
    assert np.array_equal(split.join(shards), w)


@pytest.mark.parametrize("world", [2, 4])
def test_the_sweep_draws_replicated_key_value_heads(world):
    from refimpl.tools.flags import config_from_flags  # noqa: PLC0415 - only here
    from refimpl.tools.sweep import draw_flags, numpy_chooser  # noqa: PLC0415 - only here

    rng = np.random.default_rng(world + 20)
    replicated = set()
    for _ in range(600):
        cfg = config_from_flags(draw_flags(world, numpy_chooser(rng)))
        cfg.check()
        if cfg.arch == "llama" and cfg.kv_heads < cfg.tp:
            assert cfg.tp % cfg.kv_heads == 0 and cfg.cp == 1
            replicated.add((cfg.tp, cfg.kv_heads, cfg.pp > 1))
    expected = {(2, 1, False)} if world == 2 else {(4, 1, False), (4, 2, False), (2, 1, True)}  # (tp, kv, pipeline)
    assert expected <= replicated, replicated
