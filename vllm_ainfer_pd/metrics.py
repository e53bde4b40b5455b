"""The P lane's metrics on vLLM's own KV-connector stats path (no extra server, no extra port).

Each worker's `PLane` keeps cumulative `LaneStats`; every step the worker-role connector sends the
change since its last report (`PLaneStats`, keyed by world rank), vLLM's KV output aggregator merges
the TP workers' reports, the scheduler ships them in `SchedulerStats`, and the frontend's stat
loggers (a) add them to the Prometheus counters below, served on `/metrics` as `vllm_ainfer_pd_*`
with `engine` and `rank` labels, and (b) log a per-interval summary ("KV Transfer metrics: ...").
Stats need `log_stats` (on for `vllm serve`; off by default for the offline `LLM`, whose callers
read `collective_rpc("ainfer_pd_status")` instead).

A rank's report rides on its next real forward: what it counts after that forward's report (its
post-D rendezvous, which opens epochs) or in DP dummy steps (which return nothing to the
scheduler) reaches `/metrics` with its next real forward. After a run ends, one short request per
DP rank (vLLM's `X-data-parallel-rank` header) settles the counters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

# LaneStats field -> (Prometheus name, help). Counters, except the `inflight` gauge.
COUNTERS = {
    "d_wait_s": ("vllm_ainfer_pd_d_wait_seconds", "Time a ready D step waited for P to stop "
                 "at its permit (host), per rank."),
    "p_permit_wait_s": ("vllm_ainfer_pd_p_permit_wait_seconds", "Time P waited parked for its "
                        "next permit, per rank."),
    "p_enqueue_s": ("vllm_ainfer_pd_p_enqueue_seconds", "Host time P spent issuing segments."),
    "p_enqueue_cpu_s": ("vllm_ainfer_pd_p_enqueue_cpu_seconds", "Part of P's host time issuing "
                        "segments that its thread ran on a core (the rest: waiting for the GIL "
                        "or in blocking calls)."),
    "rendezvous_s": ("vllm_ainfer_pd_rendezvous_seconds", "Time in the all-rank pre-D/post-D "
                     "CPU rendezvous."),
    "rendezvous_phases": ("vllm_ainfer_pd_rendezvous_phases", "All-rank CPU rendezvous phases "
                          "met (pre-D and post-D each count one; none in rounds without P)."),
    "segments": ("vllm_ainfer_pd_segments", "P segments released (one per D iteration with P "
                 "open)."),
    "segments_after_d": ("vllm_ainfer_pd_segments_after_d", "P segments released right after a "
                         "D forward that had tokens (P/D overlap)."),
    "epochs": ("vllm_ainfer_pd_epochs", "P epochs (batched background prefills) opened."),
    "rounds": ("vllm_ainfer_pd_rounds", "D iterations with a P epoch open."),
    "p_tokens": ("vllm_ainfer_pd_p_tokens", "Prompt tokens prefilled in the P lane."),
    "jobs_done": ("vllm_ainfer_pd_p_jobs_done", "P jobs completed and promoted to D."),
    "jobs_cancelled": ("vllm_ainfer_pd_p_jobs_cancelled", "P jobs drained after an abort."),
    "jobs_failed": ("vllm_ainfer_pd_p_jobs_failed", "P jobs that failed (recomputed inline)."),
    "p_collectives_routed": ("vllm_ainfer_pd_p_collectives_routed", "P collectives issued on "
                             "D's stream (the selective stream route)."),
    "p_collectives_own": ("vllm_ainfer_pd_p_collectives_own", "P calls on P's own "
                          "expert-parallel state: collectives on P's own communicators, DeepEP "
                          "normal-mode dispatches (docs/deepep.md)."),
    "phase_ep_rebuilds": ("vllm_ainfer_pd_phase_ep_rebuilds", "Rebuilds of P's own "
                          "expert-parallel state after a failed epoch that used it."),
    "p_drain_s": ("vllm_ainfer_pd_p_drain_seconds", "Time closed P epochs waited for their "
                  "device work before their jobs (and KV blocks) were handed back."),
    "gate_waits": ("vllm_ainfer_pd_gate_waits", "DP rounds with lane work queued in which the "
                   "epoch gate kept the epoch closed."),
    "epoch_max_rank_tokens": ("vllm_ainfer_pd_epoch_max_rank_tokens", "Over DP epochs: the "
                              "sum of the fullest rank's P tokens."),
    "epoch_all_rank_tokens": ("vllm_ainfer_pd_epoch_all_rank_tokens", "Over DP epochs: the sum "
                              "of every rank's P tokens."),
    "p_device_s": ("vllm_ainfer_pd_p_device_seconds", "Device time of P's segments "
                   "(overlap_timing only)."),
    "p_overlap_s": ("vllm_ainfer_pd_p_overlap_seconds", "Part of P's device time during which "
                    "D ran too (overlap_timing only)."),
}
GAUGES = {"inflight": ("vllm_ainfer_pd_p_jobs_inflight", "P jobs queued or running.")}


@dataclass
class PLaneStats(KVConnectorStats):
    """`data = {rank: {LaneStats field: change since the last report}}` (gauges: last value)."""

    def reset(self) -> None:
        self.data = {}

    def is_empty(self) -> bool:
        return not self.data

    def aggregate(self, other: KVConnectorStats) -> PLaneStats:
        for rank, values in other.data.items():
            mine = self.data.setdefault(rank, {})
            for name, value in values.items():
                mine[name] = value if name in GAUGES else mine.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        """Totals over ranks for the interval's log line."""
        ranks = list(self.data.values())
        out: dict[str, int | float] = {}
        for name in ("epochs", "segments", "segments_after_d", "jobs_done", "jobs_cancelled",
                     "jobs_failed", "p_tokens", "inflight"):
            out[name] = sum(r.get(name, 0) for r in ranks)
        segments = out["segments"]
        out["mean_d_wait_ms"] = round(
            1e3 * sum(r.get("d_wait_s", 0.0) for r in ranks) / segments, 3) if segments else 0.0
        return out


class PLanePromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        _unregister_lane_metrics()
        names = [*labelnames, "rank"]
        self.counters = {
            field: self._counter_cls(name=name, documentation=doc, labelnames=names)
            for field, (name, doc) in COUNTERS.items()
        }
        self.gauges = {
            field: self._gauge_cls(name=name, documentation=doc, labelnames=names,
                                   multiprocess_mode="mostrecent")
            for field, (name, doc) in GAUGES.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        engine = self.per_engine_labelvalues[engine_idx]
        for rank, values in transfer_stats_data.items():
            for name, value in values.items():
                if name in self.counters and value:
                    self.counters[name].labels(*engine, str(rank)).inc(value)
                elif name in self.gauges:
                    self.gauges[name].labels(*engine, str(rank)).set(value)


def _unregister_lane_metrics() -> None:
    """Drop the lane's collectors of an earlier engine in this process, as vLLM drops its own
    (`unregister_vllm_metrics`, which keeps only names starting with `vllm:`): a second engine
    in one process (an RL trainer that rebuilds its rollout engine) would otherwise fail to
    start on a duplicated time series."""
    from prometheus_client import REGISTRY

    for collector in list(REGISTRY._collector_to_names):
        if getattr(collector, "_name", "").startswith("vllm_ainfer_pd_"):
            REGISTRY.unregister(collector)


class StatsDelta:
    """What changed in a rank's cumulative `LaneStats` since the previous call."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.last: dict[str, float] = {}

    def take(self, current: dict[str, float]) -> PLaneStats | None:
        change = {}
        for name, value in current.items():
            if name in GAUGES:
                if value != self.last.get(name):
                    change[name] = value
            elif value != self.last.get(name, 0):
                change[name] = value - self.last.get(name, 0)
        self.last = dict(current)
        return PLaneStats(data={str(self.rank): change}) if change else None
