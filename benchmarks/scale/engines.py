"""What each engine schedules in one step, per DP rank: vLLM's scheduler and the lane's planner.

- `stock`: vLLM 0.26's V1 scheduler with chunked prefill: running requests first (one token per
  decode row, the rest of a prefill in progress), then waiting requests first come, first served,
  each taking what remains of the step's token budget; a prompt's prefix-cache hit is the full
  blocks its trajectory left on this rank.
- `cadence`: stock with `--prefill-schedule-interval N` (vLLM's DP prefill balancing,
  `DPEngineCoreProc._should_throttle_prefills` and `Scheduler.schedule`): on a step whose counter
  is not a multiple of N, a rank defers every prefill (new and in progress) unless its last
  releasing step left requests waiting (`prefill_capacity_bound`) or it has no decode row. Only at
  DP > 1, as in vLLM.
- `normal`: stock's schedule (the same engine with P/D multiplexing off), each step
  `normal_step_overhead` longer.
- `pd`: stock's schedule for D, except that a prompt with at least `p_lane_min_tokens` uncached
  tokens (resolved for the layout as the product does, `Simulator`) is parked in the lane while
  fewer than `max_p_inflight` jobs are in flight (else it waits, and later prompts may go), and
  a promoted lane job runs its last prompt token as a D row.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

from benchmarks.scale.shape import Batch

ENGINES = ("stock", "cadence", "normal", "pd")


@dataclass(eq=False)
class Req:
    """One request of the trace as the engine sees it."""

    traj: str
    turn: int
    prompt: int
    out: int
    release: float
    arrive: float
    rank: int = -1
    computed: int = 0
    hit: int = 0
    lane_left: int = 0  # lane tokens not yet put into an epoch
    lane_open: int = 0  # lane tokens inside an epoch not yet finished
    first: float = math.nan
    end: float = math.nan


@dataclass
class RankState:
    """One DP rank's scheduler. Decode rows are kept as counts: every decode row makes one token
    per step, so a row that starts decoding at step s with m tokens to go ends at step s + m - 1
    (`finish` heap) and the rows' context grows by the row count each step."""

    index: int
    waiting: list[Req] = field(default_factory=list)
    prefilling: list[Req] = field(default_factory=list)
    rows: int = 0
    row_context: int = 0
    finish: list[tuple[int, int, Req]] = field(default_factory=list)
    cache: dict[str, int] = field(default_factory=dict)
    lane_jobs: int = 0  # admitted, not yet promoted
    lane_queue: list[Req] = field(default_factory=list)
    promote: list[tuple[int, int, Req]] = field(default_factory=list)
    capacity_bound: bool = False
    cached_tokens: int = 0  # prefix-cache hits (vLLM's prompt_tokens_cached, lane aside)

    @property
    def running(self) -> int:
        return self.rows + len(self.prefilling)

    @property
    def waiting_count(self) -> int:
        return len(self.waiting) + self.lane_jobs

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.prefilling or self.rows or self.lane_jobs)


@dataclass(frozen=True)
class EngineSpec:
    kind: str = "stock"
    cadence: int = 1
    lane: tuple[tuple[str, object], ...] = ()  # overrides of the profile's lane defaults
    async_scheduling: bool | None = None  # None: the profile's engine setting

    def __post_init__(self) -> None:
        if self.kind not in ENGINES:
            raise ValueError(f"engine {self.kind!r} is not one of {', '.join(ENGINES)}")
        if self.cadence < 1:
            raise ValueError(f"cadence={self.cadence} must be >= 1")

    @property
    def label(self) -> str:
        if self.kind == "cadence":
            return f"cadence{self.cadence}"
        return self.kind


@dataclass
class Plan:
    """One rank's forward this step, and what it advances."""

    batch: Batch
    chunks: list[tuple[Req, int]]  # prefill chunks (request, new tokens)


def cache_hit(rank: RankState, req: Req, block: int) -> int:
    """Full blocks the trajectory's earlier turns left on this rank, at most the prompt minus its
    last token (vLLM always computes that one)."""
    cached = rank.cache.get(req.traj, 0)
    return min(cached, (req.prompt - 1) // block * block)


def plan_step(rank: RankState, step: int, spec: EngineSpec, eng: dict, lane: dict,
              dp: int) -> Plan:
    """The batch `rank` schedules at `step` (vLLM's `Scheduler.schedule`, simplified to what the
    trace exercises: no preemption, no speculative tokens)."""
    budget = int(eng["max_num_batched_tokens"])
    max_seqs = int(eng["max_num_seqs"])
    throttle = spec.kind == "cadence" and dp > 1 and spec.cadence > 1 and step % spec.cadence != 0
    defer = throttle and not rank.capacity_bound and rank.rows > 0
    rows = min(rank.rows, budget)
    budget -= rows
    chunks: list[tuple[Req, int]] = []
    # Promoted lane jobs: their last prompt token, as a 1-token row that samples.
    while rank.promote and rank.promote[0][0] <= step:
        _, _, req = heapq.heappop(rank.promote)
        rank.lane_jobs -= 1
        req.computed = req.prompt - 1
        rank.prefilling.append(req)
    for req in rank.prefilling:
        if budget <= 0:
            break
        left = req.prompt - req.computed
        if defer and left > 1:
            continue
        n = min(left, budget)
        chunks.append((req, n))
        budget -= n
    if not defer:
        kept: list[Req] = []
        for req in rank.waiting:
            if budget <= 0 or rank.running >= max_seqs:
                kept.append(req)
                continue
            req.hit = cache_hit(rank, req, int(eng["block_size"]))
            req.computed = req.hit
            if spec.kind == "pd" and req.prompt - req.hit >= int(lane["p_lane_min_tokens"]):
                if rank.lane_jobs >= int(lane["max_p_inflight"]):
                    kept.append(req)  # waits; a later, shorter prompt may still go inline
                    continue
                rank.lane_jobs += 1
                rank.cached_tokens += req.hit
                req.lane_left = req.prompt - 1 - req.hit
                rank.lane_queue.append(req)
                continue
            rank.cached_tokens += req.hit
            n = min(req.prompt - req.computed, budget)
            chunks.append((req, n))
            rank.prefilling.append(req)
            budget -= n
        rank.waiting = kept
        rank.capacity_bound = bool(kept)
    batch = Batch(rows=rows, context=rank.row_context,
                  chunks=tuple((n, r.computed) for r, n in chunks),
                  samples=sum(1 for r, n in chunks if r.computed + n == r.prompt))
    return Plan(batch, chunks)
