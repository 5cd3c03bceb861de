"""Property tests: drawn configurations train exactly like one process (float64, rtol 1e-10).

hypothesis draws configurations from the space `verify --sweep` draws from (refimpl/tools/sweep.py:
ZeRO 0-3, built-in and ring collectives, naive and bucketed DDP, gradient accumulation, AdamW and
SGD, clipping, the GPT with dropout and checkpointing that recomputes (>= 4 blocks; every:K, sqrt,
revolve), the MLP, every pipeline schedule with GPT and MLP stages on dp x pp meshes, every ZeRO
stage inside a pipeline), new ones on every run (conftest.py prints the run's seed). Launching mpiexec costs more
than verifying a small configuration, so one launch per world size verifies a whole list
(tests/mpi_programs/verify_many.py, the code `verify` runs). Per run: world sizes 2, 3 and 4
(1 as a small share), DRAWN configurations each, plus the pinned examples below; the deep profile
runs 10 launches per world size. Shrinking is off (a launch takes seconds): a failure lists the
failing configurations with the command that reproduces each.

Pinned examples (@example), the configurations that matter most:
  * ZeRO-3 without clipping (a missing backward re-gather makes NaN gradients), and with prefetch
    and persistent small parameters; ZeRO-2 with accumulation (reduced every micro-batch);
  * ring collectives with gradient accumulation, bucketed and naive, with buckets smaller than a
    parameter; world size 3 (blocks of unequal length, padding);
  * dropout with real recomputation: every:1, sqrt and revolve:1 over 4-5 blocks;
  * DualPipe and DualPipeV (GPT and MLP stages), ZB-V with checkpointing, interleaved on dp 2 x pp 2,
    ZeRO-1, -2 and -3 inside a pipeline (ZeRO-3 with DualPipe's two copies, ZeRO-2 with ZB-H1's
    split backward), an MLP pipeline with 1F1B.
"""

import json

import pytest
from conftest import VERIFIED, launches
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from mpi_util import PROGRAMS, last_json, run_mpi

from refimpl.tools.sweep import SMALL, draw_flags

pytestmark = pytest.mark.mpi

DRAWN = {1: 4, 2: 22, 3: 18, 4: 28}  # 72 drawn configurations per run, plus the pinned ones


def configurations(world: int):
    """A list of DRAWN[world] configurations (flag lists) for `world` ranks, drawn by hypothesis."""
    @st.composite
    def one(draw):
        return draw_flags(world, lambda name, options: draw(st.sampled_from(options)))
    return st.lists(one(), min_size=DRAWN[world], max_size=DRAWN[world])


def pinned(*flag_strings):
    return [SMALL + f.split() for f in flag_strings]


GPT4 = "--model gpt --n-layer 4 --dropout 0.1"
PINNED = {
    1: pinned("--model gpt --n-layer 4 --checkpoint revolve:1 --dropout 0.1 --zero 3 --clip 0",
              "--model mlp --schedule dualpipev --pp 1 --micro-batches 2 --n-layer 1 --batch-size 4"),
    2: pinned("--model gpt --n-layer 2 --collectives ring --dp-mode naive --grad-accum 3 --batch-size 12",
              "--model gpt --n-layer 2 --schedule dualpipe --pp 2 --micro-batches 4 --batch-size 8 --dropout 0.1",
              "--model mlp --n-layer 3 --schedule 1f1b --pp 2 --micro-batches 3 --batch-size 6",
              "--model gpt --n-layer 5 --checkpoint sqrt --dropout 0.1 --zero 2 --grad-accum 2 --batch-size 8"),
    3: pinned("--model gpt --n-layer 1 --zero 1 --collectives ring --grad-accum 2 --batch-size 12 --bucket-bytes 64",
              "--model gpt --n-layer 1 --zero 3 --clip 0 --collectives ring --batch-size 6",
              "--model mlp --n-layer 2 --zero 2 --grad-accum 2 --batch-size 6 --optimizer sgd",
              "--model gpt --n-layer 3 --schedule zbh2 --pp 3 --micro-batches 3 --batch-size 6"),
    4: pinned("--model gpt --n-layer 2 --zero 3 --clip 0",
              "--model gpt --n-layer 2 --zero 3 --prefetch 500 --param-threshold 17 --grad-accum 2 --batch-size 16",
              "--model gpt --n-layer 2 --zero 2 --grad-accum 3 --batch-size 24 --bucket-bytes 1000",
              "--model gpt --n-layer 2 --collectives ring --grad-accum 2 --batch-size 16 --bucket-bytes 64",
              f"{GPT4} --checkpoint every:1 --batch-size 8",
              f"{GPT4} --checkpoint revolve:1 --zero 1 --batch-size 8 --n-layer 5",
              "--model gpt --n-layer 8 --schedule zbv --pp 2 --micro-batches 4 --batch-size 16 --checkpoint sqrt",
              "--model gpt --n-layer 4 --schedule interleaved --pp 2 --micro-batches 2 --batch-size 8",
              "--model gpt --n-layer 4 --schedule dualpipev --pp 2 --micro-batches 4 --batch-size 16 --zero 1",
              "--model mlp --n-layer 3 --schedule dualpipe --pp 4 --micro-batches 8 --batch-size 16",
              "--model gpt --n-layer 2 --schedule zb1p --pp 2 --micro-batches 4 --batch-size 16 --zero 2 "
              "--bucket-bytes 1000 --dropout 0.1",
              "--model gpt --n-layer 2 --schedule dualpipe --pp 2 --micro-batches 4 --batch-size 16 --zero 3 "
              "--param-threshold 17"),
}


def verify_many(world: int, configs: list, tmp_path_factory) -> list:
    path = tmp_path_factory.mktemp("drawn") / "configs.json"
    path.write_text(json.dumps(configs))
    done = run_mpi(world, [PROGRAMS / "verify_many.py", path], timeout=900)
    if done.returncode != 0:
        raise AssertionError(f"verify_many at {world} ranks exited {done.returncode}\n"
                             f"{done.stdout[-3000:]}\n{done.stderr[-5000:]}")
    results = last_json(done)
    failed = [r for r in results if not r["ok"]]
    print(f"verified {len(results)} configurations at {world} rank(s), {len(failed)} failed")  # the count, with -s
    assert not failed, "\n".join(
        f"FAIL (tolerance used {r['tolerance_used']:.3g}): mpiexec -n {world} python -m refimpl verify "
        f"{' '.join(r['flags'])}\n    " + "\n    ".join(r["problems"][:3]) for r in failed)
    assert len(results) == len(configs)
    VERIFIED.append((world, len(results)))
    return results


def drawn_test(world: int):
    @settings(max_examples=launches(1), deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate],
              suppress_health_check=list(HealthCheck))
    @example(configs=PINNED[world])
    @given(configs=configurations(world))
    def test(configs, tmp_path_factory):
        verify_many(world, configs, tmp_path_factory)
    return test


test_drawn_configurations_at_1_rank_equal_single_process_training = drawn_test(1)
test_drawn_configurations_at_2_ranks_equal_single_process_training = drawn_test(2)
test_drawn_configurations_at_3_ranks_equal_single_process_training = drawn_test(3)
test_drawn_configurations_at_4_ranks_equal_single_process_training = drawn_test(4)


def test_each_run_verifies_at_least_72_drawn_configurations():
    # three times the 8 + 4 + 12 configurations the drawn tests launched before they shared launches
    assert sum(DRAWN.values()) * launches(1) >= 72
    assert DRAWN[1] < min(DRAWN[2], DRAWN[3], DRAWN[4])  # one rank only as a small share
