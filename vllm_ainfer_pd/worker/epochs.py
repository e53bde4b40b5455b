"""The lane's jobs and epochs: the job queue, the open epoch, the epochs still draining on the
device, cancels and reports (the main thread's bookkeeping; `p_thread.py` runs an epoch).

An epoch is one forward of D's compiled graph over the jobs queued when it opens, at most the step
token budget (vLLM compiled the graph for that range): a longer prompt is prefilled in parts over
several epochs, and `split` maps it to the epoch that ran its latest part.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from vllm_ainfer_pd.turnstile import DrainTimeout
from vllm_ainfer_pd.wire import JobKey, PJob, PLaneMetadata, Report
from vllm_ainfer_pd.worker.lane_stats import LaneStats


def tokens(jobs: Iterable[PJob]) -> int:
    """Prompt tokens the jobs (or an epoch's chunks of them) compute."""
    return sum(j.end - j.start for j in jobs)


@dataclass
class Epoch:
    id: int
    jobs: list[PJob] = field(default_factory=list)  # reported when its device work completes
    chunks: list[PJob] = field(default_factory=list)  # what P computes: jobs or parts of them
    thread: threading.Thread | None = None
    event: Any = None  # GPU: recorded on P's stream after the last segment
    error: BaseException | None = None
    timings: dict[str, float] = field(default_factory=dict)
    # DP > 1: P tokens of each DP rank in this epoch (0: a matched no-work epoch), else None.
    dp_counts: list[int] | None = None
    reached: int = -1  # the last boundary P published
    collectives: int = 0  # P collectives issued (stand-ins of a replay not counted)
    # A failed rank's no-work replay (p_thread.py): boundaries up to `replay_from` and the first
    # `skip` collectives were already issued before the failure.
    replay_from: int = -1
    skip: int = 0
    stood_in: int = 0  # collectives the replay stands in for (0: it failed before any)
    closed_at: float = 0.0  # when its host work ended (`Epochs.close`)
    failed: bool = False


class Epochs:
    """Invariant: every job the lane accepts is reported exactly once, after its P work has
    drained: completed (its epoch's device work finished), cancelled (at once if it had not
    started, else with the epoch it runs in), or failed (with its epoch once that epoch's device
    work finished, together with the queued rest of a prompt split over that epoch). An epoch
    whose device work has not finished `timeout_s` after it closed raises `DrainTimeout`: its
    blocks are never handed back while P may still write them."""

    def __init__(self, max_epoch_tokens: int, stats: LaneStats, rank: int = 0,
                 timeout_s: float = 120.0) -> None:
        self.max_epoch_tokens = max_epoch_tokens
        self.stats = stats
        self.rank = rank
        self.timeout_s = timeout_s
        self.pending: collections.deque[PJob] = collections.deque()
        self.split: dict[JobKey, Epoch] = {}
        self.cancelled: set[JobKey] = set()
        self.current: Epoch | None = None  # the open epoch
        self.finishing: list[Epoch] = []  # finished on the host; GPU work may still run
        self.reports: list[Report] = []  # (job, failed) ready for the connector
        self.handed = 0  # completed jobs the last `take_reports` handed over (promoted next step)
        self._next_id = 0

    def accept(self, meta: PLaneMetadata) -> None:
        """New jobs and cancels of this step. A cancelled job that has not started is dropped and
        reported at once; one in the running epoch drains with it and is reported after."""
        self.pending.extend(meta.new_jobs)
        for key in meta.cancelled:
            self.cancelled.add(key)
            for job in list(self.pending):
                if job.key == key:
                    self.pending.remove(job)
                    earlier = self.split.pop(key, None)
                    if earlier is not None and (earlier is self.current
                                                or earlier in self.finishing):
                        earlier.jobs.append(job)  # reported once its earlier part drained
                        continue
                    self.reports.append((job, False))
                    self.stats.jobs_cancelled += 1
        self.stats.inflight = self._inflight()

    def take_reports(self) -> list[Report]:
        """Jobs whose P work has drained (completed, cancelled or failed), each reported once."""
        self.collect_finished()
        out, self.reports = self.reports, []
        self.handed = sum(1 for job, failed in out if not failed and job.key not in self.cancelled)
        for job, _ in out:
            self.cancelled.discard(job.key)
        self.stats.inflight = self._inflight()
        return out

    def awaiting_decode(self) -> int:
        """Jobs whose requests D runs within a round or two: the open epoch's, those of ended
        epochs (draining, or reported and not yet handed over), and those the last step handed
        over (vLLM promotes them in its next schedule). The epoch gate counts them as decode
        rows, so an epoch's end alone does not look like an idle D (`round_plan.EpochGate`)."""
        jobs = [job for job, failed in self.reports if not failed]
        jobs += [job for e in self.finishing if not e.failed for job in e.jobs]
        jobs += self.current.jobs if self.current is not None else []
        return self.handed + sum(job.key not in self.cancelled for job in jobs)

    def queued_tokens(self) -> int:
        return tokens(self.pending)

    def next_epoch_tokens(self) -> int:
        """What `open` takes from the queue: at most the step budget."""
        return min(self.queued_tokens(), self.max_epoch_tokens)

    def open(self, dp_counts: list[int] | None = None) -> Epoch:
        """The next epoch, over the queued jobs up to the step budget (a job past it is cut: its
        rest stays first in the queue); it becomes the open one."""
        epoch = Epoch(self._next_id, dp_counts=dp_counts)
        left = self.max_epoch_tokens
        while self.pending and left > 0:
            job = self.pending.popleft()
            if job.end - job.start > left:  # the rest waits for the next epoch
                cut = job.start + left
                self.pending.appendleft(dataclasses.replace(
                    job, start=cut, token_ids=job.token_ids[left:]))
                job = dataclasses.replace(job, end=cut, token_ids=job.token_ids[:left])
                self.split[job.key] = epoch
            else:
                self.split.pop(job.key, None)
                epoch.jobs.append(job)
            epoch.chunks.append(job)
            left -= job.end - job.start
        self._next_id += 1
        self.stats.epochs += 1
        self.stats.p_tokens += tokens(epoch.chunks)
        self.current = epoch
        return epoch

    def close(self) -> Epoch:
        """The open epoch, no longer open (its host work is over: `fail` or `finish` it)."""
        epoch, self.current = self.current, None
        assert epoch is not None
        epoch.closed_at = time.monotonic()
        return epoch

    def fail(self, epoch: Epoch) -> None:
        """The epoch failed: its jobs, with the queued rest of any prompt split over it, are
        reported failed once its device work is done."""
        for job in list(self.pending):
            if self.split.get(job.key) is epoch:
                del self.split[job.key]
                self.pending.remove(job)
                epoch.jobs.append(job)
        epoch.failed = True
        self.finish(epoch)

    def finish(self, epoch: Epoch) -> None:
        """The epoch's host work is done; its jobs are reported once its device work is."""
        self.finishing.append(epoch)
        self.collect_finished()

    def collect_finished(self) -> None:
        """Report the jobs of epochs whose device work completed (at once on CPU)."""
        still = []
        for epoch in self.finishing:
            now = time.monotonic()
            if epoch.event is not None and not epoch.event.query():
                if now > epoch.closed_at + self.timeout_s:
                    raise DrainTimeout(
                        "P's device work did not complete", rank=self.rank, epoch=epoch.id,
                        detail=f"waited {self.timeout_s:.3g} s after the epoch ended; its "
                               f"{len(epoch.jobs)} jobs keep their KV blocks")
                still.append(epoch)
                continue
            self.stats.p_drain_s += now - epoch.closed_at
            if epoch.failed:
                self.reports.extend((job, True) for job in epoch.jobs)
                self.stats.jobs_failed += len(epoch.jobs)
                continue
            for job in epoch.jobs:
                self.reports.append((job, False))
                if job.key in self.cancelled:
                    self.stats.jobs_cancelled += 1
                else:
                    self.stats.jobs_done += 1
        self.finishing = still

    def _inflight(self) -> int:
        running = len(self.current.jobs) if self.current else 0
        return len(self.pending) + running + sum(len(e.jobs) for e in self.finishing)
