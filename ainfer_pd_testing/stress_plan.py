"""The rank-skew stress's shared schedule and its oracle.

Every rank derives the same `Plan` from the seed: when each P epoch opens (before a round's pre-D
phase, or after the previous round's post-D phase with `d_enqueued`), how many boundaries it has,
which ranks take part (the others are idle and make matched no-work calls), and the load figures
that feed the segment policy each round. From the plan alone, `expected_records` and
`expected_log` predict what each rank must observe at every pre-D phase and the exact order in
which it must enqueue D iterations and P segments. The protocol under test must reproduce them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from vllm_ainfer_pd.turnstile.controller import TaskState
from vllm_ainfer_pd.turnstile.ladder import OrderingMode
from vllm_ainfer_pd.turnstile.policy import Load, SegmentPolicy

Record = tuple  # (epoch, reached, permit, state value) seen at a pre-D phase
Event = tuple  # ("D", round) or ("P", epoch, boundary), in host-enqueue order

IDLE_RECORD: Record = (None, -1, 0, TaskState.IDLE.value)


@dataclass(frozen=True)
class EpochPlan:
    epoch: int
    open_round: int  # opened before pre_d of this round, or after post_d of the round before
    d_enqueued: bool  # True: opened after post_d of open_round - 1, with permit = its span
    boundaries: int
    active: tuple[int, ...]
    first_permit: float


@dataclass
class Plan:
    cycles: int
    world: int
    loads: list[Load]
    spans: list[float]  # span released by post_d of each round
    epochs: list[EpochPlan] = field(default_factory=list)
    # per round: (epoch plan, reached, permit, state) of the epoch current at pre_d, or None
    current: list[tuple[EpochPlan, int, float, TaskState] | None] = field(default_factory=list)

    def opening(self, rnd: int, d_enqueued: bool) -> EpochPlan | None:
        """The epoch that opens in the gap before round `rnd` in the given manner, if any."""
        for ep in self.epochs:
            if ep.open_round == rnd and ep.d_enqueued == d_enqueued:
                return ep
        return None


def make_plan(seed: int, cycles: int, world: int, policy: SegmentPolicy,
              mode: OrderingMode, max_boundaries: int = 16) -> Plan:
    """The schedule all ranks share for `seed` (a pure function of its arguments)."""
    rng = random.Random(seed)
    # Each round's epoch size equals its P pressure (a queue of one epoch).
    loads = [Load(d, p, epoch_size=p)
             for d, p in ((rng.random(), rng.uniform(0.0, 2.0)) for _ in range(cycles))]
    plan = Plan(cycles, world, loads, [mode.span(policy, ld) for ld in loads])
    plan.current = [None] * cycles
    rnd, epoch = 1 + rng.randrange(3), 0
    while rnd < cycles:
        d_enqueued = rng.random() < 0.5
        boundaries = rng.randint(1, max_boundaries)
        if rng.random() < 0.7:
            active = tuple(range(world))
        else:
            active = tuple(sorted(rng.sample(range(world), rng.randint(1, world))))
        permit = mode.span(policy, loads[rnd - 1]) if d_enqueued else 0
        ep = EpochPlan(epoch, rnd, d_enqueued, boundaries, active, permit)
        plan.epochs.append(ep)
        while rnd < cycles:  # the permit arithmetic of the segment controller
            if permit >= boundaries:
                plan.current[rnd] = (ep, boundaries - 1, permit, TaskState.DONE)
                break
            plan.current[rnd] = (ep, int(permit), permit, TaskState.PARKED)
            permit += plan.spans[rnd]
            rnd += 1
        rnd += 1 + rng.choice((0, 0, 1, 3))  # idle rounds before the next epoch
        epoch += 1
    return plan


def expected_records(plan: Plan, rank: int) -> list[Record]:
    """What `rank` must see at each pre-D phase. An idle rank keeps its last epoch's final state
    (advance is a no-op once DONE) or IDLE if it never took part."""
    out, last = [], IDLE_RECORD
    for cur in plan.current:
        if cur is not None and rank in cur[0].active:
            ep, reached, permit, state = cur
            last = (ep.epoch, reached, permit, state.value)
        out.append(last)
    return out


def expected_log(plan: Plan, rank: int) -> list[Event]:
    """The order in which `rank` must enqueue D rounds and P segments: before D of round j, the P
    ops below the permit it sees at that round's pre-D phase; after the last round, those
    released by its post-D phase."""
    log: list[Event] = []
    issued: dict[int, int] = {}
    for j, cur in enumerate(plan.current):
        if cur is not None and rank in cur[0].active:
            ep, _, permit, _ = cur
            upto = int(min(permit, ep.boundaries))
            log += [("P", ep.epoch, i) for i in range(issued.get(ep.epoch, 0), upto)]
            issued[ep.epoch] = upto
        log.append(("D", j))
    last = plan.current[-1] if plan.current else None
    if last is not None and rank in last[0].active and last[3] is TaskState.PARKED:
        ep, _, permit, _ = last
        upto = int(min(permit + plan.spans[-1], ep.boundaries))
        log += [("P", ep.epoch, i) for i in range(issued.get(ep.epoch, 0), upto)]
    return log
