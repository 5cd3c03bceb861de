"""The memory ledger and the paper's estimator (no MPI): exact bytes, Table 1, units, budgets."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refimpl.autograd.saved import SavedTensorLedger
from refimpl.memory import (
    MemoryLedger,
    OutOfMemoryBudget,
    bytes_per_parameter,
    communication_elements,
    format_gb,
    model_state_bytes,
    paper_table,
    parse_bytes,
    parse_count,
)


def test_ledger_sums_registered_arrays_by_category_with_peaks():
    activations = SavedTensorLedger()
    ledger = MemoryLedger(activations=activations)
    a = ledger.register("parameters", np.zeros(10))  # 80 bytes
    b = ledger.register("gathered_parameters", np.zeros(25, np.float32))  # 100 bytes
    saved = np.zeros(5)
    activations.add(saved)  # 40 bytes saved for backward
    assert ledger.current() == {"parameters": 80, "gradients": 0, "master_weights": 0, "optimizer_states": 0,
                                "gathered_parameters": 100, "gradient_buckets": 0, "activations": 40}
    assert ledger.total == 220
    ledger.release(b)
    activations.remove(saved)
    assert ledger.current()["gathered_parameters"] == 0 and ledger.total == 80
    assert ledger.peak()["gathered_parameters"] == 100 and ledger.peak()["activations"] == 40
    assert ledger.peak_total == 220 and ledger.model_state() == {"parameters": 80, "gradients": 0,
                                                                 "master_weights": 0, "optimizer_states": 0}
    ledger.reset_peak()
    assert ledger.peak_total == 80 and ledger.holds(a) and not ledger.holds(b)
    with pytest.raises(ValueError, match="already registered"):
        ledger.register("gradients", a)
    with pytest.raises(ValueError, match="counted twice"):
        ledger.register("gradients", a[:5])
    with pytest.raises(ValueError, match="unknown memory category"):
        ledger.register("weights", np.zeros(1))


def test_budget_names_the_category_that_overflowed():
    activations = SavedTensorLedger()
    ledger = MemoryLedger(budget=1000, rank=3, activations=activations)
    ledger.register("parameters", np.zeros(100))  # 800 of 1000 bytes
    with pytest.raises(OutOfMemoryBudget) as error:
        ledger.register("optimizer_states", np.zeros(30), "optimizer state shard")
    message = str(error.value)
    assert message.startswith("out of memory on rank 3: allocating 240 B of optimizer states (optimizer state shard)")
    # 1,040 and 1,000 B both round to 1.0 kB, so the message shows the bytes
    assert "needs 1,040 B in all, over the budget of 1,000 B" in message and "held: parameters 800 B" in message
    assert "\n" not in message and isinstance(error.value, ValueError)
    assert ledger.current()["optimizer_states"] == 0  # nothing was counted
    activations.add(np.zeros(30))  # 240 bytes of activations: checked after a forward
    with pytest.raises(OutOfMemoryBudget, match="240 B of activations"):
        ledger.check_activations()
    with pytest.raises(ValueError, match="must be positive"):
        MemoryLedger(budget=0)


def test_the_papers_table_1():
    # Table 1 of arXiv 1910.02054 (mixed-precision Adam, K = 12), decimal GB.
    rows = paper_table(7.5e9, [1, 4, 16, 64, 256, 1024])
    assert [[float(format_gb(b)) for b in row["bytes"].values()] for row in rows] == [
        [120.0] * 6,
        [120.0, 52.5, 35.6, 31.4, 30.4, 30.1],
        [120.0, 41.3, 21.6, 16.6, 15.4, 15.1],
        [120.0, 30.0, 7.5, 1.9, 0.47, 0.12]]
    assert [row["name"] for row in rows] == ["DP", "ZeRO-1", "ZeRO-2", "ZeRO-3"]
    big = paper_table(128e9, [64])  # the paper truncates these columns: 536, 284, 32
    assert [row["bytes"][64] / 1e9 for row in big] == [2048.0, 536.0, 284.0, 32.0]
    trillion = paper_table(1e12, [1024])
    assert trillion[3]["bytes"][1024] / 1e9 == 15.625  # the paper's 15.6


@given(st.integers(1, 10**6), st.integers(1, 64), st.sampled_from(["mixed", "float32", "float64"]))
@settings(max_examples=50)
def test_model_state_formulas_are_exact_integers_on_padded_sizes(psi, n, precision):
    padded = -(-psi // n) * n
    p, g, k = bytes_per_parameter(precision)
    values = [model_state_bytes(s, padded, n, p, g, k) for s in range(4)]
    assert all(isinstance(v, int) for v in values)
    assert values[0] == (p + g + k) * padded and values[3] == (p + g + k) * padded // n
    assert values[0] >= values[1] >= values[2] >= values[3]  # each stage partitions more
    assert values[1] - values[2] == g * padded - g * padded // n
    # ZeRO-3 with every parameter kept whole costs what ZeRO-2 costs
    assert model_state_bytes(3, 0, n, p, g, k, psi_persistent=padded) == values[2]


def test_bytes_per_parameter_and_communication_rules():
    assert bytes_per_parameter("mixed") == (2, 2, 12) and bytes_per_parameter("float32") == (4, 4, 8)
    assert bytes_per_parameter("float64") == (8, 8, 16) and bytes_per_parameter("float32", "sgd") == (4, 4, 4)
    assert bytes_per_parameter("mixed", "sgd") == (2, 2, 8)
    assert [communication_elements(s, 1200, 4) for s in range(4)] == [1800, 1800, 1800, 2700]
    assert [communication_elements(s, 1200, 4, grad_accum=3) for s in range(4)] == [1800, 1800, 3600, 8100]
    assert communication_elements(3, 1000, 4, psi_persistent=200) == 2250 + 300
    with pytest.raises(ValueError, match="unknown ZeRO stage 4"):
        model_state_bytes(4, 10, 2, 4, 4, 8)
    with pytest.raises(ValueError, match="unknown precision"):
        bytes_per_parameter("bfloat16")


def test_units():
    assert parse_count("7.5B") == parse_count("7.5e9") == parse_count("7.5G") == 7_500_000_000
    assert parse_count("350M") == 350_000_000 and parse_count("1T") == 10**12 and parse_count("125000") == 125000
    assert parse_bytes("200MB") == 200_000_000 and parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("1.5GB") == 1_500_000_000 and parse_bytes("4096") == 4096 and parse_bytes("0") == 0
    for bad in ("seven", "7.5X", "-3MB", ""):
        with pytest.raises(ValueError, match="write it like"):
            parse_bytes(bad)
    with pytest.raises(ValueError, match="must be positive"):
        parse_count("0")
    with pytest.raises(ValueError, match="'7.5' is not a whole number; did you forget a suffix"):
        parse_count("7.5")  # 7.5 parameters: surely 7.5B
    with pytest.raises(ValueError, match=r"'1\.2345K' is not a whole number; write it like"):
        parse_count("1.2345K")  # a suffix is there: no hint about one
    assert [format_gb(b) for b in (120e9, 41.25e9, 1.875e9, 0.46875e9, 0.1171875e9)] == \
        ["120.0", "41.3", "1.9", "0.47", "0.12"]
