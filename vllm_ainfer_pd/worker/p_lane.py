"""The P lane's device side: segmented background prefill driven by the turnstile (docs/worker.md).

Per rank, once per D iteration, on the worker's main thread (the contract: `lane_round.py`):

    lane.before_d()           # P is stopped at its permit; pre-D rendezvous (only with P open)
    ...vLLM's D iteration...  # forward, sampling, drafting; the connector hands new P jobs and
                              # cancels to `lane.accept`
    lane.after_d(load)        # post-D rendezvous; release the next K boundaries; P runs them

A P epoch is one forward of the model (vLLM's compiled graph, without CUDA graphs) over the jobs
queued when it opens, up to the step token budget: a batched prefill of their uncached prompt
tokens into their reserved KV blocks. The P thread publishes boundary 0 at the forward's entry and
boundary i + 1 at layer i's attention call (hooks where vLLM's attention op enters the layer's
kernels, outside vLLM's compiled pieces); its collectives go on D's stream. The P thread has its
own vLLM forward context and workspace manager (`phase_state`). Where D waits for P to stop is
`p_host` (config):
- `concurrent` (GPU): a released segment's host work (its kernel launches) runs while the main
  thread goes on with the engine's output processing and next schedule; D waits for P's stop only
  in the next round's `before_d`, ahead of the pre-D rendezvous;
- `handoff` (CPU, where P's host work is its compute): the main thread waits in `after_d` until P
  stops (the cooperative hand-off of vLLM's dual-batch overlap).
Either way no model code of D runs between a release and P's stop, so P's collectives on D's
communicators never interleave with D's. With no epoch open the lane costs one branch per step: no
rendezvous, no thread hand-off.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import torch
from vllm.config import CUDAGraphMode
from vllm.forward_context import set_forward_context
from vllm.v1.worker import workspace

from vllm_ainfer_pd.config import AInferPDConfig
from vllm_ainfer_pd.turnstile import (
    Load,
    NullRendezvous,
    Rendezvous,
    SegmentController,
    TaskState,
    Turnstile,
    make_policy,
)
from vllm_ainfer_pd.turnstile.route import StreamRoute
from vllm_ainfer_pd.vllm_glue import attention, collectives, dp_sync, forward_context
from vllm_ainfer_pd.worker import phase_state
from vllm_ainfer_pd.worker.lane_round import LaneRound
from vllm_ainfer_pd.worker.overlap import OverlapMeter
from vllm_ainfer_pd.worker.p_batch import PBatch, PBatchBuilder

if TYPE_CHECKING:
    from vllm_ainfer_pd.wire import JobKey, PJob, PLaneMetadata

logger = logging.getLogger(__name__)
# Fault injection for the hang-safety tests: "<world rank>:<round>" makes that rank stall (sleep
# for 4 x timeout_s, long enough for its peers to give up) just before its pre-D rendezvous of
# that round, as a hung rank would.
STALL_ENV = "VLLM_AINFER_PD_TEST_STALL"
# Fault injection for the failure-path tests: "<epoch>" makes P raise at boundary 1 of that epoch on
# every rank (a deterministic P failure, like an out-of-memory at one batch shape: before layer 0's
# attention, so no rank has begun a collective its peers would wait in); "<epoch>@<world rank>"
# makes only that rank's P fail, while it prepares its batch (`_forward`).
FAIL_ENV = "VLLM_AINFER_PD_TEST_FAIL_EPOCH"
# While a P epoch is open with `p_host="concurrent"`, the interpreter switches threads at least
# this often (seconds; Python's default is 5 ms): the main thread, woken by D's GPU work, should
# not wait a whole default interval for the P thread to yield the GIL.
P_SWITCH_INTERVAL_S = 0.0005


def load_spans(num_boundaries: int) -> tuple[int, ...]:
    """Spans for the load policy: powers of two below the boundary count, and the count itself
    (a whole P forward in one release, for a lightly loaded D)."""
    spans = [1]
    while spans[-1] * 2 < num_boundaries:
        spans.append(spans[-1] * 2)
    return (*spans, num_boundaries) if num_boundaries > spans[-1] else tuple(spans)


def _tokens(jobs) -> int:
    """Prompt tokens the jobs (or an epoch's chunks of them) compute."""
    return sum(j.end - j.start for j in jobs)


@dataclass
class LaneStats:
    """Counters of one rank since start (times in seconds). Exported as `vllm_ainfer_pd_*`."""

    epochs: int = 0
    segments: int = 0
    segments_after_d: int = 0  # segments released right after a D forward that had tokens
    jobs_done: int = 0
    jobs_cancelled: int = 0
    jobs_failed: int = 0
    p_tokens: int = 0
    rounds: int = 0  # D iterations with a P epoch open
    d_wait_s: float = 0.0  # the main thread waited for P's host work to stop at its permit
    p_permit_wait_s: float = 0.0  # P waited parked for its next permit
    p_enqueue_s: float = 0.0  # P's host time issuing segments
    # The part of it P's thread ran on a core (Python, and the CUDA driver's launch work); off a
    # core it waited for the GIL or slept in a blocking call (on GPU none is expected:
    # benchmarks/profile_lane.py).
    p_enqueue_cpu_s: float = 0.0
    rendezvous_s: float = 0.0
    rendezvous_phases: int = 0  # pre-D and post-D phases this rank met its peers in
    p_collectives_routed: int = 0  # P collectives issued on D's stream (CPU: counted only)
    # With `overlap_timing` on GPU: P's device time and the part of it D overlapped (overlap.py).
    p_device_s: float = 0.0
    p_overlap_s: float = 0.0
    inflight: int = 0  # P jobs queued or running (a gauge)

    def as_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class _Epoch:
    id: int
    jobs: list[PJob]  # reported when the epoch's device work completes
    lane: PLane
    chunks: list[PJob] = field(default_factory=list)  # what P computes: jobs or parts of them
    thread: threading.Thread | None = None
    event: Any = None  # GPU: recorded on P's stream after the last segment
    error: BaseException | None = None
    timings: dict[str, float] = field(default_factory=dict)
    # DP > 1: P tokens of each DP rank in this epoch (0: a matched no-work epoch), else None.
    dp_counts: list[int] | None = None
    reached: int = -1  # the last boundary P published


class PLane(LaneRound):
    def __init__(
        self,
        runner: Any,
        config: AInferPDConfig,
        rank: int,
        rendezvous: Rendezvous | None = None,
        dp_size: int = 1,
    ) -> None:
        self.runner = runner
        self.config = config
        self.rank = rank
        self.vllm_config = runner.vllm_config
        self.model = runner.get_model()
        # Each attention call is a P boundary (vllm_glue/attention.py).
        self.num_boundaries = attention.install_boundaries(self.model, self.vllm_config,
                                                           log_drafter=rank == 0)
        self.is_cuda = runner.device.type == "cuda"
        self.handoff = config.p_host == "handoff" or (config.p_host == "auto" and not self.is_cuda)
        phase_state.install()
        self._switch_interval = sys.getswitchinterval()
        self.p_stream = torch.cuda.Stream(device=runner.device) if self.is_cuda else None
        # P reuses vLLM's communicators, so every P collective goes on D's stream (route.py).
        self.route = StreamRoute()
        collectives.install()
        self.overlap = OverlapMeter() if config.overlap_timing and self.is_cuda else None
        self.builder = PBatchBuilder(runner)
        # P's workspace manager (phase_state), allocated on P's first MoE; None where vLLM has
        # no workspace manager (CPU).
        self.p_workspace = (workspace.WorkspaceManager(runner.device)
                            if workspace.is_workspace_manager_initialized() else None)
        self.controller = SegmentController(rank=rank, span=config.segment_span,
                                            timeout_s=config.timeout_s)
        self.turnstile = Turnstile(
            self.controller,
            rendezvous or NullRendezvous(config.timeout_s),
            make_policy(config.segment_policy, k=config.segment_span,
                        spans=load_spans(self.num_boundaries)),
            config.ordering,
            # The lane ends an epoch when D sees P's end (`_wait_for_p`), so it fences there
            # (`_end_epoch`); the turnstile's own pre-D fence never sees a finished epoch.
            device_fence=lambda epoch: None,
        )
        self.pending: collections.deque[PJob] = collections.deque()
        # An epoch is one forward of D's compiled graph, which vLLM compiled for at most the
        # step token budget (its compile ranges): a longer prompt is prefilled over several
        # epochs, and `split` maps it to the epoch that ran its latest part.
        self.max_epoch_tokens = self.vllm_config.scheduler_config.max_num_batched_tokens
        self.split: dict[JobKey, _Epoch] = {}
        self.cancelled: set[JobKey] = set()
        self.epoch: _Epoch | None = None
        self.finishing: list[_Epoch] = []  # finished on the host; GPU work may still run
        self.reports: list[tuple[PJob, bool]] = []  # (job, failed) ready for get_finished
        self.stats = LaneStats()
        # DP > 1: all DP ranks open an epoch together (P's MoE collectives span the EP group; a
        # rank with no P runs a matched no-work epoch of one dummy token). Whether any rank has
        # P queued rides in vLLM's per-forward DP all-reduce (dp_sync); a round that opens an
        # epoch shares each rank's next-epoch tokens in its post-D rendezvous.
        self.dp_size = dp_size
        self.synced = dp_size > 1
        if self.synced:
            dp_sync.install()
            dp_sync.set_source(self._next_epoch_tokens)
        self.ranks_per_dp = self.turnstile.rendezvous.world_size // dp_size
        self._next_epoch = 0
        stall = os.environ.get(STALL_ENV, "")
        self._stall_round = (int(stall.split(":")[1])
                             if stall and int(stall.split(":")[0]) == rank else None)
        fail_epoch, _, fail_rank = os.environ.get(FAIL_ENV, "-1").partition("@")
        self._fail_epoch = int(fail_epoch)
        self._fail_rank = int(fail_rank) if fail_rank else None  # None: every rank, at boundary 1
        self.dp_rank = self.vllm_config.parallel_config.data_parallel_rank
        self._threads = torch.get_num_threads()
        if self.is_cuda:
            logger.info("P lane on rank %d: stream priorities %s (lower is higher)", rank,
                        self.stream_priorities())

    # ---- connector side (main thread, inside vLLM's step) -------------------------------------

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
                    if earlier is not None and (earlier is self.epoch
                                                or earlier in self.finishing):
                        earlier.jobs.append(job)  # reported once its earlier part drained
                        continue
                    self.reports.append((job, False))
                    self.stats.jobs_cancelled += 1
        self.stats.inflight = self._inflight()

    def take_reports(self) -> list[tuple[PJob, bool]]:
        """Jobs whose P work has drained (completed, cancelled or failed), each reported once."""
        self._collect_finished()
        out, self.reports = self.reports, []
        for job, _ in out:
            self.cancelled.discard(job.key)
        self.stats.inflight = self._inflight()
        return out

    def p_work_tokens(self) -> float:
        """P work not yet issued, in prompt tokens: the queued jobs plus the part of the open
        epoch's forward still ahead of its permit (the segment policy's P pressure)."""
        queued = _tokens(self.pending)
        epoch = self.epoch
        if epoch is None:
            return queued
        layers = self.num_boundaries - 1
        ahead = (layers - max(epoch.reached, 0)) / layers
        return queued + ahead * _tokens(epoch.chunks)

    def epoch_tokens(self) -> int:
        """Prompt tokens of the epoch this round releases: the open one, else the next one (what
        `_open_epoch` would take from the queue)."""
        if self.epoch is not None:
            return _tokens(self.epoch.chunks)
        return self._next_epoch_tokens()

    def _next_epoch_tokens(self) -> int:
        """What `_open_epoch` takes from the queue: at most the step budget."""
        return min(_tokens(self.pending), self.max_epoch_tokens)

    def stream_priorities(self) -> dict[str, int] | None:
        """CUDA priorities of D's stream (vLLM's compute stream) and P's; None on CPU."""
        if self.p_stream is None:
            return None
        return {"d": torch.cuda.current_stream().priority, "p": self.p_stream.priority}

    def workspace_bytes(self) -> int | None:
        """Bytes held by P's own workspace manager (None without one, on CPU)."""
        if self.p_workspace is None:
            return None
        return forward_context.workspace_bytes(self.p_workspace)

    def _inflight(self) -> int:
        running = len(self.epoch.jobs) if self.epoch else 0
        return len(self.pending) + running + sum(len(e.jobs) for e in self.finishing)

    # ---- the turnstile round (main thread) ----------------------------------------------------

    @property
    def active(self) -> bool:
        return self.epoch is not None

    def before_d(self) -> None:
        if self.epoch is not None and not self.handoff:
            self._wait_for_p()  # P's segment ran beside D's step; D waits for its stop here
        if self.overlap is not None and (self.epoch is not None or self.finishing):
            self.overlap.start("d")
        if self.epoch is None:
            return
        if self._stall_round == self.turnstile.rendezvous.round:
            logger.warning("%s: rank %d stalls before round %d", STALL_ENV, self.rank,
                           self._stall_round)
            time.sleep(4 * self.config.timeout_s)
        record = self.turnstile.pre_d()
        self.stats.d_wait_s += record.p_wait_s
        self._met(record.rendezvous_s)
        self.stats.rounds += 1

    def after_d(self, load: Load | None = None, d_tokens: int = 0) -> None:
        """Release P's next segment after this round's D, or open an epoch for queued jobs; with
        the hand-off, wait until P stops again (its host work for the segment is done)."""
        if self.overlap is not None:
            self.overlap.end("d")
            p_s, overlap_s = self.overlap.collect()
            self.stats.p_device_s += p_s
            self.stats.p_overlap_s += overlap_s
        if self.synced:
            if self.epoch is None:
                if not any(dp_sync.queued_p_tokens() or ()):
                    return  # no rank has P queued: a free round
                # An opening round: all ranks meet in both phases (the rendezvous keeps them in
                # order), and the post-D phase carries each rank's exact next-epoch tokens.
                self._met(self.turnstile.pre_d().rendezvous_s)
            load = self._post_d_synced(load or Load())
            if self.epoch is None:
                counts = [p[0] for p in self.turnstile.rendezvous.payloads]
                if not any(counts):
                    return
                self._open_epoch(load, counts[:: self.ranks_per_dp])
        elif self.epoch is not None:
            start = time.perf_counter()
            self.turnstile.post_d(load)
            self._met(time.perf_counter() - start)
        elif self.pending:
            self._open_epoch(load)
        else:
            return
        self.stats.segments += 1
        if d_tokens:
            self.stats.segments_after_d += 1
        if self.handoff:
            self._wait_for_p()

    def _post_d_synced(self, load: Load) -> Load:
        """The post-D rendezvous of a DP round: share the tokens of each rank's next epoch and the
        load (the max over ranks, so every rank picks the same K); release the next segment if an
        epoch is open."""
        # The tokens this rank's next epoch takes become its entry in P's DP metadata, which
        # vLLM checks against P's batch.
        next_epoch = self._next_epoch_tokens()
        payload = (next_epoch, *(round(x * 1e6) for x in
                                 (load.d_occupancy, load.p_pressure, load.epoch_size)))
        shared: list[Load] = []

        def shared_load(payloads: list[tuple[int, ...]]) -> Load:
            shared.append(Load(*(max(p[i] for p in payloads) / 1e6 for i in (1, 2, 3))))
            return shared[0]

        start = time.perf_counter()
        self.turnstile.post_d(shared_load, payload)
        self._met(time.perf_counter() - start)
        return shared[0]

    def _met(self, seconds: float) -> None:
        """Count one rendezvous phase and the time it took."""
        self.stats.rendezvous_s += seconds
        self.stats.rendezvous_phases += 1

    def _wait_for_p(self) -> None:
        """D waits until P stopped: parked at its permit, or at the end of its epoch (which then
        ends here; a failed one fails its jobs and D goes on)."""
        start = time.perf_counter()
        try:
            status = self.controller.wait_parked()
        except Exception as exc:  # the producer failed: its jobs fail, D goes on
            self.stats.d_wait_s += time.perf_counter() - start
            self._end_epoch(failed=exc)
            return
        self.stats.d_wait_s += time.perf_counter() - start
        if status.state is not TaskState.PARKED:
            self._end_epoch(failed=self.epoch.error if self.epoch else None)

    def _open_epoch(self, load: Load | None, dp_counts: list[int] | None = None) -> None:
        epoch = _Epoch(self._next_epoch, [], self, dp_counts=dp_counts)
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
        self._next_epoch += 1
        self.stats.epochs += 1
        self.stats.p_tokens += _tokens(epoch.chunks)
        self.turnstile.open_epoch(epoch.id, d_enqueued=True, load=load)
        if not self.handoff:
            sys.setswitchinterval(P_SWITCH_INTERVAL_S)
        if self.p_stream is not None:
            # P reads prefix blocks D wrote in earlier steps: order P after all of D's work so far.
            d_stream = torch.cuda.current_stream()
            self.p_stream.wait_stream(d_stream)
            self.route.set_d_stream(d_stream)
        epoch.thread = threading.Thread(
            target=self._run_epoch, args=(epoch,), name=f"ainfer-pd-P{self.rank}", daemon=True
        )
        self.epoch = epoch
        epoch.thread.start()

    def _end_epoch(self, failed: BaseException | None) -> None:
        epoch = self.epoch
        assert epoch is not None
        self.epoch = None
        epoch.thread.join(timeout=self.config.timeout_s)
        self.controller.close()
        sys.setswitchinterval(self._switch_interval)
        if failed is not None:
            logger.error("P epoch %d on rank %d failed: %r", epoch.id, self.rank, failed)
            failed_jobs = list(epoch.jobs)
            for job in list(self.pending):  # the rest of a prompt split over this epoch
                if self.split.get(job.key) is epoch:
                    del self.split[job.key]
                    self.pending.remove(job)
                    failed_jobs.append(job)
            for job in failed_jobs:
                self.reports.append((job, True))
            self.stats.jobs_failed += len(failed_jobs)
            return
        if self.turnstile.mode.fences_device and epoch.event is not None:
            epoch.event.synchronize()  # global-complete: D waits for the whole P on the device
        self.finishing.append(epoch)
        self._collect_finished()

    def _collect_finished(self) -> None:
        """Report the jobs of epochs whose device work completed (at once on CPU)."""
        still = []
        for epoch in self.finishing:
            if epoch.event is not None and not epoch.event.query():
                still.append(epoch)
                continue
            for job in epoch.jobs:
                self.reports.append((job, False))
                if job.key in self.cancelled:
                    self.stats.jobs_cancelled += 1
                else:
                    self.stats.jobs_done += 1
        self.finishing = still

    # ---- the P thread --------------------------------------------------------------------------

    def _boundary(self, epoch: _Epoch, boundary: int) -> None:
        """Publish `boundary`; if it is the permit, park until the next release."""
        if boundary == 1 and epoch.id == self._fail_epoch and self._fail_rank is None:
            raise RuntimeError(f"{FAIL_ENV}: P epoch {epoch.id} fails on rank {self.rank}")
        epoch.reached = boundary
        if self.overlap is not None:
            self.overlap.end("p")
        now = self._count_enqueue(epoch)
        try:
            self.controller.reach(epoch.id, boundary)
        finally:
            self.stats.p_permit_wait_s += self._mark_resumed(epoch) - now
            if self.overlap is not None:
                self.overlap.start("p")

    @staticmethod
    def _mark_resumed(epoch: _Epoch) -> float:
        """P (re)starts issuing work: note the wall clock (returned), then P's thread clock."""
        epoch.timings["resumed"] = resumed = time.perf_counter()
        epoch.timings["resumed_cpu"] = time.thread_time()
        return resumed

    def _count_enqueue(self, epoch: _Epoch) -> float:
        """Add P's host time since `_mark_resumed`, wall and on-core (P's thread only); return
        the wall clock. The thread clock is read inside the wall clock's span (here first, there
        last), so the on-core part never exceeds the whole."""
        cpu = time.thread_time()
        now = time.perf_counter()
        self.stats.p_enqueue_s += now - epoch.timings.get("resumed", now)
        self.stats.p_enqueue_cpu_s += cpu - epoch.timings.get("resumed_cpu", cpu)
        return now

    def _run_epoch(self, epoch: _Epoch) -> None:
        torch.set_num_threads(self._threads)
        collectives.route_calling_thread(self.issue_collective)
        attention.stop_calling_thread_at(functools.partial(self._boundary, epoch))
        phase_state.enter_p(self.p_workspace)  # P's own forward context and workspace
        error: BaseException | None = None
        try:
            self.controller.attach(epoch.id, name=threading.current_thread().name)
            self._mark_resumed(epoch)
            with torch.inference_mode(), self._stream():
                self._boundary(epoch, 0)
                if epoch.chunks or epoch.dp_counts is not None:
                    self._forward(epoch)
                if self.overlap is not None:
                    self.overlap.end("p")
                if self.p_stream is not None:
                    epoch.event = torch.cuda.Event()
                    epoch.event.record(self.p_stream)
            self._count_enqueue(epoch)
        except BaseException as exc:  # reported to the main thread, which fails the jobs
            error = exc
        finally:
            phase_state.leave_p()
            collectives.route_calling_thread(None)
            attention.stop_calling_thread_at(None)
        if error is None:
            try:
                self.controller.finish(epoch.id)
                return
            except BaseException as exc:
                error = exc
        epoch.error = error
        self.controller.fail(epoch.id, error)

    def _stream(self) -> Any:
        if self.p_stream is None:
            return _null()
        torch.cuda.set_device(self.runner.device)
        return torch.cuda.stream(self.p_stream)

    def _forward(self, epoch: _Epoch) -> None:
        """P's forward: the model's own (compiled, where vLLM compiles) forward without CUDA
        graphs, over the epoch's batch, parking at each attention layer (vllm_glue/attention.py).
        Its hidden states are dropped: P only fills KV; the promoted request's last prompt token
        runs in D. A DP rank without jobs runs one dummy token with no attention metadata (no KV
        written), so its MoE collectives match the other ranks' P.

        At DP > 1 the other ranks' P runs this epoch's MoE collectives whatever this rank does, so
        if this rank cannot prepare its batch it runs as many dummy tokens as it announced (no KV
        written) before it fails: the peers' collectives complete and only its own jobs fail."""
        if epoch.dp_counts is None:
            self._run_model(epoch, self._prepare(epoch), None)
            return
        across_dp = torch.tensor([max(c, 1) for c in epoch.dp_counts], dtype=torch.int32)
        announced = int(across_dp[self.dp_rank])
        try:
            batch = self._prepare(epoch)
            if batch.num_tokens != announced:
                raise RuntimeError(f"P's batch on rank {self.rank} has {batch.num_tokens} tokens, "
                                   f"but the rank announced {announced} to the DP group")
        except Exception:
            self._run_model(epoch, self.builder.no_work(announced), across_dp)
            raise
        self._run_model(epoch, batch, across_dp)

    def _prepare(self, epoch: _Epoch) -> PBatch:
        if epoch.id == self._fail_epoch and self._fail_rank == self.rank:
            raise RuntimeError(f"{FAIL_ENV}: P epoch {epoch.id} fails on rank {self.rank} "
                               f"while it prepares its batch")
        return self.builder.build(epoch.chunks) if epoch.chunks else self.builder.no_work()

    def _run_model(self, epoch: _Epoch, batch: PBatch, across_dp: torch.Tensor | None) -> None:
        with set_forward_context(
            batch.attn_metadata,
            self.vllm_config,
            num_tokens=batch.num_tokens,
            num_tokens_across_dp=across_dp,
            cudagraph_runtime_mode=CUDAGraphMode.NONE,
            slot_mapping=batch.slot_mapping,
        ):
            self.model(input_ids=batch.input_ids, positions=batch.positions,
                       intermediate_tensors=None, inputs_embeds=None)
        if epoch.reached != self.num_boundaries - 1:
            raise RuntimeError(
                f"P's forward published boundaries up to {epoch.reached}, expected "
                f"{self.num_boundaries - 1}: the attention hooks did not run"
            )

    def issue_collective(self, group: Any, collective: Any, args: tuple, kwargs: dict) -> Any:
        """A P collective (called on the P thread by vllm_glue/collectives.py's wrappers).
        P shares vLLM's communicators with D, and their device state (NCCL's per-communicator
        order, custom all-reduce's signal flags) does not survive use from two streams at once, so
        it runs on D's stream, after the D iteration the turnstile released this segment behind."""
        name = group.unique_name
        if not self.route.is_crossed(name):
            self.route.register(name, group.ranks, [group.ranks], shared_communicator=True)
        self.stats.p_collectives_routed += 1
        with self.route.route(name):
            out = collective(group, *args, **kwargs)
        if self.p_stream is not None:
            # Made on D's stream, used on P's: keep the allocator from handing it to D too soon.
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.is_cuda:
                    t.record_stream(self.p_stream)
        return out

    # ---- lifecycle -----------------------------------------------------------------------------

    def summary(self) -> str:
        s = self.stats
        return (
            f"P lane rank {self.rank}: {s.epochs} epochs, {s.segments} segments "
            f"({s.segments_after_d} after a D forward), jobs done/cancelled/failed "
            f"{s.jobs_done}/{s.jobs_cancelled}/{s.jobs_failed}, {s.p_tokens} P tokens; "
            f"D waited {s.d_wait_s:.3f} s, P parked {s.p_permit_wait_s:.3f} s, "
            f"P enqueue {s.p_enqueue_s:.3f} s ({s.p_enqueue_cpu_s:.3f} s on a core), "
            f"rendezvous {s.rendezvous_s:.3f} s"
        )

    def close(self) -> None:
        self.controller.cancel("worker shutdown")
        if self.epoch is not None and self.epoch.thread is not None:
            self.epoch.thread.join(timeout=5)
        self.turnstile.rendezvous.close()
        if self.synced:
            dp_sync.set_source(None)


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
