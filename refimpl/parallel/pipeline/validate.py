"""Validator: is a schedule a correct, deadlock-free training step?

Checks, in order (the first failure raises `ScheduleError` with a message naming rank and step):

1. Placement. Every action runs on the rank that holds its stage (for DualPipe: in the action's
   direction), and every stage index is in range.
2. Completeness. Every (stage, micro-batch) gets exactly one F and exactly one full backward:
   either one B, or one I and one W. Nothing else appears.
3. Local order. On its rank, a backward (B or I) comes after its own F, and W after its own I.
   (Cross-rank order is a matter of time, checked by 5.)
4. Messages pair up. Each point-to-point message implied by an action (`actions.messages_of`) is
   sent by exactly one action and received by exactly one action, on the ranks that the
   placement names.
5. Rendezvous run. The ranks execute their lists with the strictest message semantics: a send
   completes only when the receiver has posted the matching receive, and a receive only when
   the sender has posted the matching send. Before each step a rank posts, together, the sends
   produced by its previous step and the receives its step needs, and waits for all of them
   (batched non-blocking send/receive and a wait-all, as Megatron-LM's
   send_forward_recv_backward and DualPipe's commit-and-wait do); after its last step it
   flushes its last sends. When no rank can complete its wait, the run deadlocks and the error
   lists what every blocked rank waits for.

   When a receive is posted is the executor's choice, so the run takes a policy:
   - `lookahead=k`: a rank also pre-posts, without waiting for them, the receives of its next k
     steps. `validate` reports the smallest k that completes (0 = receives posted just in
     time). Megatron-LM's interleaved order needs 1 (it exchanges messages in lock-step, one
     iteration before they are consumed); DualPipe's reference code posts some forward
     receives one step early for the same reason.
   - `per_channel=True`: a rank keeps one receive posted on every channel (source rank, message
     kind), always the next one it will consume there, as an executor with one MPI tag per
     kind would (MPI matches messages of one source and tag in order). This works exactly when
     every channel is first-in first-out: `fifo_channels` in the report.
   With every receive pre-posted, sends never block and the run is the plain dependency check;
   `validate` fails only if even that deadlocks (the dependencies form a cycle). Because a
   step runs only after all of its inputs arrived, a completed run also proves that the
   dependencies F(s-1) -> F(s), B/I(s+1) -> B/I(s) hold in time.

PyTorch's pipelining tests do the same kind of dry run with a unit-time simulator.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass

from .actions import Message, Schedule, step_messages


class ScheduleError(ValueError):
    """A schedule that is not a correct training step (the message says where)."""


@dataclass
class Report:
    ranks: int
    steps: int
    actions: int
    messages: int
    rendezvous_lookahead: int  # fewest steps of receives to pre-post for a rendezvous run
    fifo_channels: bool  # every (source, destination, kind) channel is first-in first-out
    per_channel_ok: bool  # a rendezvous run with one pre-posted receive per channel completes


def _check_placement_and_completeness(schedule: Schedule) -> int:
    S, M = schedule.num_stages, schedule.micro_batches
    seen: Counter = Counter()
    for rank in range(schedule.pp):
        for i, step in enumerate(schedule.ranks[rank]):
            for action in step.parts:
                where = f"{schedule.name}: rank {rank} step {i} ({step})"
                if not 0 <= action.stage < S:
                    raise ScheduleError(f"{where}: stage {action.stage} is outside 0..{S - 1}")
                if not 0 <= action.mb < M:
                    raise ScheduleError(f"{where}: micro-batch {action.mb} is outside 0..{M - 1}")
                if action.direction is not None and action.direction >= schedule.placement.num_directions:
                    raise ScheduleError(f"{where}: direction {action.direction} is not in this placement")
                owner = schedule.placement.rank_of(action.stage, action.direction)
                if owner != rank:
                    raise ScheduleError(f"{where}: stage {action.stage} lives on rank {owner}")
                seen[(action.kind, action.stage, action.mb)] += 1
    for s in range(S):
        for m in range(M):
            f, b, i, w = (seen[(k, s, m)] for k in "FBIW")
            if f != 1:
                raise ScheduleError(f"{schedule.name}: stage {s} micro-batch {m} has {f} forwards; needs exactly 1")
            if not ((b, i, w) == (1, 0, 0) or (b, i, w) == (0, 1, 1)):
                raise ScheduleError(
                    f"{schedule.name}: stage {s} micro-batch {m} has B={b}, I={i}, W={w}; "
                    "needs exactly one B, or one I and one W"
                )
    return sum(seen.values())


def _check_local_order(schedule: Schedule) -> None:
    for rank in range(schedule.pp):
        done: set[tuple[str, int, int]] = set()
        for i, step in enumerate(schedule.ranks[rank]):
            for action in step.parts:
                needs = {"B": "F", "I": "F", "W": "I"}.get(action.kind)
                if needs and (needs, action.stage, action.mb) not in done:
                    raise ScheduleError(
                        f"{schedule.name}: rank {rank} step {i} ({step}) runs before its own {needs}"
                    )
            for action in step.parts:
                done.add((action.kind, action.stage, action.mb))


def _plan(schedule: Schedule):
    """Per rank and step: (receives, sends) implied by the step."""
    return [[step_messages(schedule.placement, step) for step in steps] for steps in schedule.ranks]


def _check_pairing(schedule: Schedule, plan) -> tuple[int, bool]:
    sent: Counter = Counter()
    received: Counter = Counter()
    send_order: dict[tuple[int, int], list] = defaultdict(list)
    recv_order: dict[tuple[int, int], list] = defaultdict(list)
    for rank, steps in enumerate(plan):
        for recvs, sends in steps:
            for msg in sends:
                sent[msg] += 1
                send_order[(msg.src, msg.dst, msg.kind)].append(msg.key)
            for msg in recvs:
                received[msg] += 1
                recv_order[(msg.src, msg.dst, msg.kind)].append(msg.key)
    for msg in set(sent) | set(received):
        if sent[msg] != 1 or received[msg] != 1:
            raise ScheduleError(
                f"{schedule.name}: {msg.kind} message rank {msg.src} -> {msg.dst} for stage "
                f"{msg.src_stage}->{msg.dst_stage} micro-batch {msg.mb} is sent {sent[msg]} and received "
                f"{received[msg]} times"
            )
    fifo = all(send_order[channel] == recv_order[channel] for channel in send_order)
    return len(sent), fifo


def rendezvous_run(schedule: Schedule, lookahead: int = 0, per_channel: bool = False, plan=None) -> int:
    """Run the lists with rendezvous sends under a receive-posting policy (module docstring).
    Returns the number of sweeps over the ranks; raises ScheduleError naming what every blocked rank waits for
    on deadlock."""
    plan = plan if plan is not None else _plan(schedule)
    n = schedule.pp
    position = [0] * n  # wait point k: sends of step k-1 and receives of step k, then step k runs
    posted_sends: set[Message] = set()
    posted_recvs: set[Message] = set()
    # per_channel: each rank's receives on each (source, kind) channel, in the order it uses them
    channels: list[dict[tuple, list[Message]]] = [defaultdict(list) for _ in range(n)]
    heads: list[dict[tuple, int]] = [defaultdict(int) for _ in range(n)]
    for rank, steps in enumerate(plan):
        for recvs, _ in steps:
            for msg in recvs:
                channels[rank][(msg.src, msg.kind)].append(msg)

    def wants(rank: int) -> tuple[list[Message], list[Message]]:
        k = position[rank]
        sends = plan[rank][k - 1][1] if k > 0 else []
        recvs = plan[rank][k][0] if k < len(plan[rank]) else []
        return sends, recvs

    def pre_post(rank: int) -> None:
        k = position[rank]
        for j in range(k + 1, min(k + 1 + lookahead, len(plan[rank]))):
            posted_recvs.update(plan[rank][j][0])
        if per_channel:
            for channel, queue in channels[rank].items():
                # The head receive stays posted until it is matched; then the next one is posted.
                while heads[rank][channel] < len(queue):
                    head = queue[heads[rank][channel]]
                    posted_recvs.add(head)
                    if head not in posted_sends:
                        break
                    heads[rank][channel] += 1

    def finished(rank: int) -> bool:
        return position[rank] > len(plan[rank])

    sweeps = 0
    while not all(finished(r) for r in range(n)):
        # Posting only ever adds requests, so a wait that can complete stays completable: the
        # order in which ranks are visited changes nothing, and each rank runs as far as it can.
        sweeps += 1
        progressed = False
        for r in range(n):
            while not finished(r):
                sends, recvs = wants(r)
                posted_sends.update(sends)
                posted_recvs.update(recvs)
                pre_post(r)
                if not (all(m in posted_recvs for m in sends) and all(m in posted_sends for m in recvs)):
                    break
                position[r] += 1  # the wait completes; the step (if any) runs
                progressed = True
        if not progressed:
            lines = []
            for r in range(n):
                if finished(r):
                    continue
                sends, recvs = wants(r)
                blocked = [f"send {m.kind} mb {m.mb} to rank {m.dst}" for m in sends if m not in posted_recvs]
                blocked += [f"recv {m.kind} mb {m.mb} from rank {m.src}" for m in recvs if m not in posted_sends]
                at = schedule.ranks[r][position[r]] if position[r] < len(schedule.ranks[r]) else "end"
                lines.append(f"rank {r} before {at}: {'; '.join(blocked)}")
            policy = "one receive per channel" if per_channel else f"lookahead {lookahead}"
            raise ScheduleError(f"{schedule.name}: rendezvous deadlock ({policy}): " + " | ".join(lines))
    return sweeps


def completes(schedule: Schedule, lookahead: int = 0, per_channel: bool = False, plan=None) -> bool:
    try:
        rendezvous_run(schedule, lookahead, per_channel, plan)
        return True
    except ScheduleError:
        return False


def minimal_lookahead(schedule: Schedule, plan=None) -> int:
    """Smallest lookahead whose rendezvous run completes. Pre-posting more receives never makes
    a run worse, so: double the lookahead until a run completes, then bisect. Raises the
    lookahead-0 deadlock if even pre-posting every receive does not help, which means the
    dependencies themselves form a cycle."""
    plan = plan if plan is not None else _plan(schedule)
    longest = max((len(p) for p in plan), default=0)
    low, high = -1, 0  # fails at low (-1: nothing tried), try high
    while not completes(schedule, high, plan=plan):
        if high >= longest:
            rendezvous_run(schedule, 0, plan=plan)  # raises the informative lookahead-0 error
        low, high = high, min(longest, max(1, 2 * high))
    while high - low > 1:
        mid = (low + high) // 2
        if completes(schedule, mid, plan=plan):
            high = mid
        else:
            low = mid
    return high


def validate(schedule: Schedule) -> Report:
    """Run every check; return a short report, or raise ScheduleError."""
    if len(schedule.ranks) != schedule.pp:
        raise ScheduleError(f"{schedule.name}: {len(schedule.ranks)} rank lists for pp = {schedule.pp}")
    actions = _check_placement_and_completeness(schedule)
    _check_local_order(schedule)
    plan = _plan(schedule)
    messages, fifo = _check_pairing(schedule, plan)
    lookahead = minimal_lookahead(schedule, plan)
    per_channel_ok = completes(schedule, per_channel=True, plan=plan)
    return Report(
        ranks=schedule.pp,
        steps=sum(len(r) for r in schedule.ranks),
        actions=actions,
        messages=messages,
        rendezvous_lookahead=lookahead,
        fifo_channels=fifo,
        per_channel_ok=per_channel_ok,
    )


def is_valid(schedule: Schedule) -> bool:
    try:
        validate(schedule)
    except ScheduleError:
        return False
    return True


__all__ = ["ScheduleError", "Report", "validate", "is_valid", "rendezvous_run", "completes", "minimal_lookahead"]
