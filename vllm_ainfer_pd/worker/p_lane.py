"""`PLane`: the P lane's device side on one rank, segmented background prefill driven by the
turnstile (docs/worker.md). It implements the round (`lane_round.LaneRound`, whose docstring is
the contract) over three parts:

- `epochs.Epochs`: the job queue, the open epoch, the epochs draining on the device, cancels and
  reports (the connector's side: `accept`, `take_reports`);
- `p_thread.PThread`: the P thread that runs an epoch's forward and parks at its permit;
- `lane_stats.LaneStats`: the counters.

Where D waits for P to stop is `p_host` (config):
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

import logging
import sys
import time
from typing import TYPE_CHECKING, Any

import torch

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
from vllm_ainfer_pd.vllm_glue import dp_sync, forward_context
from vllm_ainfer_pd.wire import PLaneMetadata, Report
from vllm_ainfer_pd.worker.epochs import Epochs, tokens
from vllm_ainfer_pd.worker.faults import FaultHooks
from vllm_ainfer_pd.worker.lane_round import LaneRound
from vllm_ainfer_pd.worker.lane_stats import LaneStats
from vllm_ainfer_pd.worker.overlap import OverlapMeter
from vllm_ainfer_pd.worker.p_thread import PThread

if TYPE_CHECKING:
    from vllm_ainfer_pd.deepep.manager import PhaseEP

logger = logging.getLogger(__name__)
# While a P epoch is open with `p_host="concurrent"`, the interpreter switches threads at least
# this often (seconds; Python's default is 5 ms): the main thread, woken by D's GPU work, should
# not wait a whole default interval for the P thread to yield the GIL.
P_SWITCH_INTERVAL_S = 0.0005
# In the post-D payload's first word (a rank's next-epoch tokens, far below it): this rank's P
# expert-parallel state is retired, so every rank rebuilds it in this round (docs/deepep.md).
RETIRED_BIT = 1 << 40


def load_spans(num_boundaries: int) -> tuple[int, ...]:
    """Spans for the load policy: powers of two below the boundary count, and the count itself
    (a whole P forward in one release, for a lightly loaded D)."""
    spans = [1]
    while spans[-1] * 2 < num_boundaries:
        spans.append(spans[-1] * 2)
    return (*spans, num_boundaries) if num_boundaries > spans[-1] else tuple(spans)


class PLane(LaneRound):
    def __init__(
        self,
        runner: Any,
        config: AInferPDConfig,
        rank: int,
        rendezvous: Rendezvous | None = None,
        dp_size: int = 1,
        phase_ep: PhaseEP | None = None,
    ) -> None:
        self.config = config
        self.rank = rank
        self.stats = LaneStats()
        self.handoff = config.p_host == "handoff" or (
            config.p_host == "auto" and runner.device.type != "cuda")
        self._switch_interval = sys.getswitchinterval()
        self.overlap = (OverlapMeter() if config.overlap_timing and runner.device.type == "cuda"
                        else None)
        self.controller = SegmentController(rank=rank, span=config.segment_span,
                                            timeout_s=config.timeout_s)
        self.p_thread = PThread(runner, self.controller, self.stats, rank, self.overlap)
        # P's own expert-parallel state (docs/deepep.md): its collectives stay on P's stream; a
        # failed epoch that used it has every rank rebuild it before the next epoch.
        self.phase_ep = self.p_thread.phase_ep = phase_ep
        self.vllm_config = runner.vllm_config
        self.num_boundaries = self.p_thread.num_boundaries
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
        self.epochs = Epochs(runner.vllm_config.scheduler_config.max_num_batched_tokens,
                             self.stats)
        self.faults: FaultHooks | None = None
        # DP > 1: all DP ranks open an epoch together (P's MoE collectives span the EP group; a
        # rank with no P runs a matched no-work epoch of one dummy token). Whether any rank has
        # P queued rides in vLLM's per-forward DP all-reduce (dp_sync); a round that opens an
        # epoch shares each rank's next-epoch tokens in its post-D rendezvous.
        self.synced = dp_size > 1
        if self.synced:
            dp_sync.install()
            dp_sync.set_source(self.epochs.next_epoch_tokens)
        self.ranks_per_dp = self.turnstile.rendezvous.world_size // dp_size
        if self.p_thread.p_stream is not None:
            logger.info("P lane on rank %d: stream priorities %s (lower is higher)", rank,
                        self.stream_priorities())

    def install_faults(self, hooks: FaultHooks | None) -> None:
        """Tests only: make this rank's lane call `hooks` at its fault points (None: none)."""
        self.faults = self.p_thread.faults = hooks

    # ---- connector side (main thread, inside vLLM's step) -------------------------------------

    def accept(self, meta: PLaneMetadata) -> None:
        self.epochs.accept(meta)

    def take_reports(self) -> list[Report]:
        return self.epochs.take_reports()

    # ---- load and status (main thread) ---------------------------------------------------------

    def p_work_tokens(self) -> float:
        """P work not yet issued, in prompt tokens: the queued jobs plus the part of the open
        epoch's forward still ahead of its permit (the segment policy's P pressure)."""
        queued = self.epochs.queued_tokens()
        epoch = self.epochs.current
        if epoch is None:
            return queued
        layers = self.num_boundaries - 1
        ahead = (layers - max(epoch.reached, 0)) / layers
        return queued + ahead * tokens(epoch.chunks)

    def epoch_tokens(self) -> int:
        """Prompt tokens of the epoch this round releases: the open one, else the next one (what
        `_open_epoch` would take from the queue)."""
        if self.epochs.current is not None:
            return tokens(self.epochs.current.chunks)
        return self.epochs.next_epoch_tokens()

    def stream_priorities(self) -> dict[str, int] | None:
        """CUDA priorities of D's stream (vLLM's compute stream) and P's; None on CPU."""
        p_stream = self.p_thread.p_stream
        if p_stream is None:
            return None
        return {"d": torch.cuda.current_stream().priority, "p": p_stream.priority}

    def attention_backends(self) -> list[str]:
        """The attention backends of the model's KV cache groups, by vLLM's names."""
        return self.p_thread.builder.attention_backends

    def workspace_bytes(self) -> int | None:
        """Bytes held by P's own workspace manager (None without one, on CPU)."""
        if self.p_thread.p_workspace is None:
            return None
        return forward_context.workspace_bytes(self.p_thread.p_workspace)

    # ---- the turnstile round (main thread) ----------------------------------------------------

    @property
    def active(self) -> bool:
        return self.epochs.current is not None

    def before_d(self) -> None:
        epoch = self.epochs.current
        if epoch is not None and not self.handoff:
            self._wait_for_p()  # P's segment ran beside D's step; D waits for its stop here
            epoch = self.epochs.current
        if self.overlap is not None and (epoch is not None or self.epochs.finishing):
            self.overlap.start("d")
        if epoch is None:
            return
        if self.faults is not None:
            self.faults.before_pre_d(self.rank, self.turnstile.rendezvous.round,
                                     self.config.timeout_s)
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
            if self.epochs.current is None:
                if not any(dp_sync.queued_p_tokens() or ()):
                    return  # no rank has P queued: a free round
                # An opening round: all ranks meet in both phases (the rendezvous keeps them in
                # order), and the post-D phase carries each rank's exact next-epoch tokens.
                self._met(self.turnstile.pre_d().rendezvous_s)
            load = self._post_d_synced(load or Load())
            if self.epochs.current is None:
                payloads = self.turnstile.rendezvous.payloads
                if self.phase_ep is not None and any(p[0] & RETIRED_BIT for p in payloads):
                    self._rebuild_phase_ep()  # on every rank, at this same point
                counts = [p[0] & ~RETIRED_BIT for p in payloads]
                if not any(counts):
                    return
                self._open_epoch(load, counts[:: self.ranks_per_dp])
        elif self.epochs.current is not None:
            start = time.perf_counter()
            self.turnstile.post_d(load)
            self._met(time.perf_counter() - start)
        elif self.epochs.pending:
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
        next_epoch = self.epochs.next_epoch_tokens()
        if self.phase_ep is not None and self.phase_ep.retired:
            next_epoch |= RETIRED_BIT  # the payload holds four ints: the flag rides in the first
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
        except Exception as exc:  # noqa: BLE001 - the producer failed: its jobs fail, D goes on
            self.stats.d_wait_s += time.perf_counter() - start
            self._end_epoch(failed=exc)
            return
        self.stats.d_wait_s += time.perf_counter() - start
        if status.state is not TaskState.PARKED:
            epoch = self.epochs.current
            self._end_epoch(failed=epoch.error if epoch else None)

    def _rebuild_phase_ep(self) -> None:
        """Rebuild P's expert-parallel state (collective over the world: every rank calls it in
        the same opening round), after P's device work drained: no epoch is open, and a GPU
        communicator or DeepEP buffer must not be destroyed under a running kernel."""
        from vllm.config import set_current_vllm_config

        drain = torch.cuda.synchronize if self.p_thread.p_stream is not None else None
        with set_current_vllm_config(self.vllm_config):
            self.phase_ep.rebuild(drain)
        self.stats.phase_ep_rebuilds += 1
        logger.info("P lane rank %d: P's expert-parallel state rebuilt (%s)", self.rank,
                    self.phase_ep.kind)

    def _open_epoch(self, load: Load | None, dp_counts: list[int] | None = None) -> None:
        epoch = self.epochs.open(dp_counts)
        if self.phase_ep is not None:
            self.phase_ep.open_epoch()
        self.turnstile.open_epoch(epoch.id, d_enqueued=True, load=load)
        if not self.handoff:
            sys.setswitchinterval(P_SWITCH_INTERVAL_S)
        self.p_thread.start(epoch)

    def _end_epoch(self, failed: BaseException | None) -> None:
        epoch = self.epochs.close()
        epoch.thread.join(timeout=self.config.timeout_s)
        self.controller.close()
        sys.setswitchinterval(self._switch_interval)
        if self.phase_ep is not None:
            self.phase_ep.close_epoch(failed=failed is not None)
            self.stats.p_collectives_own = self.phase_ep.own_collectives
        if failed is not None:
            logger.error("P epoch %d on rank %d failed: %r", epoch.id, self.rank, failed)
            self.epochs.fail(epoch)
            return
        if self.turnstile.mode.fences_device and epoch.event is not None:
            epoch.event.synchronize()  # global-complete: D waits for the whole P on the device
        self.epochs.finish(epoch)

    # ---- lifecycle -----------------------------------------------------------------------------

    def summary(self) -> str:
        return self.stats.summary(self.rank)

    def close(self) -> None:
        self.controller.cancel("worker shutdown")
        epoch = self.epochs.current
        if epoch is not None and epoch.thread is not None:
            epoch.thread.join(timeout=5)
        self.turnstile.rendezvous.close()
        if self.synced:
            dp_sync.set_source(None)
