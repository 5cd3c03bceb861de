"""refimpl/tools/flag_check.py: the trace of one step (forwards and communicator calls in order,
bytes by kind) and the configuration without a flag. The verdicts it gives verify are tested
through the command in tests/test_verify_instrument.py."""

from collections import Counter

import numpy as np

from refimpl.autograd import Tensor
from refimpl.autograd.recording import counting_forwards
from refimpl.parallel.comm import Counters, LocalComm
from refimpl.tools.flag_check import traced_step, without
from refimpl.tools.run import TrainConfig


def test_a_sub_communicators_calls_reach_the_parents_log_in_order_and_bytes_alone_are_not_calls():
    parent = Counters()
    child = Counters(parent)
    parent.log = []
    child.record("allreduce", 64)
    parent.record("send", 8)
    child.record("send", 8, calls=0)  # a ring collective's later message: bytes, not a call
    child.record("allgather", 16)
    assert parent.log == ["allreduce", "send", "allgather"] and child.log is None
    assert parent.bytes("send") == 16 and parent.calls("send") == 1


def test_nested_counters_with_equal_counts_are_each_removed_by_identity():
    x = Tensor(np.ones(3), requires_grad=True)
    with counting_forwards() as outer:
        with counting_forwards(Counter()) as inner:
            (x * 2.0).sum()
        assert inner == outer  # equal counts; leaving removes `inner`, not the first equal counter
        (x * 3.0).sum()
    assert sum(outer.values()) == 2 * sum(inner.values()) > 0


class _Toy:
    """A 'trainer' whose step runs two operations around an all-reduce."""

    def __init__(self, comm) -> None:
        self.comm = comm

    def step(self, x, y):
        h = (Tensor(x, requires_grad=True) * 2.0).sum()
        self.comm.allreduce(np.ones(4))
        return float((h * 1.0).data)


def test_a_traced_step_interleaves_forwards_and_calls_and_counts_bytes():
    comm = LocalComm()
    log, sent = traced_step(_Toy(comm), comm, np.ones(3), None)
    kinds = [entry if isinstance(entry, str) else "forward" for entry in log]
    assert kinds.index("allreduce") > 0 and kinds[-1] == "forward" and kinds.count("allreduce") == 1
    assert sent == (("allreduce", 0),) and comm.counters.log is None  # one rank sends nothing


def test_the_configuration_without_a_flag_resets_what_goes_with_it_and_grows_the_batch():
    cfg = TrainConfig(zero=3, prefetch=500, param_threshold=17, batch_size=6, pp=1)
    base = without(cfg, "--zero", 4)
    assert (base.zero, base.prefetch, base.param_threshold, base.batch_size) == (0, 0, 0, 12)
    piped = TrainConfig(pp=2, schedule="gpipe", micro_batches=3, batch_size=6)
    base = without(piped, "--pp", 4)
    assert (base.pp, base.schedule, base.micro_batches, base.batch_size) == (1, None, None, 12)
    assert without(piped, "--micro-batches", 4).batch_size == 24  # dp 2 x the default 2 pp = 4 micro-batches
    assert without(TrainConfig(dtype="mixed"), "--dtype", 1).dtype == "float64"
