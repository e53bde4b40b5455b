"""The round plan: what every rank's lane does in one turnstile round, decided once, identically,
on every rank, from what every rank said in the round's rendezvous.

A rendezvous round has two phases, and each rank contributes one payload to each:

- **pre-D** (`PreD`), after this rank's P stopped (parked at its permit, at the end of its
  forward, or failed): P's state, the last boundary it published, and whether this rank's own
  expert-parallel state for P is retired (a failed epoch that used it);
- **post-D** (`PostD`), after this rank enqueued its D iteration: the tokens this rank's next
  epoch would take from its queue, and its load figures.

Between the two phases no rank's P issues anything, so both describe the same stopped state.
`plan_round(pre, post, ...)` maps every rank's two payloads (in rank order, as the rendezvous
returns them) to a `RoundPlan`: end the open epoch (completed or failed), release its next
segment (with the span every rank computes from the same load), open an epoch (with each DP
rank's tokens), rebuild P's expert-parallel state. It is a pure function of its arguments, so
every rank that calls it with the rendezvous' payloads gets the same plan; no rank decides a
round alone, and no rank ends an epoch alone.

Rules, in order:

1. **Epoch open.** A rank whose P failed does not stop: it replays its forward on no-work tokens
   (stand-ins for the collectives it had issued), so it parks where its peers park and issues
   the collectives they issue, and says `failed`. While every rank is parked at the same
   boundary the next segment is released; once every rank's forward is done the epoch ends on
   every rank, failed for each DP replica with a failed rank (its TP ranks share its jobs'
   KV), completed for the others, unless a failed rank had already issued collectives
   (`stood_in`): its replay's stand-ins then fed its peers meaningless values (an expert's
   output, a TP partial sum), so every replica's jobs fail. A rank that could not replay
   (`STUCK`) ends the epoch at once, failed everywhere: the others' parked P is cancelled at
   its permit. Ranks stopped
   apart (one done while another is parked, or parked at different boundaries) have already
   issued different collectives: that is a `RoundPlanMismatch`, naming every rank.
2. **No epoch open** (or the open one just ended completed on every replica): if any rank's P
   state is retired, every rank rebuilds it and no epoch opens this round; else an epoch opens
   if any rank has queued tokens, with each DP rank's tokens (the first rank of each DP group
   speaks for it: its TP peers see the same scheduler output).

The epoch gate (`EpochGate`) decides, before any rendezvous, whether a DP round with queued lane
work but no epoch open is worth a rendezvous at all; its inputs are vLLM's per-forward DP
all-reduce, the same on every rank, so its answer is too.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from vllm_ainfer_pd.turnstile.errors import TurnstileError
from vllm_ainfer_pd.turnstile.policy import Load

MICRO = 1_000_000  # load figures travel as integers in millionths
CLEAN, STOOD_IN = 1, 2  # how a rank failed (`PreD.failed`): before, or after, its first collective


class PState(enum.IntEnum):
    """What a rank's P is doing when D's iteration begins."""

    IDLE = 0  # no epoch open
    PARKED = 1  # stopped at its permit
    DONE = 2  # its forward ended
    STUCK = 3  # failed where it cannot issue its peers' collectives any more


@dataclass(frozen=True)
class PreD:
    state: PState = PState.IDLE
    boundary: int = -1  # the last boundary P published (-1: none)
    # This rank's part of the epoch failed (it replays, or is stuck): 1 before it issued any
    # collective, 2 after (its replay then returns stand-ins its peers' P computed with).
    failed: int = 0
    retired: bool = False  # this rank's expert-parallel state for P must be rebuilt

    def encode(self) -> tuple[int, ...]:
        return int(self.state), self.boundary, self.failed, int(self.retired)

    @classmethod
    def decode(cls, words: Sequence[int]) -> PreD:
        state, boundary, failed, retired = words
        return cls(PState(state), boundary, failed, bool(retired))


@dataclass(frozen=True)
class PostD:
    next_tokens: int = 0  # what this rank's next epoch would take from its queue
    load: Load = Load()

    def encode(self) -> tuple[int, ...]:
        return (self.next_tokens, *(round(x * MICRO) for x in
                                    (self.load.d_occupancy, self.load.p_pressure,
                                     self.load.epoch_size)))

    @classmethod
    def decode(cls, words: Sequence[int]) -> PostD:
        tokens, *load = words
        return cls(tokens, Load(*(x / MICRO for x in load)))


@dataclass(frozen=True)
class RoundPlan:
    end: bool = False  # the open epoch ends on every rank
    failed: tuple[bool, ...] = ()  # with `end`: per DP replica, whether its jobs failed
    cancel: bool = False  # with `end`: stop every rank's parked P at its permit
    release: bool = False  # the open epoch's next segment is released
    open: tuple[int, ...] | None = None  # an epoch opens: each DP rank's tokens
    rebuild: bool = False  # every rank rebuilds P's expert-parallel state
    load: Load = Load()  # the load every rank's segment policy reads (the max over ranks)


class RoundPlanMismatch(TurnstileError):
    """Ranks' P stopped at points no plan can reconcile."""


def shared_load(post: Sequence[PostD]) -> Load:
    """The max over ranks of each load figure: every rank's policy then picks the same span."""
    return Load(max(p.load.d_occupancy for p in post), max(p.load.p_pressure for p in post),
                max(p.load.epoch_size for p in post))


def plan_round(pre: Sequence[PreD], post: Sequence[PostD], *, epoch_open: bool,
               ranks_per_dp: int, rank: int = 0) -> RoundPlan:
    """The round's plan (module docstring). `pre` and `post` hold every rank's payloads in rank
    order; `rank` only names this rank in an error."""
    load = shared_load(post)
    if not epoch_open:
        return _idle_plan(pre, post, ranks_per_dp, load)
    states = [p.state for p in pre]
    if PState.STUCK in states:
        everywhere = (True,) * (len(pre) // ranks_per_dp)
        return RoundPlan(end=True, failed=everywhere, cancel=True, load=load)
    if all(s is PState.DONE for s in states):
        if any(p.failed == STOOD_IN for p in pre):
            failed = (True,) * (len(pre) // ranks_per_dp)
        else:
            failed = tuple(any(p.failed for p in pre[i:i + ranks_per_dp])
                           for i in range(0, len(pre), ranks_per_dp))
        plan = RoundPlan() if any(failed) else _idle_plan(pre, post, ranks_per_dp, load)
        return RoundPlan(end=True, failed=failed, open=plan.open, rebuild=plan.rebuild,
                         load=load)
    if PState.DONE in states:
        raise _mismatch(pre, rank, "some done while others are parked")
    if len({p.boundary for p in pre}) > 1:
        raise _mismatch(pre, rank, "parked at different boundaries")
    return RoundPlan(release=True, load=load)


def _idle_plan(pre: Sequence[PreD], post: Sequence[PostD], ranks_per_dp: int,
               load: Load) -> RoundPlan:
    if any(p.retired for p in pre):
        return RoundPlan(rebuild=True, load=load)
    counts = tuple(p.next_tokens for p in post[::ranks_per_dp])
    return RoundPlan(open=counts if any(counts) else None, load=load)


def _mismatch(pre: Sequence[PreD], rank: int, what: str) -> RoundPlanMismatch:
    seen = ", ".join(f"rank {r}: {p.state.name.lower()}{' (failed)' if p.failed else ''} at "
                     f"boundary {p.boundary}" for r, p in enumerate(pre))
    return RoundPlanMismatch(f"rank {rank}: the ranks' P epochs stopped {what} ({seen}); their "
                             f"collectives no longer match")


@dataclass(frozen=True)
class EpochGate:
    """When a DP round with lane work queued but no epoch open opens one.

    Epochs run in lockstep across DP ranks (P's MoE collectives span them), so an epoch costs
    every rank the forward of the fullest one: opening as soon as any rank has work runs
    epochs mostly empty. The gate opens once the queued lane tokens over all ranks reach
    `fill` x (the ranks in play x the step budget), or the oldest queued work has waited
    `deadline_rounds` rounds, or no rank has decode rows (nothing runs beside P then, waiting
    buys nothing). A rank is in play when it has lane work queued or decode rows: an idle rank
    loses nothing to an epoch it runs empty, so it does not count against the fill (else one
    busy rank of two could never reach a fill above one half, and every prompt would wait for
    the deadline). The
    lane counts as decode rows its jobs whose requests D runs within a round or two (the open or
    just-ended epoch's, reported and not yet promoted), so an epoch's end alone does not read as
    an idle D and open a near-empty epoch at once.
    `fill=0` opens at once (no gate). At DP=1 there are no peers to wait for: the gate is not
    used.
    """

    fill: float = 0.0
    deadline_rounds: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.fill <= 1.0:
            raise ValueError(f"epoch gate fill must be in [0, 1], got {self.fill!r}")
        if self.deadline_rounds < 0:
            raise ValueError(f"epoch gate deadline must be >= 0 rounds, got "
                             f"{self.deadline_rounds!r}")

    def opens(self, queued: Sequence[int], decoding: Sequence[int], waited_rounds: int,
              budget: int) -> bool:
        """`queued`: each DP rank's queued lane tokens; `decoding`: each DP rank's decode rows;
        `waited_rounds`: rounds since lane work was first queued on any rank; `budget`: one
        rank's epoch token budget. The same inputs on every rank give the same answer."""
        if not any(queued):
            return False
        if self.fill == 0.0 or not any(decoding):
            return True
        if self.deadline_rounds and waited_rounds >= self.deadline_rounds:
            return True
        in_play = sum(1 for q, d in zip(queued, decoding, strict=True) if q or d)
        return sum(min(q, budget) for q in queued) >= self.fill * in_play * budget
