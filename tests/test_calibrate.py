"""`python -m refimpl calibrate` and its fit (refimpl/tools/cluster/calibrate.py). No timing assertions:
the measured numbers are only checked to be positive and finite, and the file to load."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from mpi_util import check_ok, last_json, run_local, run_mpi

from refimpl.tools.cluster import hardware
from refimpl.tools.cluster.calibrate import allreduce_link, block_operations, fit_alpha_beta


def test_fit_recovers_alpha_and_beta_exactly():
    sizes = np.array([8, 1024, 65536, 1 << 20, 1 << 22], dtype=np.float64)
    alpha, beta = 12.5e-6, 3.2e9
    got_alpha, got_beta = fit_alpha_beta(sizes, alpha + sizes / beta)
    assert got_alpha == pytest.approx(alpha, rel=1e-9)
    assert got_beta == pytest.approx(beta, rel=1e-9)


def test_fit_leaves_out_nan_and_refuses_flat_timings():
    sizes = [8, 1024, 65536, 1 << 20]
    times = [1e-6 + n / 1e9 for n in sizes]
    assert fit_alpha_beta(sizes + [4096], times + [math.nan]) == pytest.approx((1e-6, 1e9), rel=1e-9)
    with pytest.raises(ValueError, match="do not grow"):
        fit_alpha_beta(sizes, [1e-3, 1e-3, 1e-3, 1e-3])
    with pytest.raises(ValueError, match="two different"):
        fit_alpha_beta([8, 8], [1e-6, 2e-6])


def test_allreduce_line_gives_the_ring_step():
    """t = 2(g−1)(α + n/(gβ)) on g ranks, fitted as A + S n, gives back α and β."""
    alpha, beta, g = 5e-6, 2e9, 4
    intercept, slope = 2 * (g - 1) * alpha, 2 * (g - 1) / (g * beta)
    assert allreduce_link(intercept, slope, g) == pytest.approx((alpha, beta), rel=1e-12)


def test_block_operations_counts_the_graph():
    assert block_operations() == 21  # 2 layer norms, 4 linears, 1 split, 4 reshapes, 4 transposes, ...
    assert block_operations(dropout=0.1) == 24  # and three dropouts


def test_one_process_writes_a_loadable_file(tmp_path):
    out = tmp_path / "c.json"
    result = last_json(check_ok(run_local(["-m", "refimpl", "calibrate", "--quick", "--output", out, "--json"],
                                          timeout=60)))
    cluster = hardware.load(str(out))
    for name in ("peak_flops", "peak_flops_fp32", "peak_flops_fp64", "memory_bandwidth", "memory_bytes",
                 "intra_bandwidth", "inter_bandwidth", "op_overhead"):
        value = getattr(cluster, name)
        assert math.isfinite(value) and value > 0, name
    assert cluster.gpus_per_node == 1 and not result["links_measured"]
    assert "estimated" in cluster.source
    assert cluster.efficiency["gemm"] == 1.0 and cluster.efficiency["attention"] > 0
    assert json.loads(out.read_text())["name"] == "local"


@pytest.mark.parametrize("output", ["no/such/dir/c.json", "."])
def test_bad_output_is_one_line(output, tmp_path):
    done = run_local(["-m", "refimpl", "calibrate", "--quick", "--output", output], cwd=tmp_path, timeout=60)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --output"), done.stderr


def test_two_ranks_measure_the_links(tmp_path):
    out = tmp_path / "c2.json"
    done = check_ok(run_mpi(2, ["-m", "refimpl", "calibrate", "--quick", "--output", out, "--json"], timeout=90))
    result = last_json(done)
    cluster = hardware.load(str(out))
    assert result["links_measured"] and result["ranks"] == 2 and cluster.gpus_per_node == 2
    assert result["allreduce"]["ring_beta"] == pytest.approx(cluster.intra_bandwidth)
    assert cluster.intra_latency >= 0 and cluster.intra_bandwidth > 0 and "all-reduce fit" in cluster.source
