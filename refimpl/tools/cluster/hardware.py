"""A cluster, as the cost model sees it: one GPU's rates, and the two kinds of link between GPUs.

    peak_flops          dense 16-bit tensor-core FLOP/s of one GPU (the MFU denominator)
    peak_flops_fp32     FLOP/s for float32 arithmetic (--dtype float32)
    memory_bandwidth    bytes/s of the GPU's own memory (HBM): the rate of memory-bound kernels
    memory_bytes        what one GPU can hold
    gpus_per_node       GPUs joined by the fast intra-node fabric (NVLink / NVSwitch)
    intra_bandwidth     bytes/s one GPU sends to the others in its node, one direction
    intra_latency       α of an intra-node message, seconds
    inter_bandwidth     bytes/s one GPU sends to other nodes, one direction (its own NIC)
    inter_latency       α of an inter-node message, seconds
    op_overhead         seconds every kernel (every operation) costs however small: the launch on
                        a GPU, the Python interpreter for refimpl's NumPy engine
    peak_flops_fp64     FLOP/s for float64 (0: half the float32 rate)
    efficiency          the shares of peak the kernels reach ({"gemm", "attention", "memory",
                        "network"}, model.Efficiency); empty: the model's one fixed set. A
                        calibrated machine stores measured, sustained rates, so its file says 1.0

Presets, from the vendors' data sheets (bandwidths are per direction: NVIDIA quotes NVLink as both
directions together, and InfiniBand in bits):

    a100-80gb  DGX A100 (NVIDIA A100 Tensor Core GPU data sheet; DGX A100 system architecture
               white paper): A100 SXM4 80 GB, 312 TFLOP/s dense BF16/FP16, 19.5 TFLOP/s FP32,
               2.039 TB/s HBM2e, 81920 MiB; third-generation NVLink 600 GB/s (both directions)
               through NVSwitch, 8 GPUs per node; 8 × 200 Gb/s HDR InfiniBand, one per GPU.
    h100-80gb  DGX H100 (NVIDIA H100 Tensor Core GPU data sheet; DGX H100 user guide): H100 SXM5
               80 GB, 989 TFLOP/s dense BF16/FP16 (1979 with sparsity), 67 TFLOP/s FP32,
               3.35 TB/s HBM3, 81559 MiB; fourth-generation NVLink 900 GB/s (both directions),
               8 GPUs per node; 8 × 400 Gb/s NDR InfiniBand, one per GPU.

Latencies are not on data sheets: 5 µs inside a node and 10 µs across nodes are the order of
NCCL's small-message times on such systems; they matter only for small messages. The kernel
overhead, 5 µs, is likewise an order of magnitude. `python -m refimpl calibrate` measures every
field for the machine it runs on and writes them as a JSON file that --cluster reads.
"""

from __future__ import annotations

import json
import math
import os
import stat
from dataclasses import MISSING, asdict, dataclass, field, fields

MIB = 2**20
EFFICIENCY_KEYS = ("gemm", "attention", "memory", "network", "optimizer")  # model.Efficiency's fields


def _finite(value) -> bool:
    """A JSON number (not a bool: True is no GPU count) that is finite as a float (not 10**400, inf, nan)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


@dataclass(frozen=True)
class Cluster:
    name: str
    peak_flops: float
    peak_flops_fp32: float
    memory_bandwidth: float
    memory_bytes: int
    gpus_per_node: int
    intra_bandwidth: float
    intra_latency: float
    inter_bandwidth: float
    inter_latency: float
    op_overhead: float = 5e-6
    peak_flops_fp64: float = 0.0
    efficiency: dict = field(default_factory=dict)
    source: str = ""

    def __post_init__(self):
        for name in ("name", "source"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"cluster: {name} must be a string; got {_shown(getattr(self, name))}")
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("name", "source", "efficiency"):
                continue
            may_be_zero = f.name in ("op_overhead", "intra_latency", "inter_latency", "peak_flops_fp64")
            if not _finite(value) or value < 0 or (value == 0 and not may_be_zero):
                rule = "a number >= 0 (finite)" if may_be_zero else "a positive number (finite)"
                raise ValueError(f"cluster {self.name!r}: {f.name} must be {rule}; got {_shown(value)}")
        if int(self.gpus_per_node) != self.gpus_per_node:
            raise ValueError(f"cluster {self.name!r}: gpus_per_node must be a whole number; got {self.gpus_per_node}")
        if not isinstance(self.efficiency, dict):
            raise ValueError(f"cluster {self.name!r}: efficiency must be an object of shares, e.g. "
                             f'{{"gemm": 0.7}}; got {_shown(self.efficiency)}')
        for key, value in self.efficiency.items():
            if key not in EFFICIENCY_KEYS:
                raise ValueError(f"cluster {self.name!r}: unknown efficiency {_shown(key)} (known: "
                                 f"{', '.join(EFFICIENCY_KEYS)})")
            if not ((value is None and key == "optimizer") or (_finite(value) and value > 0)):
                raise ValueError(f"cluster {self.name!r}: efficiency {key!r} must be a positive number (finite); got "
                                 f"{_shown(value)}")

    def flops(self, dtype: str) -> float:
        """The arithmetic rate of `dtype` ("mixed" and "bf16": 16-bit tensor cores, whose float16 and
        bfloat16 rates are the same on the A100 and H100; "float32"; "float64")."""
        if dtype == "float64":
            return self.peak_flops_fp64 or self.peak_flops_fp32 / 2
        return self.peak_flops if dtype in ("mixed", "bf16") else self.peak_flops_fp32

    def as_dict(self) -> dict:
        return asdict(self)


PRESETS = {
    "a100-80gb": Cluster(
        name="a100-80gb", peak_flops=312e12, peak_flops_fp32=19.5e12, memory_bandwidth=2.039e12,
        memory_bytes=81920 * MIB, gpus_per_node=8, intra_bandwidth=300e9, intra_latency=5e-6,
        inter_bandwidth=200e9 / 8, inter_latency=10e-6,
        source="DGX A100: A100 SXM4 80GB data sheet; NVLink 3 600 GB/s bidirectional; 8 x 200 Gb/s HDR IB"),
    "h100-80gb": Cluster(
        name="h100-80gb", peak_flops=989e12, peak_flops_fp32=67e12, memory_bandwidth=3.35e12,
        memory_bytes=81559 * MIB, gpus_per_node=8, intra_bandwidth=450e9, intra_latency=5e-6,
        inter_bandwidth=400e9 / 8, inter_latency=10e-6,
        source="DGX H100: H100 SXM5 80GB data sheet; NVLink 4 900 GB/s bidirectional; 8 x 400 Gb/s NDR IB"),
}
LOCAL_FILE = "local-cluster.json"  # what `python -m refimpl calibrate` writes by default
MAX_FILE_BYTES = 1 << 20  # a cluster file is a few hundred bytes; read at most this much


def _no_constant(name: str):
    raise ValueError(f"{name} is not a finite number")


def read_json(path: str, what: str, limit: int = MAX_FILE_BYTES):
    """The JSON value in the regular file `path`: anything else (a FIFO, a device, a directory) refused before it is
    opened, at most `limit` bytes read, NaN and Infinity refused; a ValueError of one line otherwise."""
    try:
        info = os.stat(path)
    except OSError as error:
        raise ValueError(f"cannot read {what} {path}: {error.strerror or error}") from None
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"{what} {path} is not a regular file (a directory, FIFO or device); give a JSON file")
    if info.st_size > limit:
        raise ValueError(f"{what} {path} is {info.st_size:,} bytes, over the limit of {limit:,}; is it the right file?")
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
        if len(data) > limit:
            raise ValueError(f"{what} {path} is over the limit of {limit:,} bytes; is it the right file?")
        return json.loads(data.decode("utf-8"), parse_constant=_no_constant)
    except OSError as error:
        raise ValueError(f"cannot read {what} {path}: {error.strerror or error}") from None
    except UnicodeDecodeError:
        raise ValueError(f"cannot read {what} {path}: not UTF-8 text") from None
    except RecursionError:
        raise ValueError(f"cannot read {what} {path}: nested too deeply") from None
    except ValueError as error:  # json.JSONDecodeError, NaN / Infinity, a number too long to convert
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ValueError(f"cannot read {what} {path}: {message}") from None


def load(name_or_file: str) -> Cluster:
    """A preset by name, or a JSON file with the Cluster's fields ("local": the calibration's file)."""
    if name_or_file in PRESETS:
        return PRESETS[name_or_file]
    path = LOCAL_FILE if name_or_file == "local" else name_or_file
    if not os.path.exists(path):
        hint = ("run `python -m refimpl calibrate` first to measure this machine" if name_or_file == "local"
                else f"choose a preset ({', '.join(PRESETS)}) or give a JSON file")
        raise ValueError(f"unknown cluster {name_or_file!r}: no such preset or file; {hint}")
    values = read_json(path, "cluster file")
    if not isinstance(values, dict):
        raise ValueError(f"cluster file {path}: the top level must be a JSON object of the Cluster's fields; got "
                         f"{type(values).__name__ if not isinstance(values, list) else 'a list'}")
    known = {f.name for f in fields(Cluster)}
    unknown = sorted(set(values) - known)
    missing = sorted(f.name for f in fields(Cluster) if f.name not in values and f.default is MISSING)
    if unknown or missing:
        raise ValueError(f"cluster file {path}: " + "; ".join(
            ([f"unknown field(s) {', '.join(unknown)}"] if unknown else []) +
            ([f"missing field(s) {', '.join(missing)}"] if missing else [])) +
            f" (fields: {', '.join(sorted(known))})")
    try:
        return Cluster(**values)
    except ValueError as error:
        raise ValueError(f"cluster file {path}: {error}") from None


def save(cluster: Cluster, path: str) -> None:
    with open(path, "w") as f:
        json.dump(cluster.as_dict(), f, indent=2)
        f.write("\n")
