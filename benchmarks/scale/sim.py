"""The discrete-event rollout: a trace's trajectories against N DP ranks stepping in lockstep.

Events are the client's releases (a trajectory's first turn at `start_s`; turn k+1 at turn k's
final token + `wait_s * wait_scale`, as `replayer.py` does) and the engine's steps. Each step,
every rank plans its batch (`engines.plan_step`), the step lasts as long as the slowest rank
(`costs.CostModel.lockstep`), then prefill chunks advance, decode rows each make a token, and
finished requests release their trajectory's next turn.

- Routing (DP > 1): vLLM 0.26's `DPLBAsyncMPClient.get_core_engine_for_request`: the engine with
  the least `waiting * 4 + running`, scanning from an index that rotates by one per request, on
  counts the coordinator publishes at most every 100 ms, each assignment adding one to the chosen
  engine's waiting count until the next publication. A trajectory's next turn may therefore land
  on another rank and miss its prefix cache, as in vLLM.
- Async scheduling (vLLM's default on GPU): step n+1 is scheduled while step n runs, so a request
  that arrives during step n is first scheduled in step n+2, and a lane job reported by step n is
  promoted in step n+2.
- The lane (`pd`): an epoch opens in a round when no epoch is open, some rank has queued lane
  tokens and, at DP > 1, the product's epoch gate (`turnstile.round_plan.EpochGate`, options
  `epoch_gate_fill` / `epoch_gate_rounds`) opens on every rank's queued tokens and decode rows;
  every rank takes its queued jobs first come, first served, up to the step's token budget
  (a longer prompt continues in the next epoch), and all ranks' epochs run together (P's expert
  collectives span the group; a rank without P runs a dummy). Each round the segment policy's K
  (`turnstile.policy`, the worker's load figures, max over ranks) releases K of the epoch's
  layers + 1 boundary intervals. The round costs D, beyond its own forward:
  `max(w, (1 - overlap) * s + contention * overlap * s) + rendezvous`, where `s` is the segment's
  P device time (K / boundaries of the epoch's forward), `w = max(0, h - d_host_slack)` is D's
  wait for P's host work `h = K * p_host_per_interval + p_host_per_segment` (with `handoff`, the
  CPU's p_host, D waits for the whole segment: `max(h, s)`), `overlap` is the measured fraction of
  P's device time that D overlapped, and `contention` the fraction of that overlapped time D still
  pays. `global-enqueue` releases the whole epoch in one segment; `global-complete` also waits
  for it on the device.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field
from typing import Any

from benchmarks.scale.costs import CostModel, Layout
from benchmarks.scale.engines import EngineSpec, RankState, Req, plan_step
from benchmarks.scale.profile import Profile
from benchmarks.scale.shape import Batch
from vllm_ainfer_pd.config import AInferPDConfig
from vllm_ainfer_pd.rollout.trace import Trace
from vllm_ainfer_pd.turnstile.policy import Load, make_policy
from vllm_ainfer_pd.turnstile.round_plan import EpochGate

LB_PUBLISH_S = 0.1  # vLLM's coordinator: min_stats_update_interval_ms = 100
# What the prefix cache holds before a replay: `none` (a cold replay), `all` (every prompt, as in
# `rollout compare --cached-replay`'s second replay) or `later` (every turn after a trajectory's
# first: the burst of first turns costs what it costs, later turns' prefill next to nothing).
CACHED = ("none", "all", "later")


def load_spans(boundaries: int) -> tuple[int, ...]:
    """The spans the worker offers its load policy: 1, 2, 4, ... and the whole forward (the same
    rule as `worker/p_lane.load_spans`, kept here so the model needs no vLLM import)."""
    spans = [1]
    while spans[-1] * 2 < boundaries:
        spans.append(spans[-1] * 2)
    return (*spans, boundaries) if boundaries > spans[-1] else tuple(spans)


@dataclass
class Epoch:
    jobs: list[list[tuple[Req, int]]]  # per rank: (request, tokens in this epoch)
    tokens: list[int]
    device_s: float
    boundaries: int
    permit: int = 0


@dataclass
class SimResult:
    records: list[Any]
    summary: dict[str, Any]
    counters: dict[str, float] = field(default_factory=dict)


class Router:
    """vLLM's DP load balancer (see the module docstring)."""

    def __init__(self, dp: int) -> None:
        self.dp = dp
        self.counts = [[0, 0] for _ in range(dp)]
        self.next_publish = 0.0
        self.start = 0

    def route(self, now: float, ranks: list[RankState]) -> int:
        if self.dp == 1:
            return 0
        if now >= self.next_publish:
            self.counts = [[r.waiting_count, r.running] for r in ranks]
            self.next_publish = now + LB_PUBLISH_S
        best, best_score = 0, math.inf
        for i in range(self.dp):
            idx = (self.start + i) % self.dp
            score = self.counts[idx][0] * 4 + self.counts[idx][1]
            if score < best_score:
                best, best_score = idx, score
        self.counts[best][0] += 1
        self.start = (self.start + 1) % self.dp
        return best


class Simulator:
    def __init__(self, trace: Trace, profile: Profile, layout: Layout, spec: EngineSpec,
                 wait_scale: float = 1.0, cached: str = "none") -> None:
        if cached not in CACHED:
            raise ValueError(f"cached={cached!r} is not one of {', '.join(CACHED)}")
        self.trace = trace
        self.cached = cached
        self.profile = profile
        self.layout = layout
        self.spec = spec
        self.wait_scale = wait_scale
        self.cost = CostModel(profile, layout)
        self.eng = profile.engine
        self.lane = {**profile.lane, **dict(spec.lane)}
        # The lane's threshold as the product resolves it for this layout (unset: by DP size).
        self.lane["p_lane_min_tokens"] = AInferPDConfig(
            p_lane_min_tokens=self.lane["p_lane_min_tokens"]).lane_min_tokens(layout.dp)
        self.async_ = (profile.engine["async_scheduling"] if spec.async_scheduling is None
                       else spec.async_scheduling)
        self.overhead = float(self.eng["client_overhead_s"])
        self.overhead_per_token = float(self.eng["client_overhead_per_token_s"])
        self.ranks = [RankState(i) for i in range(layout.dp)]
        if cached == "all":
            for rank in self.ranks:
                rank.cache = {t.id: math.inf for t in trace.trajectories}
        self.router = Router(layout.dp)
        self.seq = itertools.count()
        self.releases: list[tuple[float, int, Req]] = []
        self.arrivals: list[tuple[float, int, Req]] = []
        self.frontend_free = 0.0
        self.records: dict[tuple[str, int], dict[str, Any]] = {}
        self.epoch: Epoch | None = None
        self.boundaries = profile.shape.layers + 1
        self.policy = make_policy(str(self.lane["segment_policy"]),
                                  k=int(self.lane["segment_span"]),
                                  spans=load_spans(self.boundaries))
        self.gate = EpochGate(float(self.lane["epoch_gate_fill"]),
                              int(self.lane["epoch_gate_rounds"]))
        self.gate_waited = 0  # rounds with lane work queued and no epoch open
        self.n = {"steps": 0, "epochs": 0, "segments": 0, "d_wait_s": 0.0, "p_device_s": 0.0,
                  "lane_tokens": 0, "lane_extra_s": 0.0, "gate_waits": 0,
                  "epoch_rank_tokens": 0}

    # -- client ------------------------------------------------------------------------------

    def _release(self, traj_index: int, turn: int, release: float) -> None:
        t = self.trace.trajectories[traj_index]
        req = Req(t.id, turn, t.contexts()[turn], t.turns[turn].output_tokens, release, release)
        req.traj_index = traj_index  # type: ignore[attr-defined]
        self.records[(t.id, turn)] = {"release": release}
        heapq.heappush(self.releases, (release, next(self.seq), req))

    def _frontend(self, until: float) -> None:
        """Requests released by `until` pass the API server one at a time, in release order (one
        asyncio process), `client_overhead_s` each. The part of a request's cost that grows with
        its prompt (`client_overhead_per_token_s`: the ids in, the first chunk's echo of them
        out) is added to its first token (`_finish`), where it does not hold up other requests."""
        while self.releases and self.releases[0][0] <= until + 1e-12:
            release, seq, req = heapq.heappop(self.releases)
            start = max(release, self.frontend_free)
            req.arrive = start + self.overhead
            self.frontend_free = req.arrive
            heapq.heappush(self.arrivals, (req.arrive, seq, req))

    def _finish(self, rank: RankState, req: Req, now: float) -> None:
        req.end = now
        block = int(self.eng["block_size"])
        rank.cache[req.traj] = max(rank.cache.get(req.traj, 0),
                                   (req.prompt + req.out - 1) // block * block)
        if self.cached == "later":  # every rank: the next turn finds its prompt wherever it lands
            for r in self.ranks:
                r.cache[req.traj] = math.inf
        rec = self.records[(req.traj, req.turn)]
        first = min(req.first + self.overhead_per_token * req.prompt, now)
        rec.update(first=first, end=now, req=req)
        t = self.trace.trajectories[req.traj_index]  # type: ignore[attr-defined]
        if req.turn + 1 < len(t.turns):
            self._release(req.traj_index, req.turn + 1,  # type: ignore[attr-defined]
                          rec["end"] + t.turns[req.turn + 1].wait_s * self.wait_scale)

    # -- the run -------------------------------------------------------------------------------

    def run(self) -> SimResult:
        for i, t in enumerate(self.trace.trajectories):
            self._release(i, 0, t.start_s)
        total = self.trace.num_requests
        now, step, prev_start = 0.0, 0, None
        done = 0
        while done < total:
            horizon = prev_start if (self.async_ and prev_start is not None) else now
            self._frontend(horizon)
            while self.arrivals and self.arrivals[0][0] <= horizon + 1e-12:
                _, _, req = heapq.heappop(self.arrivals)
                r = self.router.route(req.arrive, self.ranks)
                req.rank = r
                self.ranks[r].waiting.append(req)
            if not any(r.busy for r in self.ranks) and self.epoch is None:
                if not self.arrivals:
                    if not self.releases:
                        raise RuntimeError("scale model stalled with requests left")
                    self._frontend(self.releases[0][0])
                now = max(now, self.arrivals[0][0])
                prev_start = None
                continue
            plans = [plan_step(r, step, self.spec, self.eng, self.lane, self.layout.dp)
                     for r in self.ranks]
            batches = [p.batch for p in plans]
            d = self.cost.lockstep(batches)
            if self.spec.kind == "normal":
                d *= 1.0 + float(self.eng["normal_step_overhead"])
            if self.spec.kind == "pd":
                d += self._lane_round(batches, d, step)
            d = max(d, 1e-5)  # a step with nothing on the device still costs the host a little
            prev_start = now
            now += d
            done += self._advance(plans, now, step)
            step += 1
        self.n["steps"] = step
        return self._result()

    def _advance(self, plans: list, now: float, step: int) -> int:
        """Apply one step's results at `now`; return how many requests finished."""
        done = 0
        for rank, plan in zip(self.ranks, plans, strict=True):
            rank.row_context += plan.batch.rows
            while rank.finish and rank.finish[0][0] <= step:
                _, _, req = heapq.heappop(rank.finish)
                rank.rows -= 1
                rank.row_context -= req.prompt + 1 + (step - req.dec_start + 1)  # type: ignore
                self._finish(rank, req, now)
                done += 1
            for req, n in plan.chunks:
                req.computed += n
                if req.computed < req.prompt:
                    continue
                rank.prefilling.remove(req)
                req.first = now
                if req.out == 1:
                    self._finish(rank, req, now)
                    done += 1
                    continue
                rank.rows += 1
                rank.row_context += req.prompt + 1
                req.dec_start = step + 1  # type: ignore[attr-defined]
                heapq.heappush(rank.finish, (step + req.out - 1, next(self.seq), req))
        return done

    # -- the lane ------------------------------------------------------------------------------

    def _gate_opens(self, batches: list[Batch]) -> bool:
        """The product's rule (`p_lane._gate_opens`): at DP > 1, from every rank's queued lane
        tokens and decode rows; at DP = 1 an epoch opens as soon as work is queued."""
        queued = [sum(q.lane_left for q in r.lane_queue) for r in self.ranks]
        if self.layout.dp == 1:
            return any(queued)
        self.gate_waited = self.gate_waited + 1 if any(queued) else 0
        opens = self.gate.opens(queued, [b.rows for b in batches], self.gate_waited,
                                int(self.eng["max_num_batched_tokens"]))
        if any(queued) and not opens:
            self.n["gate_waits"] += 1
        if opens:
            self.gate_waited = 0
        return opens

    def _open_epoch(self) -> Epoch | None:
        budget = int(self.eng["max_num_batched_tokens"])
        if not any(r.lane_queue for r in self.ranks):
            return None
        jobs, tokens, batches = [], [], []
        for rank in self.ranks:
            taken: list[tuple[Req, int]] = []
            chunks: list[tuple[int, int]] = []
            room = budget
            while rank.lane_queue and room > 0:
                req = rank.lane_queue[0]
                n = min(req.lane_left, room)
                # Tokens before this chunk: the prefix-cache hit and earlier epochs' part.
                chunks.append((n, req.prompt - 1 - req.lane_left - req.lane_open))
                taken.append((req, n))
                req.lane_left -= n
                req.lane_open += n
                room -= n
                if req.lane_left == 0:
                    rank.lane_queue.pop(0)
            jobs.append(taken)
            tokens.append(budget - room)
            batches.append(Batch(chunks=tuple(chunks), samples=0))
        device = self.cost.lockstep(batches, with_t0=False)
        self.n["epochs"] += 1
        self.n["lane_tokens"] += sum(tokens)
        # Each rank's forward is as long as the fullest one's (lockstep): utilisation is the
        # epoch's tokens over ranks x its largest rank's tokens.
        self.n["epoch_rank_tokens"] += max(tokens) * len(tokens)
        self.n["p_device_s"] += device
        return Epoch(jobs, tokens, device, self.boundaries)

    def _lane_round(self, batches: list[Batch], d_s: float, step: int) -> float:
        lane = self.lane
        if self.epoch is None:
            self.epoch = self._open_epoch() if self._gate_opens(batches) else None
            if self.epoch is None:
                # At DP > 1 the rendezvous run every D iteration: they carry each rank's queued
                # P tokens, how ranks agree to open an epoch together (docs/worker.md).
                return self.cost.rendezvous() if self.layout.dp > 1 else 0.0
        ep = self.epoch
        budget = float(self.eng["max_num_batched_tokens"])
        ordering = str(lane["ordering"])
        if ordering == "fine":
            frac_left = 1.0 - ep.permit / ep.boundaries
            load = Load(
                d_occupancy=min(1.0, max(b.rows for b in batches)
                                / float(self.eng["max_num_seqs"])),
                p_pressure=max(sum(q.lane_left for q in r.lane_queue) + frac_left * ep.tokens[i]
                               for i, r in enumerate(self.ranks)) / budget,
                epoch_size=max(ep.tokens) / budget)
            k = min(self.policy.span(load), ep.boundaries - ep.permit)
        else:
            k = ep.boundaries - ep.permit
        s = ep.device_s * k / ep.boundaries
        h = k * float(lane["p_host_per_interval_s"]) + float(lane["p_host_per_segment_s"])
        e = float(lane["overlap"])
        if d_s <= 0:  # no D forward this round: P runs alone
            extra = max(h, s)
        elif lane["handoff"]:
            # D's thread waits for the whole segment; on the CPU P's host work is its compute.
            extra = max(h, s)
        elif ordering == "global-complete":
            extra = max(h, s)
        else:
            w = max(0.0, h - float(lane["d_host_slack_s"]))
            self.n["d_wait_s"] += w
            # D's wait for P's host and P's share of the device overlap in time: while D
            # waits, the device runs P's queued kernels. The round is as long as the longer.
            hide = (float(lane["async_hide"]) * max(0.0, d_s - self.cost.c.t0)
                    if self.async_ else 0.0)
            extra = max(max(0.0, w - hide), (1.0 - e) * s + float(lane["contention"]) * e * s)
        self.n["segments"] += 1
        self.n["lane_extra_s"] += extra
        ep.permit += k
        if ep.permit >= ep.boundaries:
            self._close_epoch(ep, step)
            self.epoch = None
        return extra + self.cost.rendezvous()

    def _close_epoch(self, ep: Epoch, step: int) -> None:
        lag = 2 if self.async_ else 1
        for rank, taken in zip(self.ranks, ep.jobs, strict=True):
            for req, n in taken:
                req.lane_open -= n
                if req.lane_open == 0 and req.lane_left == 0:
                    heapq.heappush(rank.promote, (step + lag, next(self.seq), req))

    # -- results -------------------------------------------------------------------------------

    def _result(self) -> SimResult:
        from vllm_ainfer_pd.rollout.metrics import summarize
        from vllm_ainfer_pd.rollout.replayer import RequestRecord

        records = []
        for (traj, turn), rec in self.records.items():
            req = rec["req"]
            records.append(RequestRecord(traj, turn, rec["release"], req.out, req.prompt,
                                         rec["release"], rec["first"], rec["end"], req.out))
        counters = dict(self.n)
        counters["cached_tokens"] = float(sum(r.cached_tokens for r in self.ranks))
        return SimResult(records, summarize(records), counters)


def simulate(trace: Trace, profile: Profile, layout: Layout, spec: EngineSpec,
             wait_scale: float = 1.0, cached: str = "none") -> SimResult:
    """One replay of `trace` on the modelled engine, the prefix cache holding `cached` (CACHED)
    before it starts."""
    return Simulator(trace, profile, layout, spec, wait_scale, cached).run()
