"""A wait is described by world ranks: a point-to-point request remembers its peer by its rank in
the communicator, and the watchdog translates it (on a sub-communicator the two differ)."""

from types import SimpleNamespace

import numpy as np

from refimpl.parallel.comm import LocalComm
from refimpl.tools.runtime.watchdog import describe_wait


def test_a_peer_is_named_by_its_world_rank():
    pipeline = SimpleNamespace(size=2, world_ranks=(1, 3))  # ranks 1 and 3 of the world, as ranks 0 and 1
    assert describe_wait(pipeline, "wait for irecv", 1) == "wait for irecv from rank 3"
    assert describe_wait(pipeline, "wait for isend", 0) == "wait for isend to rank 1"
    assert describe_wait(pipeline, "send", 1) == "send to rank 3"
    assert describe_wait(pipeline, "allreduce", None) == "allreduce over ranks 1, 3"


def test_a_point_to_point_request_hands_its_peer_to_the_wait():
    waits = []

    class Recording(LocalComm):
        def _wait_all(self, handles, what="wait", peer=None):
            waits.append((what, peer))
            super()._wait_all(handles, what, peer)

    comm = Recording()
    sent = comm.isend(np.ones(3), 0, tag=5)
    received = comm.irecv(np.empty(3), 0, tag=5)
    received.wait()
    sent.wait()
    assert ("wait for irecv", 0) in waits and all(peer == 0 for what, peer in waits if "isend" in what)
