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
    DrainTimeout,
    Load,
    MissingProducerError,
    NullRendezvous,
    ProtocolError,
    Rendezvous,
    SegmentController,
    TaskState,
    Turnstile,
    make_policy,
)
from vllm_ainfer_pd.turnstile.round_plan import (
    CLEAN,
    STOOD_IN,
    EpochGate,
    PostD,
    PreD,
    PState,
    plan_round,
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
        # `free` ordering (one rank): P runs each epoch through beside D, never handed off.
        self.free = config.ordering == "free"
        self.handoff = not self.free and (config.p_host == "handoff" or (
            config.p_host == "auto" and runner.device.type != "cuda"))
        self._switch_interval = sys.getswitchinterval()
        self.overlap = (OverlapMeter() if config.overlap_timing and runner.device.type == "cuda"
                        else None)
        self.controller = SegmentController(rank=rank, span=config.segment_span,
                                            timeout_s=config.timeout_s)
        self.p_thread = PThread(runner, self.controller, self.stats, rank, self.overlap,
                                marks=config.p_stream_marks, sm_count=config.p_sm_count)
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
        )
        budget = runner.vllm_config.scheduler_config.max_num_batched_tokens
        self.epochs = Epochs(budget, self.stats, rank, config.timeout_s)
        self.faults: FaultHooks | None = None
        world_size = self.turnstile.rendezvous.world_size
        if self.free and world_size > 1:
            raise ProtocolError("ordering='free' needs an engine of one rank", rank=rank,
                                epoch=None, detail=f"{world_size} ranks share P's collectives")
        # Peers share P's collectives: a failure on this rank replays them (p_thread.py) until
        # the round plan ends the epoch on every rank.
        self.p_thread.replay_failures = world_size > 1
        # DP > 1: all DP ranks open an epoch together (P's MoE collectives span the EP group; a
        # rank with no P runs a matched no-work epoch of one dummy token). Each rank's queued
        # lane tokens and decode rows ride in vLLM's per-forward DP all-reduce (dp_sync), so the
        # epoch gate reads the same inputs on every rank without a rendezvous; a round the gate
        # opens shares each rank's exact next-epoch tokens in its post-D rendezvous.
        self.synced = dp_size > 1
        self.gate = EpochGate(config.epoch_gate_fill, config.epoch_gate_rounds)
        self.budget = budget
        self.waited_rounds = 0  # rounds since the rows first showed queued lane work
        self.d_rows = 0  # this forward's decode rows (set by the worker before each forward)
        if self.synced:
            dp_sync.install()
            dp_sync.set_source(lambda: (self.epochs.next_epoch_tokens(),
                                        self.d_rows + self.epochs.awaiting_decode()))
        self.ranks_per_dp = world_size // dp_size
        self.dp_rank = rank // self.ranks_per_dp  # world ranks run DP-major
        self._pre: list[PreD] = []  # every rank's pre-D payload of this round
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
        if epoch is not None and not self.handoff and not self.free:
            self._wait_for_p()  # P's segment ran beside D's step; D waits for its stop here
        if self.overlap is not None and (epoch is not None or self.epochs.finishing):
            self.overlap.start("d")
        if epoch is None or self.free:
            return
        if self.faults is not None:
            self.faults.before_pre_d(self.rank, self.turnstile.rendezvous.round,
                                     self.config.timeout_s)
        self._pre_d()
        self.stats.rounds += 1

    def after_d(self, load: Load | None = None, d_tokens: int = 0) -> None:
        """The post-D rendezvous and the round plan (`turnstile/round_plan.py`) with an epoch
        open, or in a round that may open one; then the plan's release, end, rebuild or opening
        on every rank alike. With the hand-off, wait until P stops again (its host work for the
        segment is done)."""
        if self.overlap is not None:
            self.overlap.end("d")
            p_s, overlap_s = self.overlap.collect()
            self.stats.p_device_s += p_s
            self.stats.p_overlap_s += overlap_s
        load = load or Load()
        if self.free:
            self._free_round(load, d_tokens)
            return
        epoch_open = self.epochs.current is not None
        if not epoch_open:
            if not self.synced:
                # DP = 1: every rank of the replica sees the same scheduler output, so the same
                # queue: the epoch opens on all of them with no rendezvous.
                if not self.epochs.pending:
                    return
                self._open_epoch(load)
                self._released(d_tokens)
                return
            if not self._gate_opens():
                return  # a free round: no rank meets, on every rank alike
            # An opening round: all ranks meet in both phases (the rendezvous keeps them in
            # order), and the post-D phase carries each rank's exact next-epoch tokens.
            self._pre_d()
        post = PostD(self.epochs.next_epoch_tokens(), load)
        start = time.perf_counter()
        self.turnstile.rendezvous.post_d(post.encode())
        self._met(time.perf_counter() - start)
        posts = [PostD.decode(p) for p in self.turnstile.rendezvous.payloads]
        plan = plan_round(self._pre, posts, epoch_open=epoch_open,
                          ranks_per_dp=self.ranks_per_dp, rank=self.rank)
        if plan.end:
            self._end_epoch(failed=plan.failed[self.dp_rank], cancel=plan.cancel)
        if plan.rebuild:
            self._rebuild_phase_ep()  # on every rank, at this same point
        if plan.release:
            self.turnstile.release(plan.load)
        elif plan.open is not None and (not (epoch_open and self.synced) or self._gate_opens()):
            # (An epoch that just ended opens the next only where the gate would: the same rule,
            # from the same rows, on every rank.)
            self.waited_rounds = 0
            self._open_epoch(plan.load, list(plan.open) if self.synced else None)
        else:
            return
        self._released(d_tokens)

    def _free_round(self, load: Load, d_tokens: int) -> None:
        """`free` ordering (one rank, no peers to agree with): the epoch ends once P's thread
        stopped (its whole forward enqueued, failed, or cancelled), and the next opens at once."""
        epoch = self.epochs.current
        if epoch is not None:
            state = self.controller.status().state
            if state is TaskState.RUNNING:
                return
            self._end_epoch(failed=state is not TaskState.DONE or epoch.error is not None)
        if self.epochs.pending:
            self._open_epoch(load)
            self._released(d_tokens)

    def _released(self, d_tokens: int) -> None:
        """A segment was released (or an epoch opened with its first one)."""
        self.stats.segments += 1
        if d_tokens:
            self.stats.segments_after_d += 1
        if self.handoff:
            self._wait_for_p()

    def _gate_opens(self) -> bool:
        """DP > 1 with no epoch open: whether this round meets to open one (`EpochGate`), from
        the rows of vLLM's DP all-reduce: the same inputs, and so the same answer, on every
        rank."""
        rows = dp_sync.lane_rows()
        if rows is None:
            return False
        queued, decoding = rows
        self.waited_rounds = self.waited_rounds + 1 if any(queued) else 0
        opens = self.gate.opens(queued, decoding, self.waited_rounds, self.budget)
        if any(queued):
            self.stats.gate_waits += not opens
        return opens

    def _pre_d(self) -> None:
        """The pre-D rendezvous, carrying this rank's P state (P has stopped)."""
        epoch = self.epochs.current
        retired = self.phase_ep is not None and self.phase_ep.retired
        if epoch is None:
            mine = PreD(retired=retired)
        else:
            status = self.controller.status()
            state = {TaskState.PARKED: PState.PARKED, TaskState.DONE: PState.DONE}.get(
                status.state, PState.STUCK)  # FAILED where no replay could match its peers
            failed = 0 if epoch.error is None else (STOOD_IN if epoch.stood_in else CLEAN)
            mine = PreD(state, status.reached, failed, retired)
        start = time.perf_counter()
        self.turnstile.rendezvous.pre_d(mine.encode())
        self._met(time.perf_counter() - start)
        self._pre = [PreD.decode(p) for p in self.turnstile.rendezvous.payloads]

    def _met(self, seconds: float) -> None:
        """Count one rendezvous phase and the time it took."""
        self.stats.rendezvous_s += seconds
        self.stats.rendezvous_phases += 1

    def _wait_for_p(self) -> None:
        """D waits until P stopped: parked at its permit, at the end of its forward, or failed.
        Only the round plan ends the epoch."""
        start = time.perf_counter()
        try:
            self.controller.wait_parked()
        except MissingProducerError:
            # P did not stop within `timeout_s`: its thread may still issue collectives on D's
            # communicators, so D must not run its next iteration beside it. The engine step
            # ends with the error (rank, epoch, the boundary awaited), as at a rendezvous timeout.
            raise
        except ProtocolError as exc:  # failed where no replay could match its peers
            epoch = self.epochs.current
            if epoch is not None and epoch.error is None:
                epoch.error = exc
        self.stats.d_wait_s += time.perf_counter() - start

    def _rebuild_phase_ep(self) -> None:
        """Rebuild P's expert-parallel state (collective over the world: every rank calls it in
        the same round, by the plan), after P's device work drained: no epoch is open, and a GPU
        communicator or DeepEP buffer must not be destroyed under a running kernel. Bounded: P's
        stream must go idle within `timeout_s`, and the destroy and re-creation finish within
        `timeout_s` (`deepep.manager.bounded`)."""
        from vllm.config import set_current_vllm_config

        p_stream = self.p_thread.p_stream
        drain = None
        if p_stream is not None:
            def drain() -> None:
                self._bounded("P's stream to drain before the rebuild", p_stream.query)

        with set_current_vllm_config(self.vllm_config):
            self.phase_ep.rebuild(drain, timeout_s=self.config.timeout_s, rank=self.rank)
        self.stats.phase_ep_rebuilds += 1
        logger.info("P lane rank %d: P's expert-parallel state rebuilt (%s)", self.rank,
                    self.phase_ep.kind)

    def _bounded(self, what: str, done: Any) -> None:
        """Poll `done()` until it is true, for at most `timeout_s`; else `DrainTimeout`."""
        deadline = time.monotonic() + self.config.timeout_s
        while not done():
            if time.monotonic() > deadline:
                raise DrainTimeout(f"waited for {what}", rank=self.rank, epoch=None,
                                   detail=f"not done after {self.config.timeout_s:.3g} s")
            time.sleep(0.001)

    def _open_epoch(self, load: Load | None, dp_counts: list[int] | None = None) -> None:
        epoch = self.epochs.open(dp_counts)
        if dp_counts is not None:
            self.stats.epoch_max_rank_tokens += max(dp_counts)
            self.stats.epoch_all_rank_tokens += sum(dp_counts)
        if self.phase_ep is not None:
            self.phase_ep.open_epoch()
        self.turnstile.open_epoch(epoch.id, d_enqueued=True, load=load)
        if not self.handoff:
            sys.setswitchinterval(P_SWITCH_INTERVAL_S)
        self.p_thread.start(epoch)

    def _end_epoch(self, failed: bool, cancel: bool = False) -> None:
        """End the open epoch on this rank, as every rank does in this round (the plan's end),
        its jobs `failed` or completed. With `cancel` a parked P is stopped at its permit, where
        its peers stand too."""
        epoch = self.epochs.close()
        if cancel:
            self.controller.cancel("the round plan ended the epoch: a rank's P is stuck")
        epoch.thread.join(timeout=self.config.timeout_s)
        if epoch.thread.is_alive():
            raise DrainTimeout("P's thread did not exit after its epoch ended", rank=self.rank,
                               epoch=epoch.id, detail=f"waited {self.config.timeout_s:.3g} s")
        self.controller.close()
        sys.setswitchinterval(self._switch_interval)
        if self.phase_ep is not None:
            self.phase_ep.close_epoch(failed=failed)
            self.stats.p_collectives_own = self.phase_ep.own_collectives
        if failed:
            why = epoch.error or "a peer's P failed (the round plan fails the epoch here too)"
            # The exception's traceback too: its message alone can be empty (an AssertionError).
            logger.error("P epoch %d on rank %d failed: %r", epoch.id, self.rank, why,
                         exc_info=why if isinstance(why, BaseException) else None)
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
