"""auto:memory and auto:speed with every trainer: `verify` against single-process training (2 ranks).

Pinned configurations: data parallelism and each ZeRO stage, pipeline stages (each stage's graph,
split backward included), tensor and sequence parallelism, experts with expert parallelism (also
with routing that gives the ranks tensors of different sizes) and DualPipeV's overlapped F&B
steps, ZeRO-3 (recomputation gathers the parameters again) inside a pipeline. All with dropout,
float64, 2 steps.
"""

import pytest
from mpi_util import run_local, run_mpi_json

BASE = ["-m", "refimpl", "verify", "--model", "gpt", "--d-model", "8", "--n-head", "2", "--seq-len", "8",
        "--steps", "2", "--dtype", "float64", "--dropout", "0.1", "--json"]
PINNED = [
    "--zero 0 --n-layer 3 --batch-size 4 --checkpoint auto:memory",
    "--zero 1 --n-layer 3 --batch-size 4 --checkpoint auto:speed",
    "--zero 2 --n-layer 3 --batch-size 4 --checkpoint auto:memory --grad-accum 2",
    "--zero 3 --n-layer 3 --batch-size 4 --checkpoint auto:memory",
    "--pp 2 --schedule zb1p --micro-batches 4 --n-layer 4 --batch-size 4 --checkpoint auto:memory",
    "--zero 3 --pp 2 --schedule 1f1b --micro-batches 2 --n-layer 4 --batch-size 4 --checkpoint auto:speed",
    "--tp 2 --n-layer 3 --batch-size 2 --checkpoint auto:memory",
    "--tp 2 --sequence-parallel --n-layer 3 --batch-size 2 --checkpoint auto:speed",
    "--experts 4 --top-k 2 --ep 2 --n-layer 3 --batch-size 4 --checkpoint auto:memory",
    # routing gives the ranks tensors of different sizes: both must still choose the same checkpoints
    "--experts 4 --top-k 1 --ep 2 --capacity-factor 1.0 --n-layer 5 --batch-size 4 --seed 1 --checkpoint auto:memory",
    "--pp 2 --schedule dualpipev --micro-batches 4 --n-layer 4 --batch-size 4 --experts 4 --checkpoint auto:memory",
]


@pytest.mark.parametrize("flags", PINNED)
def test_auto_plans_verify_against_single_process_training(flags):
    result = run_mpi_json(2, BASE + flags.split(), timeout=300)
    assert result["ok"] is True and result["problems"] == [], result
    assert result["configuration"]["flags"]["--checkpoint"] == flags.split("--checkpoint ")[1].split()[0]


def test_partition_activations_with_an_auto_plan_is_one_clear_line():
    done = run_local(BASE + "--tp 2 --partition-activations --n-layer 3 --batch-size 2 --checkpoint "
                            "auto:memory".split())
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and \
        "keeps tensors of the graph instead" in lines[0], done.stderr
