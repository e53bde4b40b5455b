"""The per-rank vLLM worker behind the `ainfer_pd` backend.

The base class is the platform's own worker (CPUWorker on CPU, the V1 GPU Worker on CUDA), chosen
when this module is imported in the worker process, so the same class name serves both platforms.
With the P lane on (`mode="pd"`), each D iteration is one turnstile round of the lane
(`lane_round.LaneRound`, whose docstring is the round's contract): `before_d` before vLLM's
forward, `after_d` after the last thing D enqueues for the step. vLLM 0.26 splits a step into
`execute_model` (the forward; it returns None when sampling follows) and `sample_tokens`
(sampling and the speculative drafter's forward), so a round that `execute_model` opens with a
forward ends at the end of `sample_tokens`. A D iteration is every step at DP=1 (0-token steps
too: they happen while every request is parked in P), and a real or dummy forward at DP>1, the
only calls that all DP ranks make together.
"""

from __future__ import annotations

import gc
import logging
import time

from vllm.platforms import current_platform

from vllm_ainfer_pd.config import AInferPDConfig

logger = logging.getLogger(__name__)
SUMMARY_INTERVAL_S = 60.0


def _platform_worker_cls() -> type:
    if current_platform.is_cpu():
        from vllm.v1.worker.cpu_worker import CPUWorker

        return CPUWorker
    from vllm.v1.worker.gpu_worker import Worker

    return Worker


class AInferPDWorker(_platform_worker_cls()):
    p_lane = None
    phase_ep = None  # P's own expert-parallel state (deepep.manager.PhaseEP), at DP > 1 with EP
    # (load, D tokens) of a round whose forward ran in `execute_model` and whose sampling and
    # drafting run in the `sample_tokens` call that follows.
    _open_round = None

    def ainfer_pd_status(self) -> dict:
        """Per-rank status over `collective_rpc("ainfer_pd_status")`: worker, mode, counters."""
        lane = self.p_lane
        return {
            "worker": type(self).__name__,
            # vLLM's runner under the worker: the V1 runner's module is `*_model_runner`,
            # Model Runner V2's `vllm.v1.worker.{gpu,cpu}.model_runner`.
            "model_runner": f"{type(self.model_runner).__module__}."
                            f"{type(self.model_runner).__qualname__}",
            "rank": self.rank if lane is None else lane.rank,
            "mode": AInferPDConfig.from_vllm_config(self.vllm_config).mode,
            "p_lane": lane.stats.as_dict() if lane is not None else None,
            # GPU: the scratch P's MoE took from its own workspace manager (0 if P never used it).
            "p_workspace_bytes": lane.workspace_bytes() if lane is not None else None,
            # GPU: CUDA priorities of D's (vLLM's compute) stream and P's; lower is higher.
            "stream_priorities": lane.stream_priorities() if lane is not None else None,
            "attention_backends": lane.attention_backends() if lane is not None else None,
            "phase_ep": self.phase_ep.status() if self.phase_ep is not None else None,
        }

    def init_device(self) -> None:
        if current_platform.is_cpu():
            # Expert parallelism on CPU needs what vLLM 0.26's CPU path lacks (see cpu_compat);
            # installed before the model and its communicators are built.
            from vllm_ainfer_pd.vllm_glue import cpu_compat

            cpu_compat.install()
        super().init_device()
        config = AInferPDConfig.from_vllm_config(self.vllm_config)
        if (config.p_lane_enabled and config.d_stream_priority == "high"
                and current_platform.is_cuda()):
            from vllm_ainfer_pd.vllm_glue import streams

            streams.raise_compute_stream_priority()

    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        super().load_model(load_dummy_weights=load_dummy_weights)
        # P's own expert-parallel state, after vLLM built its groups and kernels (and, for DeepEP,
        # D's low-latency buffer) and before vLLM measures memory and captures D's CUDA graphs.
        # Collective: every rank of the job loads its model at the same point.
        from vllm_ainfer_pd.deepep.manager import PhaseEP, needs_phase_ep
        from vllm_ainfer_pd.worker import phase_state

        config = AInferPDConfig.from_vllm_config(self.vllm_config)
        if config.p_lane_enabled and needs_phase_ep(self.vllm_config.parallel_config):
            self.phase_ep = PhaseEP.build(self.vllm_config, self.model_runner.get_model(),
                                          config.p_deepep_sms, phase_state._P)

    def initialize_from_config(self, kv_cache_config) -> None:
        super().initialize_from_config(kv_cache_config)  # builds the KV cache and the connector
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
        from vllm.distributed.parallel_state import get_world_group

        from vllm_ainfer_pd.connector import AInferPDConnector
        from vllm_ainfer_pd.worker.p_lane import PLane

        if not has_kv_transfer_group():
            return
        connector = get_kv_transfer_group()
        if not isinstance(connector, AInferPDConnector):
            return
        config = connector.config
        self._dp_size = self.vllm_config.parallel_config.data_parallel_size
        # The world rank (unique across DP replicas; `self.rank` restarts at 0 in each replica).
        rank = get_world_group().rank
        self.p_lane = PLane(self.model_runner, config, rank, self._rendezvous(config),
                            dp_size=self._dp_size, phase_ep=self.phase_ep)
        connector.lane = self.p_lane
        self._max_num_seqs = self.vllm_config.scheduler_config.max_num_seqs
        self._last_summary = time.monotonic()

    def _rendezvous(self, config: AInferPDConfig):
        """The all-rank CPU rendezvous of the turnstile, over every rank whose collectives P and D
        share (the world group: TP, and DP x EP ranks, on one host or several). Collective: every
        rank builds it; `rendezvous="auto"` picks shared memory, shared memory per host with gloo
        between hosts, or gloo from where the ranks run."""
        from vllm.distributed.parallel_state import get_world_group

        from vllm_ainfer_pd.turnstile import make_rendezvous

        world = get_world_group()
        rendezvous = make_rendezvous(config.rendezvous, world.cpu_group,
                                     timeout_s=config.timeout_s, name="p_lane")
        if world.rank == 0:
            logger.info("P lane: %s over %d ranks", type(rendezvous).__name__, world.world_size)
        return rendezvous

    def execute_model(self, scheduler_output):
        lane = self.p_lane
        d_tokens = scheduler_output.total_num_scheduled_tokens
        if lane is None or not (self._dp_size == 1 or d_tokens > 0):
            return super().execute_model(scheduler_output)
        lane.before_d()
        lane.d_rows = len(scheduler_output.num_scheduled_tokens)  # read by this forward's DP sync
        output = super().execute_model(scheduler_output)
        round_end = (self._load(len(scheduler_output.num_scheduled_tokens)), d_tokens)
        if output is None:
            # vLLM samples and drafts in the `sample_tokens` call that follows: the same D
            # iteration, so P stays parked until the drafter's last enqueue.
            self._open_round = round_end
        else:
            self._end_round(*round_end)
        return output

    def sample_tokens(self, grammar_output):
        output = super().sample_tokens(grammar_output)
        if self._open_round is not None:
            round_end, self._open_round = self._open_round, None
            self._end_round(*round_end)
        return output

    def execute_dummy_batch(self) -> None:
        lane = self.p_lane
        if lane is None:
            return super().execute_dummy_batch()
        lane.before_d()
        lane.d_rows = 0
        super().execute_dummy_batch()  # vLLM's dummy forward runs the drafter's dummy too
        # No D rows here, but P's pressure is real: an epoch opened in dummy rounds (no rank
        # decoding) takes the large spans an idle D allows, not one layer per round.
        self._end_round(self._load(0), 0)

    def _end_round(self, load, d_tokens: int) -> None:
        self.p_lane.after_d(load, d_tokens)
        self._maybe_log_summary()

    def _load(self, rows: int):
        """Load for the segment policy: the step's D rows over the batch size, P work not yet
        issued (queued jobs and the rest of the open epoch) and the epoch this round releases,
        both over the step's token budget. Equal on the TP ranks of a replica; at DP > 1 the lane
        shares the max over ranks in its rendezvous."""
        from vllm_ainfer_pd.turnstile import Load

        budget = self.vllm_config.scheduler_config.max_num_batched_tokens
        return Load(d_occupancy=min(rows / self._max_num_seqs, 1.0),
                    p_pressure=self.p_lane.p_work_tokens() / budget,
                    epoch_size=self.p_lane.epoch_tokens() / budget)

    def _maybe_log_summary(self) -> None:
        now = time.monotonic()
        if now - self._last_summary >= SUMMARY_INTERVAL_S and self.p_lane.stats.epochs:
            self._last_summary = now
            logger.info("%s", self.p_lane.summary())

    def shutdown(self) -> None:
        lane = self.p_lane
        if lane is not None:
            logger.info("%s", lane.summary())
            lane.close()
        if self.phase_ep is not None:
            config = AInferPDConfig.from_vllm_config(self.vllm_config)
            rank = lane.rank if lane is not None else self.rank
            try:
                self.phase_ep.close(timeout_s=config.timeout_s, rank=rank)
            except Exception as exc:  # a peer gone at shutdown: say so, and shut down anyway
                logger.warning("P lane rank %d: %s", rank, exc)
        super().shutdown()
        # This worker runs in a process of its own (the backend's executor is vLLM's
        # multiprocess one), which ends right after this. Freezing the heap skips the
        # interpreter's final cyclic-GC scan of it, as vLLM does on ROCm: the exit reclaims the
        # memory anyway, and the scan took 2-3 s of a core per rank on the CPU.
        gc.freeze()
