"""A watchdog that turns a hang into an error naming the ranks that did not arrive.

MPI has no timeouts. A rank that waits in a collective or a receive for a peer that is stopped
(SIGSTOP, a lost node), stuck in a loop, or waiting in another collective, waits forever. PyTorch's
process groups turn such hangs into errors with a watchdog thread and a timeout (the `timeout`
argument of torch.distributed.init_process_group); refimpl does the same, and because asking every
rank what it is doing costs a few small messages, it also says who is missing and where.

How it works:
  * The main thread says what it waits for: every blocking call of MPIComm runs inside
    `watchdog.waiting(comm, kind, peer)`. Leaving a wait marks progress, and so does `progress()`,
    which the training loops call after each step, verify's single-process reference after each of
    its steps, checkpoints after each file and the pipeline executor after each action.
  * A daemon thread on every rank wakes every POLL_S seconds. It answers the other ranks' questions,
    and once its own main thread has waited `timeout` seconds in one call, or has computed for
    `timeout` seconds since its last progress point, it asks every rank, over a private duplicate
    of COMM_WORLD: "what are you doing, and when did you last make progress?"
    A rank answers "waiting in <call> for <s> seconds" or "running at <file:line in function>,
    last progress <s> ago"; a rank that does not answer within ANSWER_S is stopped, gone, or holds
    Python's GIL in one long C call.
  * The verdict (`verdict`, a pure function): the job is hung when no rank that is *running* (not
    waiting) has made progress for `timeout` seconds -- a rank that computes, saves, or runs
    verify's single-process reference keeps the job alive -- and, when every rank answers that it
    waits (a deadlock: mismatched collectives), when every one of them has waited `timeout` seconds.
    Then the rank prints one report and aborts the job (MPI_Abort, exit status 1):

        [rank 0] watchdog: no progress for 300 s. Did not arrive: rank 2 (running refimpl/tools/run.py:212
        in train, no progress for 301 s); rank 3 (no answer: stopped, exited, or its node is lost).
        Waiting: ranks 0, 1 in allreduce over ranks 0-3 (for 300 s). If a step really takes this
        long, raise --timeout (0 turns the watchdog off).

    Otherwise it asks again every RECHECK_S seconds. When every rank computes (a plug-in that loops
    or sleeps, a step longer than the timeout), the report says so and where each rank is. The
    timeout counts from each rank's last progress point, so one action (or one step of verify's
    reference) that computes longer than `--timeout` is reported as a hang: raise --timeout for
    such runs. A rank stuck inside one C call (a huge matrix product) holds Python's GIL and cannot
    answer, nor be interrupted: it is reported as silent and the job is aborted.

Bound: a hang is reported at most timeout + RECHECK_S + ANSWER_S + POLL_S + LOWER_RANK_FIRST_S
(< timeout + 10 s) after the last moment any rank made progress. When several ranks see the hang,
the lowest one reports it and the others give it a second to do so. Cost: setting two attributes
around each blocking call, and a thread that wakes twice a second to probe for a message
(benchmarks/bench_watchdog.py measures it). What it cannot do: see docs/cluster.md ("What MPI
cannot guarantee").
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import numpy as np

DEFAULT_TIMEOUT_S = 300.0
POLL_S = 0.5  # how often the thread wakes
ANSWER_S = 5.0  # how long a diagnosis waits for the other ranks' answers
RECHECK_S = 3.0  # how soon a long wait that is not (yet) a hang is looked at again
LOWER_RANK_FIRST_S = 1.0  # how long a rank lets a lower rank that saw the same hang report it
QUERY, REPLY, ERROR = 1, 2, 3  # tags on the watchdog's private communicator
SAME_ERROR_S = 1.0  # how long a failing rank waits to hear whether every rank failed

_REFIMPL_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_active: Watchdog | None = None


def progress() -> None:
    """Mark that this rank made progress (a step, a file, an action): no-op without a watchdog."""
    if _active is not None:
        _active.progress_at = time.monotonic()


def active() -> Watchdog | None:
    """The watchdog of this process, if an MPI world with more than one rank started one."""
    return _active


class Watchdog:
    """One rank's watchdog (see the module docstring). `comm` is a private mpi4py duplicate of
    COMM_WORLD, used only by the watchdog threads; `abort(code)` ends the job."""

    def __init__(self, comm, MPI, abort, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self._comm, self._MPI, self._abort = comm, MPI, abort
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.timeout_s = float(timeout_s)
        self.progress_at = time.monotonic()
        self._wait = None  # (comm, kind, peer, since) while the main thread blocks; one assignment
        self._next = None  # what the next __enter__ waits for
        self._main = threading.get_ident()
        self._stop = threading.Event()
        self._sends: list = []  # (request, buffer) of replies and queries still in flight
        self._round = 0
        self._thread = threading.Thread(target=self._run, name="refimpl-watchdog", daemon=True)

    # -- the main thread's side ----------------------------------------------------------------------

    def waiting(self, comm, kind: str, peer: int | None = None) -> Watchdog:
        """`with watchdog.waiting(comm, "allreduce"):` around a blocking MPI call."""
        self._next = (comm, kind, peer)
        return self

    def __enter__(self) -> None:
        self._wait = self._next + (time.monotonic(),)

    def __exit__(self, *exc) -> None:
        self._wait = None
        self.progress_at = time.monotonic()

    def set_timeout(self, seconds: float) -> None:
        """Seconds without progress before a wait is a hang; 0 turns the watchdog off."""
        self.timeout_s = check_timeout(seconds)

    def start(self) -> Watchdog:
        global _active
        _active = self
        self._thread.start()
        return self

    def stop(self) -> None:
        """End the thread (before MPI_Finalize); messages still in flight are left to MPI."""
        global _active
        if _active is self:
            _active = None
        self._stop.set()
        if self._thread.is_alive() and self._thread.ident != threading.get_ident():
            self._thread.join()
        for request, _ in self._sends:
            if not request.Test():
                request.Free()  # MPI completes it in the background
        self._sends.clear()

    def errors_everywhere(self, message: str) -> list[str] | None:
        """Called by a rank that failed with a bad-input error: tell every rank, and wait SAME_ERROR_S
        for theirs. Every rank's message, by rank, if every rank failed (an error that all ranks
        meet alike, such as a batch that does not split: the CLI then prints it once and nobody needs
        MPI_Abort); None if some rank did not (it may wait in a collective: abort the job)."""
        for other in range(self.size):
            if other != self.rank:
                self._send(json.dumps({"rank": self.rank, "error": message}).encode(), other, ERROR)
        messages = {self.rank: message}
        deadline = time.monotonic() + SAME_ERROR_S
        while len(messages) < self.size and time.monotonic() < deadline:
            got = self._receive(ERROR)
            if got is None:
                time.sleep(0.005)
            else:
                messages[got["rank"]] = got["error"]
        return [messages[r] for r in range(self.size)] if len(messages) == self.size else None

    # -- what this rank is doing -------------------------------------------------------------------

    def status(self) -> dict:
        """This rank's answer: waiting in what and for how long, or running where; last progress."""
        now, wait = time.monotonic(), self._wait
        answer = {"rank": self.rank, "progress_age": now - self.progress_at}
        if wait is not None:
            comm, kind, peer, since = wait
            answer.update(waiting=describe_wait(comm, kind, peer), waited=now - since)
        else:
            answer["where"] = self._main_location()
        return answer

    def _main_location(self) -> str:
        frame = sys._current_frames().get(self._main)
        if frame is None:
            return "unknown"
        path = os.path.abspath(frame.f_code.co_filename)
        if path.startswith(_REFIMPL_ROOT + os.sep):
            path = os.path.relpath(path, _REFIMPL_ROOT)
        return f"{path}:{frame.f_lineno} in {frame.f_code.co_name}"

    # -- the thread ----------------------------------------------------------------------------------

    def _run(self) -> None:
        next_check = 0.0
        while not self._stop.wait(POLL_S):
            self._answer_queries()
            if not self.timeout_s:
                continue
            wait, progress_at = self._wait, self.progress_at
            # stalled since: the start of this rank's wait, or, while it computes, its last progress point
            stalled_since = wait[3] if wait is not None else progress_at
            now = time.monotonic()
            if now - stalled_since < self.timeout_s or now < next_check:
                continue
            answers = self._ask_everyone()
            report = verdict(answers, self.size, self.timeout_s)
            if report is not None and any(r < self.rank and _stalled(a, self.timeout_s) for r, a in answers.items()):
                self._stop.wait(LOWER_RANK_FIRST_S)  # a lower rank reports the same hang: one report
            unchanged = self._wait is wait and self.progress_at == progress_at
            if report is not None and unchanged and not self._stop.is_set():
                sys.stderr.write(f"[rank {self.rank}] {report}\n")
                sys.stderr.flush()
                self._abort(1)
                return
            next_check = time.monotonic() + RECHECK_S

    def _send(self, payload: bytes, dest: int, tag: int) -> None:
        buffer = np.frombuffer(payload, dtype=np.uint8).copy()
        self._sends.append((self._comm.Isend(buffer, dest, tag), buffer))
        self._sends = [(r, b) for r, b in self._sends if not r.Test()]

    def _receive(self, tag: int):
        """One message with this tag, decoded, or None if none has arrived."""
        status = self._MPI.Status()
        if not self._comm.Iprobe(source=self._MPI.ANY_SOURCE, tag=tag, status=status):
            return None
        buffer = np.empty(status.Get_count(self._MPI.BYTE), dtype=np.uint8)
        self._comm.Recv(buffer, source=status.Get_source(), tag=tag)
        return json.loads(buffer.tobytes())

    def _answer_queries(self) -> None:
        while (query := self._receive(QUERY)) is not None:
            answer = dict(self.status(), round=query["round"])
            self._send(json.dumps(answer).encode(), query["rank"], REPLY)

    def _ask_everyone(self) -> dict[int, dict]:
        """Every rank's status that arrives within ANSWER_S, by rank (this rank's included)."""
        self._round += 1
        query = json.dumps({"rank": self.rank, "round": self._round}).encode()
        for other in range(self.size):
            if other != self.rank:
                self._send(query, other, QUERY)
        answers = {self.rank: self.status()}
        deadline = time.monotonic() + ANSWER_S
        while len(answers) < self.size and time.monotonic() < deadline and not self._stop.is_set():
            self._answer_queries()  # others may be asking at the same time
            reply = self._receive(REPLY)
            if reply is None:
                time.sleep(0.01)
            elif reply.get("round") == self._round:
                answers[reply["rank"]] = reply
        return answers


def _stalled(answer: dict, timeout_s: float) -> bool:
    """Whether a rank's answer shows it stalled: waiting, or computing without progress, for timeout_s."""
    if "waiting" in answer:
        return answer["waited"] >= timeout_s
    return answer["progress_age"] >= timeout_s


def check_timeout(seconds: float) -> float:
    """--timeout's value, or a ValueError that says what it must be."""
    if not 0 <= seconds < float("inf"):  # NaN fails too
        raise ValueError(f"--timeout must be a finite number of seconds >= 0 (0 turns the watchdog off), "
                         f"got {seconds}")
    return float(seconds)


def describe_wait(comm, kind: str, peer: int | None) -> str:
    """'allreduce over ranks 0-3', 'recv from rank 2', 'wait for isend to rank 3': world ranks
    throughout (`peer` is a rank of `comm`, translated here)."""
    ranks = getattr(comm, "world_ranks", None) or tuple(range(comm.size))
    if peer is not None:
        return f"{kind} {'to' if 'send' in kind else 'from'} rank {ranks[peer]}"
    return f"{kind} over {_ranks(ranks, 'rank')}"


def verdict(answers: dict[int, dict], size: int, timeout_s: float) -> str | None:
    """The hang report, or None while the job is alive (see the module docstring).

    answers: rank -> {"progress_age": s, and "waiting": what, "waited": s, or "where": location};
    ranks that did not answer are missing.
    """
    silent = [r for r in range(size) if r not in answers]
    running = sorted(r for r, a in answers.items() if "waiting" not in a)
    if any(answers[r]["progress_age"] < timeout_s for r in running):
        return None  # someone computes: a long step, a save, verify's reference
    if not silent and not running and any(a["waited"] < timeout_s for a in answers.values()):
        return None  # every rank waits, but some only just arrived
    absent = [f"rank {r} (running {answers[r]['where']}, no progress for {answers[r]['progress_age']:.0f} s)"
              for r in running]
    absent += [f"rank {r} (no answer: stopped, exited, or its node is lost)" for r in silent]
    by_call: dict[str, list[int]] = {}
    for r, a in sorted(answers.items()):
        if "waiting" in a:
            by_call.setdefault(a["waiting"], []).append(r)
    waits = "; ".join(f"{_ranks(ranks, 'rank')} in {call} (for {max(answers[r]['waited'] for r in ranks):.0f} s)"
                      for call, ranks in by_call.items())
    if running and not silent and not by_call:
        arrived = f"Every rank computes without reaching a progress point: {'; '.join(absent)}. "
    else:
        arrived = f"Did not arrive: {'; '.join(absent)}. " if absent else "Every rank waits: a deadlock. "
    head = (f"watchdog: no progress for {timeout_s:g} s. " + arrived
            + (f"Waiting: {waits}. " if waits else ""))
    return head + "If a step really takes this long, raise --timeout (0 turns the watchdog off)."


def _ranks(ranks, word: str) -> str:
    """'rank 3', 'ranks 0, 1', 'ranks 0-7'."""
    ranks = list(ranks)
    if len(ranks) == 1:
        return f"{word} {ranks[0]}"
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{word}s {ranks[0]}-{ranks[-1]}"
    return f"{word}s {', '.join(map(str, ranks))}"
