"""The Llama block (--arch llama) through pipelines and tensor parallelism, against one process.

Every configuration is a `verify` command line (float64, rtol 1e-10 against single-process
training); many run in one MPI launch (tests/mpi_programs/verify_many.py). Pipelines: every
schedule at pp 2 and pp 4, dp 2 x pp 2, with ZeRO, checkpointing, dropout and mixed precision.
Tensor parallelism: query and key/value heads split over tp (kv-heads divisible by tp), SwiGLU's
w1/w3 column-parallel and w2 row-parallel, with and without sequence parallelism, tp x pp, dp x tp
with ZeRO 1-3. What is not implemented is refused in one line.
"""

import json

import numpy as np
import pytest
from mpi_util import PROGRAMS, last_json, run_mpi

from refimpl.memory import gpt_parameters
from refimpl.nn import GPT, GPTConfig
from refimpl.parallel.tensor_parallel import shard_gpt
from refimpl.parallel.tensor_parallel.communication import StepShape, elements_per_step
from refimpl.tools import cli
from refimpl.tools.flags import config_from_flags
from refimpl.tools.sweep import draw_flags, numpy_chooser

LLAMA = ["--arch", "llama", "--kv-heads", "2", "--ffn-size", "24", "--d-model", "16", "--n-head", "4", "--seq-len", "8",
         "--steps", "2"]
SCHEDULES = ["gpipe", "1f1b", "interleaved", "zb1p", "zbh2", "zbv", "dualpipe", "dualpipev"]
TWO_STAGES_PER_RANK = {"interleaved", "zbv", "dualpipev"}  # need twice the blocks


def pipeline(schedule: str, pp: int, micro_batches: int, *extra: str) -> list:
    blocks = 2 * pp if schedule in TWO_STAGES_PER_RANK else pp
    return LLAMA + ["--n-layer", str(blocks), "--pp", str(pp), "--schedule", schedule,
                    "--micro-batches", str(micro_batches), *extra]


ON_TWO = [pipeline(s, 2, 4, "--batch-size", "8") for s in SCHEDULES]
ON_TWO += [pipeline("gpipe", 2, 2, "--batch-size", "8", "--checkpoint", "sqrt", "--n-layer", "4"),
           pipeline("1f1b", 2, 4, "--batch-size", "8", "--zero", "1", "--checkpoint", "selective"),
           pipeline("zb1p", 2, 4, "--batch-size", "8", "--zero", "3", "--kv-heads", "1"),
           pipeline("dualpipe", 2, 4, "--batch-size", "8", "--zero", "2", "--dropout", "0.1"),
           pipeline("1f1b", 2, 4, "--batch-size", "8", "--dtype", "mixed", "--steps", "3")]  # float16's lockstep bounds
ON_TWO += [LLAMA + ["--batch-size", "8", "--tp", "2"],
           LLAMA + ["--batch-size", "8", "--tp", "2", "--sequence-parallel", "--clip", "0.05"],
           LLAMA + ["--batch-size", "8", "--tp", "2", "--kv-heads", "4", "--ffn-size", "20", "--dropout", "0.1",
                    "--checkpoint", "selective"],
           LLAMA + ["--batch-size", "8", "--tp", "2", "--sequence-parallel", "--dropout", "0.1", "--checkpoint",
                    "every:1", "--grad-accum", "2"],
           LLAMA + ["--batch-size", "8", "--tp", "2", "--partition-activations", "--checkpoint", "every:1",
                    "--optimizer", "sgd"]]

ON_FOUR = [pipeline(s, 4, 8, "--batch-size", "16") for s in ("gpipe", "1f1b", "zb1p", "dualpipe", "dualpipev")]
ON_FOUR += [pipeline(s, 2, 4, "--batch-size", "16", "--n-layer", "4") for s in ("1f1b", "dualpipe")]  # dp 2 x pp 2
ON_FOUR += [pipeline(s, 2, 4, "--batch-size", "8", "--tp", "2") for s in ("gpipe", "1f1b", "zb1p", "dualpipe")]
ON_FOUR += [pipeline("1f1b", 2, 4, "--batch-size", "8", "--tp", "2", "--sequence-parallel"),
            pipeline("zb1p", 2, 4, "--batch-size", "8", "--tp", "2", "--sequence-parallel", "--zero", "1"),
            LLAMA + ["--batch-size", "8", "--tp", "2", "--zero", "2", "--sequence-parallel"],  # dp 2 x tp 2
            LLAMA + ["--batch-size", "8", "--tp", "2", "--zero", "3", "--sequence-parallel", "--dropout", "0.1"],
            LLAMA + ["--batch-size", "8", "--tp", "4", "--kv-heads", "4", "--sequence-parallel"]]


def verify_all(n: int, configs: list, tmp_path) -> list:
    path = tmp_path / f"llama_on_{n}.json"
    path.write_text(json.dumps(configs))
    done = run_mpi(n, [PROGRAMS / "verify_many.py", path], timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = last_json(done)
    assert len(results) == len(configs)
    return results


@pytest.mark.mpi
def test_llama_pipelines_and_tensor_parallelism_on_two_ranks_equal_one_process(tmp_path):
    for r in verify_all(2, ON_TWO, tmp_path):
        assert r["ok"], (r["flags"], r["problems"], r["tolerance_used"])
        assert r["trainer"] == "Trainer"


@pytest.mark.mpi
def test_llama_pipelines_and_tensor_parallelism_on_four_ranks_equal_one_process(tmp_path):
    results = verify_all(4, ON_FOUR, tmp_path)
    for r in results:
        assert r["ok"], (r["flags"], r["problems"], r["tolerance_used"])
    zero = {r["strategy"] for r in results if "--zero" in r["flags"]}
    assert zero == {"ZeroStage1", "ZeroStage2", "ZeroStage3"}


@pytest.mark.parametrize("flags,message", [
    (["--n-head", "12", "--d-model", "48", "--kv-heads", "3", "--tp", "4"],
     "error: --tp 4 is more than --kv-heads 3 and not a multiple of it"),
    (["--n-head", "12", "--d-model", "48", "--kv-heads", "6", "--tp", "4"],
     "error: --tp 4 does not divide --kv-heads 6"),
    (["--kv-heads", "1", "--tp", "2", "--cp", "2"], "error: --cp 2 with --tp 2 larger than --kv-heads 1"),
    (["--experts", "2", "--tp", "2"], "error: --experts with --tp is not supported yet"),
])
def test_what_does_not_run_with_llama_is_refused_in_one_line(flags, message, capsys):
    assert cli.main(["train", "--arch", "llama", "--steps", "1", *flags]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(message) and err.count("\n") == 1, err


# --- the tensor-parallel accounting --------------------------------------------------------------
TP_BYTES = [LLAMA + ["--model", "gpt", "--batch-size", "4", "--dtype", "float64", *f.split()] for f in (
    "--tp 2 --n-layer 2",
    "--tp 2 --n-layer 3 --sequence-parallel --checkpoint every:1 --dropout 0.1",
    "--tp 2 --pp 2 --n-layer 3 --micro-batches 4 --sequence-parallel --schedule zb1p",
    "--tp 4 --kv-heads 4 --n-layer 2 --sequence-parallel --zero 3",
    "--tp 2 --n-layer 4 --checkpoint every:1 --partition-activations")]


@pytest.mark.mpi
def test_llama_tp_bytes_per_step_and_parameters_per_rank_equal_the_formulas(tmp_path):
    """Bytes each rank sends on its tp group in a step (communication.bytes_per_step with arch "llama"),
    by kind; the RMSNorm gains equal on every tp rank; the ledger's model state = memory's Ψ per rank."""
    path = tmp_path / "bytes.json"
    path.write_text(json.dumps(TP_BYTES))
    results = last_json(run_mpi(4, [PROGRAMS / "tensor_parallel_checks.py", path], timeout=600))
    assert len(results) == len(TP_BYTES)
    for r in results:
        assert r["measured"] == r["expected"], r
        assert r["whole_equal"], r["flags"]
        assert all(sum(m.values()) > 0 for m in r["measured"]), r
        if "--zero" not in r["flags"] and "--pp" not in r["flags"]:
            assert all(r["ledger_equals_formula"]), r


def test_llama_sequence_parallel_traffic_differs_from_gpt2_by_the_re_gather_and_the_biases():
    """N = 32 tokens, C = 16, L = 3 blocks, T_max = 8, one micro-batch, embedding and head held."""
    shape = dict(tokens=32, width=16, blocks=3, micro_batches=1, max_positions=8)
    llama = elements_per_step(StepShape(**shape, arch="llama"), sequence_parallel=True)
    gpt2 = elements_per_step(StepShape(**shape), sequence_parallel=True)
    assert llama == {"allreduce": (2 * 3 + 1) * 16 + 3 * 32, "allgather": (4 * 3 + 2 + 1) * 32 * 16,
                     "reduce_scatter": (4 * 3 + 2) * 32 * 16}
    assert gpt2["allgather"] - llama["allgather"] == 2 * 3 * 32 * 16  # GPT-2's re-gathers in the blocks
    assert gpt2["allreduce"] - llama["allreduce"] == (4 * 3 + 1 + 8) * 16  # LayerNorm biases, proj biases, wpe
    plain = dict(shape, arch="llama")
    assert elements_per_step(StepShape(**plain), False) == elements_per_step(StepShape(**shape), False)


class GroupOf:
    """What shard_gpt reads of a tensor-parallel group while cutting: its size and this rank."""

    def __init__(self, size: int, rank: int) -> None:
        self.size, self.rank = size, rank


@pytest.mark.parametrize("tp,kv,ffn,tied", [(1, 4, 24, False), (2, 2, 24, False), (4, 4, 40, True), (2, 4, 20, True)])
def test_llama_parameters_per_rank_are_the_built_slices(tp, kv, ffn, tied):
    """memory.gpt_parameter_tensors(arch "llama", tp) against what tensor_parallel/gpt.py keeps on each
    rank; the slices of every rank put back together are the whole model's weights."""
    cfg = GPTConfig(11, 8, n_layer=2, n_head=4, d_model=16, arch="llama", kv_heads=kv, ffn_size=ffn, tie_weights=tied,
                    dtype="float64")
    whole = dict(GPT(cfg, seed=1).named_parameters())
    held = gpt_parameters(11, 8, 16, 2, tp=tp, tied=tied, arch="llama", kv_width=kv * 4, ffn=ffn)
    ranks = []
    for rank in range(tp):
        model = GPT(cfg, seed=1)
        split = shard_gpt(model, GroupOf(tp, rank)).splits
        ranks.append(dict(model.named_parameters()))
        assert sum(p.size for p in model.parameters()) == held["split"] + held["whole"]
        assert sum(p.size for name, p in model.named_parameters() if name not in split) == held["whole"] == 16 * 5
    assert list(ranks[0]) == list(whole)  # the single-process names, in order
    for name, p in whole.items():
        pieces = [r[name].data for r in ranks]
        joined = split[name].join(pieces) if name in split else pieces[0]
        assert np.array_equal(joined, p.data), name


@pytest.mark.mpi
@pytest.mark.parametrize("world,kv,ffn", [(2, 2, 48), (4, 4, 40)])
def test_the_tensor_parallel_command_measures_llamas_formulas(world, kv, ffn):
    """Saved bytes per block in every mode (memory.saved_elements_per_block, arch "llama"), bytes per
    step by kind and parameters per rank: each measurement equals its formula (exit 1 otherwise)."""
    done = run_mpi(world, ["-m", "refimpl", "tensor-parallel", "--arch", "llama", "--kv-heads", kv, "--ffn-size", ffn,
                           "--d-model", "16", "--n-head", "4", "--seq-len", "8", "--json"], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = last_json(done)
    rows = result["activations"] + result["bytes"] + result["parameters"]
    assert len(result["activations"]) == 7 and len(result["bytes"]) == 6
    assert all(row["formula"] == row["measured"] for row in rows), rows
    assert all(row["measured"] > 0 for row in result["activations"] + result["parameters"])
    by_mode = {row["mode"]: row["measured"] for row in result["activations"]}
    assert by_mode["full recomputation + Pa"] * world == by_mode["full recomputation (every:1)"]
    # sequence parallelism cuts the norms' x̂ and 1/rms and the two residual dropout masks (dropout 0.1),
    # (2 + 2)·N·h + 2N elements, to 1/t; the projections' gathered inputs stay whole (8 bytes each, N = b·s)
    N, h = 2 * 8, 16
    assert by_mode["tensor parallel"] - by_mode["+ sequence parallel"] == 8 * (4 * N * h + 2 * N) * (world - 1) // world


# --- the drawn configurations (verify --sweep, tests/test_verify_drawn.py) ------------------------
@pytest.mark.parametrize("world", [2, 4])
def test_the_sweep_draws_valid_llama_configurations_through_every_parallelism(world):
    """draw_flags gives Llama's block to about half the GPTs: every one passes the command line's
    checks, and across draws they meet tp (with sequence parallelism), pipelines, tp x pp, every ZeRO
    stage and multi-query, grouped and multi-head attention (with experts: tests/test_llama_experts.py)."""
    rng = np.random.default_rng(world)
    seen = set()
    for _ in range(600):
        flags = draw_flags(world, numpy_chooser(rng))
        cfg = config_from_flags(flags)
        cfg.check()
        if cfg.arch != "llama":
            continue
        assert cfg.n_head % cfg.kv_heads == 0 and (cfg.experts == 0 or cfg.tp == 1)
        assert cfg.kv_heads % cfg.tp == 0 or (cfg.tp % cfg.kv_heads == 0 and cfg.cp == 1)
        assert cfg.ffn_size % cfg.tp == 0
        seen |= {("tp", cfg.tp), ("sp", cfg.sequence_parallel), ("pp", cfg.pp > 1), ("zero", cfg.zero),
                 ("kv", "multi-query" if cfg.kv_heads == 1 else "multi-head" if cfg.kv_heads == cfg.n_head else "gqa")}
        if cfg.tp > 1 and cfg.pp > 1:
            seen.add("tp x pp")
    assert {("tp", 2), ("sp", True), ("pp", True), ("kv", "multi-query"), ("kv", "multi-head"), ("kv", "gqa")} <= seen
    assert {("zero", z) for z in range(4)} <= seen
    if world == 4:
        assert {("tp", 4), "tp x pp"} <= seen, seen
