"""The P thread: one epoch's forward, on its own thread, stopping at every boundary.

P calls the model's own forward (vLLM's compiled graph where vLLM compiles, without CUDA graphs)
over the epoch's batch. At boundary 0 (the forward's entry) and at boundary i + 1 (layer i's
attention call, `vllm_glue/attention.py`) it publishes the boundary to the segment controller and
parks there while the boundary is its permit. Its collectives go through `issue_collective`, on
D's stream (`vllm_glue/collectives.py`); it has its own vLLM forward context and workspace
manager (`phase_state.py`). On GPU its kernels go to P's own stream, and an event recorded after
the last one tells the main thread when the epoch's device work is done.
"""

from __future__ import annotations

import functools
import threading
import time
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import torch
from vllm.config import CUDAGraphMode
from vllm.forward_context import set_forward_context
from vllm.v1.worker import workspace

from vllm_ainfer_pd.config import ConfigError
from vllm_ainfer_pd.turnstile import EpochCancelled, SegmentController
from vllm_ainfer_pd.turnstile.route import StreamRoute
from vllm_ainfer_pd.vllm_glue import attention, collectives
from vllm_ainfer_pd.worker import phase_state
from vllm_ainfer_pd.worker.epochs import Epoch, tokens
from vllm_ainfer_pd.worker.faults import FaultHooks
from vllm_ainfer_pd.worker.lane_stats import LaneStats
from vllm_ainfer_pd.worker.overlap import OverlapMeter
from vllm_ainfer_pd.worker.p_batch import PBatch, PBatchBuilder

if TYPE_CHECKING:
    from vllm_ainfer_pd.deepep.manager import PhaseEP


def p_stream(device: torch.device, sm_count: int) -> tuple[Any, Any]:
    """P's CUDA stream (None on CPU) and, with `sm_count` > 0 (`p_sm_count`), the green context
    of that many SMs it runs in (kept alive as long as the stream)."""
    if device.type != "cuda":
        if sm_count:
            raise ConfigError(f"ainfer_pd.p_sm_count={sm_count} confines P's CUDA stream to SMs; "
                              f"this worker runs on {device.type}, leave it at 0")
        return None, None
    if not sm_count:
        return torch.cuda.Stream(device=device), None
    from torch.cuda import green_contexts

    total = torch.cuda.get_device_properties(device).multi_processor_count
    if not 0 < sm_count < total:
        raise ConfigError(f"ainfer_pd.p_sm_count={sm_count} must be below the {total} SMs of "
                          f"{torch.cuda.get_device_name(device)}, leaving D some of its own")
    if not green_contexts.SUPPORTED:
        raise ConfigError(f"ainfer_pd.p_sm_count={sm_count} needs CUDA green contexts, which "
                          f"torch {torch.__version__} was built without")
    # By keyword: torch 2.11 takes (num_sms, device_id), later releases keywords only.
    index = device.index if device.index is not None else torch.cuda.current_device()
    context = green_contexts.GreenContext.create(num_sms=sm_count, device_id=index)
    return context.Stream(), context  # a torch.cuda.ExternalStream bound to the context


class PThread:
    """Runs epochs' forwards for one rank's lane; one epoch at a time, each on a new thread."""

    def __init__(self, runner: Any, controller: SegmentController, stats: LaneStats, rank: int,
                 overlap: OverlapMeter | None = None, marks: str = "segment",
                 sm_count: int = 0) -> None:
        self.device = runner.device
        self.vllm_config = runner.vllm_config
        self.model = runner.get_model()
        self.controller = controller
        self.stats = stats
        self.rank = rank
        self.dp_rank = self.vllm_config.parallel_config.data_parallel_rank
        self.overlap = overlap
        self.faults: FaultHooks | None = None
        self.phase_ep: PhaseEP | None = None  # P's own expert-parallel state (set by the lane)
        # Set by the lane where other ranks share P's collectives: a failure replays (`_forward`).
        self.replay_failures = False
        # Each attention call is a P boundary.
        self.num_boundaries = attention.install_boundaries(self.model, self.vllm_config,
                                                           log_drafter=rank == 0)
        phase_state.install()
        # P reuses vLLM's communicators, so every P collective goes on D's stream (route.py).
        self.route = StreamRoute()
        collectives.install()
        self.builder = PBatchBuilder(runner)
        self.p_stream, self.green_context = p_stream(self.device, sm_count)
        # P's workspace manager (phase_state), allocated on P's first MoE; None where vLLM has
        # no workspace manager (CPU).
        self.p_workspace = (workspace.WorkspaceManager(self.device)
                            if workspace.is_workspace_manager_initialized() else None)
        self._threads = torch.get_num_threads()
        # `p_stream_marks` (config.py): a timing event on P's stream after every layer
        # (`layer`), and also after each layer's attention (`sublayer`).
        gpu = self.p_stream is not None
        self.mark_layers = gpu and marks in ("layer", "sublayer")
        self.mark_attention = gpu and marks == "sublayer"

    def start(self, epoch: Epoch) -> None:
        """Run `epoch` on a new thread, ordered after all of D's work so far."""
        if self.p_stream is not None:
            # P reads prefix blocks D wrote in earlier steps: order P after all of D's work so far.
            d_stream = torch.cuda.current_stream()
            self.p_stream.wait_stream(d_stream)
            self.route.set_d_stream(d_stream)
        epoch.thread = threading.Thread(target=self._run, args=(epoch,),
                                        name=f"ainfer-pd-P{self.rank}", daemon=True)
        epoch.thread.start()

    def _run(self, epoch: Epoch) -> None:
        torch.set_num_threads(self._threads)
        collectives.route_calling_thread(functools.partial(self.issue_collective, epoch))
        attention.stop_calling_thread_at(functools.partial(self._boundary, epoch),
                                         self._mark if self.mark_attention else None)
        phase_state.enter_p(self.p_workspace)  # P's own forward context and workspace
        error: BaseException | None = None
        try:
            self.controller.attach(epoch.id, name=threading.current_thread().name)
            self._mark_resumed(epoch)
            with torch.inference_mode(), self._stream():
                try:
                    self._boundary(epoch, 0)
                    if epoch.chunks or epoch.dp_counts is not None:
                        self._forward(epoch)
                finally:
                    # On every exit path: a failed or cancelled epoch's jobs are reported (their
                    # KV blocks freed) only once the P work already queued on the device drained.
                    if self.p_stream is not None:
                        epoch.event = torch.cuda.Event()
                        epoch.event.record(self.p_stream)
                    if self.faults is not None:
                        epoch.event = self.faults.device_work(self.rank, epoch.id, epoch.event)
                if self.overlap is not None:
                    self.overlap.end("p")
            self._count_enqueue(epoch)
        except BaseException as exc:  # noqa: BLE001 - the main thread fails the epoch's jobs
            error = exc
        finally:
            phase_state.leave_p()
            collectives.route_calling_thread(None)
            attention.stop_calling_thread_at(None)
        if error is None:
            try:
                self.controller.finish(epoch.id)
                return
            except BaseException as exc:  # noqa: BLE001 - as above
                error = exc
        epoch.error = epoch.error or error
        self.controller.fail(epoch.id, error)

    def _stream(self) -> Any:
        if self.p_stream is None:
            return nullcontext()
        torch.cuda.set_device(self.device)
        return torch.cuda.stream(self.p_stream)

    # ---- boundaries ---------------------------------------------------------------------------

    def _boundary(self, epoch: Epoch, boundary: int) -> None:
        """Publish `boundary`; if it is the permit, park until the next release. A replay passes
        the boundaries it published before it failed."""
        if boundary <= epoch.replay_from:
            return
        if self.mark_layers:
            self._mark()
        if self.faults is not None and epoch.error is None:
            self.faults.at_boundary(self.rank, epoch.id, boundary)
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

    def _mark(self) -> None:
        """A timing event on P's stream: the kernels issued before it form one group."""
        torch.cuda.Event(enable_timing=True).record(self.p_stream)

    @staticmethod
    def _mark_resumed(epoch: Epoch) -> float:
        """P (re)starts issuing work: note the wall clock (returned), then P's thread clock."""
        epoch.timings["resumed"] = resumed = time.perf_counter()
        epoch.timings["resumed_cpu"] = time.thread_time()
        return resumed

    def _count_enqueue(self, epoch: Epoch) -> float:
        """Add P's host time since `_mark_resumed`, wall and on-core (P's thread only); return
        the wall clock. The thread clock is read inside the wall clock's span (here first, there
        last), so the on-core part never exceeds the whole."""
        cpu = time.thread_time()
        now = time.perf_counter()
        self.stats.p_enqueue_s += now - epoch.timings.get("resumed", now)
        self.stats.p_enqueue_cpu_s += cpu - epoch.timings.get("resumed_cpu", cpu)
        return now

    # ---- the forward --------------------------------------------------------------------------

    def _forward(self, epoch: Epoch) -> None:
        """P's forward: the model's own (compiled, where vLLM compiles) forward without CUDA
        graphs, over the epoch's batch, parking at each attention layer. Its hidden states are
        dropped: P only fills KV; the promoted request's last prompt token runs in D. A DP rank
        without jobs runs one dummy token with no attention metadata (no KV written), so its MoE
        collectives match the other ranks' P.

        Where peers share P's collectives (`replay_failures`), a failure on this rank (its batch
        cannot be prepared, or its forward raises at its own batch shape) does not end its part
        of the epoch: it replays the forward on no-work tokens of the same count, with stand-ins
        for the collectives it already issued and the boundaries it already published, so it
        issues exactly the collectives its peers still issue and parks where they park. The
        error stays on the epoch, and the round plan ends the epoch as failed on every rank."""
        announced = tokens(epoch.chunks)
        across_dp = None
        if epoch.dp_counts is not None:
            across_dp = torch.tensor([max(c, 1) for c in epoch.dp_counts], dtype=torch.int32)
            announced = int(across_dp[self.dp_rank])
        try:
            batch = self._prepare(epoch)
            if batch.num_tokens != announced and across_dp is not None:
                raise RuntimeError(f"P's batch on rank {self.rank} has {batch.num_tokens} tokens, "
                                   f"but the rank announced {announced} to the DP group")
            self._run_model(epoch, batch, across_dp)
        except EpochCancelled:
            raise
        except Exception as exc:
            if not self.replay_failures:
                raise
            epoch.error = exc
            epoch.replay_from = epoch.reached
            epoch.skip = epoch.stood_in = epoch.collectives
            self._run_model(epoch, self.builder.no_work(max(announced, 1)), across_dp)

    def _prepare(self, epoch: Epoch) -> PBatch:
        if self.faults is not None:
            self.faults.preparing_batch(self.rank, epoch.id)
        return self.builder.build(epoch.chunks) if epoch.chunks else self.builder.no_work()

    def _run_model(self, epoch: Epoch, batch: PBatch, across_dp: torch.Tensor | None) -> None:
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

    def issue_collective(self, epoch: Epoch, group: Any, collective: Any, args: tuple,
                         kwargs: dict) -> Any:
        """A P collective of `epoch` (called on the P thread by vllm_glue/collectives.py's
        wrappers); in a replay, a stand-in for each one issued before the failure.
        On vLLM's communicators, shared with D, it runs on D's stream, after the D iteration the
        turnstile released this segment behind: their device state (NCCL's per-communicator
        order, custom all-reduce's signal flags) does not survive use from two streams at once.
        On P's own communicators (`phase_ep`, docs/deepep.md) it stays on P's stream, unless its
        group crosses one of D's (then only D's stream orders it against D's kernels)."""
        if epoch.skip:
            epoch.skip -= 1
            return collectives.stand_in(group, collective, args, kwargs)
        if self.faults is not None and epoch.error is None:
            self.faults.at_collective(self.rank, epoch.id, epoch.collectives)
        out = self._issue(group, collective, args, kwargs)
        epoch.collectives += 1
        return out

    def _issue(self, group: Any, collective: Any, args: tuple, kwargs: dict) -> Any:
        name = group.unique_name
        own = self.phase_ep is not None and self.phase_ep.owns(group)
        if own:
            self.phase_ep.note_collective()
            if not self.phase_ep.crossed(group):
                return collective(group, *args, **kwargs)
            if not self.route.is_crossed(name):
                self.route.register(name, group.ranks, self.phase_ep.groups.d_groups)
        elif not self.route.is_crossed(name):
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
