"""The P lane's wire types: what the planner (scheduler side) and the worker's lane exchange.

Both sides import this module and neither imports the other's: the connector (scheduler role
and worker role, `connector.py`) ships `PLaneMetadata` to every worker each step and reads back
`PLaneWorkerMeta`; the worker's lane (`worker/p_lane.py`) takes jobs and cancels and returns
reports through the `LaneEndpoint` the connector's worker role holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

JobKey = tuple[str, int]  # (request id, lifetime)


@dataclass(frozen=True)
class PJob:
    """One background prefill: compute KV of `token_ids` (positions `start..end-1`) into `block_ids`
    (one list per KV cache group). `lifetime` counts the request's P jobs, so a result of an older
    job of the same request is recognisably stale."""

    req_id: str
    lifetime: int
    token_ids: tuple[int, ...]
    start: int
    end: int
    block_ids: tuple[tuple[int, ...], ...]

    @property
    def key(self) -> JobKey:
        return (self.req_id, self.lifetime)


@dataclass
class PLaneMetadata(KVConnectorMetadata):
    """Shipped to every worker each step: jobs to start and request ids to cancel (aborted while
    parked; the worker must still report them in `finished_recving` once their P has drained)."""

    new_jobs: list[PJob] = field(default_factory=list)
    cancelled: list[JobKey] = field(default_factory=list)


@dataclass
class PLaneWorkerMeta(KVConnectorWorkerMetadata):
    """Worker -> scheduler: the lifetime of each job reported in `finished_recving` this step, so
    the scheduler can drop a report that belongs to an older job of the same request."""

    lifetimes: dict[str, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> PLaneWorkerMeta:
        return PLaneWorkerMeta({**self.lifetimes, **getattr(other, "lifetimes", {})})


# A job whose P work drained, and whether it failed (its blocks are then reported as invalid).
Report = tuple[PJob, bool]


class LaneEndpoint(Protocol):
    """The worker's lane as the connector's worker role sees it (`worker.p_lane.PLane`)."""

    rank: int  # world rank: the key of the lane's counters in the metrics
    stats: Any  # cumulative counters with `as_dict()` (`LaneStats`)

    def accept(self, meta: PLaneMetadata) -> None:
        """This step's new jobs and cancels (called inside D's step)."""

    def take_reports(self) -> list[Report]:
        """Jobs whose P work has drained (completed, cancelled or failed), each reported once."""
