"""The vLLM executor behind `--distributed-executor-backend ainfer_pd`.

vLLM's EngineCore builds the executor before the scheduler, so `_init_executor` is where this
backend chooses its worker class (spawned per rank) and its scheduler class (built by EngineCore
right after). Workers are vLLM's multiprocess workers: one process per rank, even at TP=1.
"""

from __future__ import annotations

import vllm
from vllm.v1.executor.multiproc_executor import MultiprocExecutor

from vllm_ainfer_pd import attention_backends
from vllm_ainfer_pd.config import AInferPDConfig, ConfigError
from vllm_ainfer_pd.vllm_glue import check_vllm, engine_config, installed_release, vllm_at_least
from vllm_ainfer_pd.vllm_glue.engine_config import raise_worker_start_errors

WORKER_CLS = "vllm_ainfer_pd.worker.AInferPDWorker"
SCHEDULER_CLS = "vllm_ainfer_pd.executor.scheduler.AInferPDScheduler"
ASYNC_SCHEDULER_CLS = "vllm_ainfer_pd.executor.scheduler.AInferPDAsyncScheduler"
# What vLLM's platforms put in `parallel_config.worker_cls` for "auto"; any other value is a user's
# own worker, which this backend cannot wrap.
PLATFORM_WORKERS = (
    "auto",
    "vllm.v1.worker.cpu_worker.CPUWorker",
    "vllm.v1.worker.gpu_worker.Worker",
)


class AInferPDExecutor(MultiprocExecutor):
    # Async scheduling (vLLM's GPU default; the CPU platform turns it off) is MultiprocExecutor's:
    # the P lane's reports travel in the step outputs like any KV connector's.
    supports_pp = False

    @staticmethod
    def validate(vllm_config) -> AInferPDConfig:
        """Check the shapes of the vLLM symbols the backend patches or relies on (vllm_glue;
        an untested vLLM release whose shapes all match is named in the log), the ainfer_pd
        options and the deployment; return the config."""
        check_vllm(vllm.__version__)
        config = AInferPDConfig.from_vllm_config(vllm_config)
        parallel = vllm_config.parallel_config
        if parallel.pipeline_parallel_size != 1:
            raise ConfigError(
                f"ainfer_pd does not support pipeline parallelism "
                f"(pipeline_parallel_size={parallel.pipeline_parallel_size})"
            )
        if vllm_config.use_v2_model_runner:
            check_model_runner_v2(vllm_config, config)
        if getattr(parallel, "enable_dbo", False):
            raise ConfigError("ainfer_pd cannot run with dual-batch overlap (--enable-dbo)")
        if parallel.worker_cls not in PLATFORM_WORKERS and parallel.worker_cls != WORKER_CLS:
            raise ConfigError(
                f"ainfer_pd chooses its own worker; got worker_cls={parallel.worker_cls!r}"
            )
        if config.p_lane_enabled and vllm_config.lora_config is not None:
            # LoRA layers read the adapter mapping vLLM sets for D's batch; P's forward, on its
            # own thread and batch, would apply it to the wrong tokens.
            raise ConfigError("ainfer_pd mode='pd' does not run LoRA adapters (--enable-lora): "
                              "the P lane's forward has no adapter mapping; use mode='normal'")
        if config.p_lane_enabled and engine_config.returns_routed_experts(vllm_config):
            # vLLM records each token's experts inside the model runner's step (0.32: Model
            # Runner V2's capture hooks; 0.26 also refuses the flag beside any KV connector, the
            # slot the lane runs in): a prompt the lane prefills on its own thread has no record,
            # or writes into D's.
            raise ConfigError("ainfer_pd mode='pd' cannot return routed experts "
                              "(--enable-return-routed-experts): the P lane prefills prompts "
                              "outside the model runner's steps, where vLLM records them; use "
                              "mode='normal'")
        if config.p_lane_enabled:
            check_lane_parallelism(parallel, config)
            if config.ordering == "free" and vllm_config.device_config.device_type == "cpu":
                # P's compute would run beside D's on the same cores, and vLLM's CPU kernels are
                # not made for two threads at once (its fused MoE crashed so here).
                raise ConfigError("ainfer_pd.ordering='free' runs P's kernels beside D's on a "
                                  "GPU; on the CPU use ordering='fine'")
            attention_backends.check_config(vllm_config)
        scheduler_cls = vllm_config.scheduler_config.scheduler_cls
        if scheduler_cls not in (None, SCHEDULER_CLS, ASYNC_SCHEDULER_CLS):
            raise ConfigError(
                f"ainfer_pd chooses its own scheduler; got scheduler_cls={scheduler_cls!r}"
            )
        return config

    def _init_executor(self) -> None:
        self.ainfer_pd_config = self.validate(self.vllm_config)
        raise_worker_start_errors(self.vllm_config)
        configure_p_lane(self.vllm_config, self.ainfer_pd_config)
        # These mutations are seen by EngineCore and the workers it spawns (the config is pickled
        # to them), not by the API server's copy.
        self.parallel_config.worker_cls = WORKER_CLS
        scheduler = self.vllm_config.scheduler_config
        scheduler.scheduler_cls = ASYNC_SCHEDULER_CLS if scheduler.async_scheduling \
            else SCHEDULER_CLS
        super()._init_executor()


def check_model_runner_v2(vllm_config, config: AInferPDConfig) -> None:
    """Model Runner V2 (vLLM's default runner since 0.29) runs the lane from vLLM 0.32, the first
    release it was built and tested on (docs/model-runner-v2.md); before that it is refused with
    the variable that selects the V1 runner. The V2 features P's own batch does not describe are
    refused by name (a model whose V2 model state is not the default one is refused when the
    lane starts: `vllm_glue.model_runner.check_model_state`)."""
    if not vllm_at_least("0.32"):
        architectures = getattr(vllm_config.model_config, "architectures", None) or ["?"]
        raise ConfigError(
            f"ainfer_pd runs on vLLM's Model Runner V2 from vLLM 0.32; vLLM "
            f"{installed_release()} selects it here (its default for "
            f"{', '.join(architectures)}): set VLLM_USE_V2_MODEL_RUNNER=0"
        )
    if not config.p_lane_enabled:
        return
    if vllm_config.cache_config.kv_sharing_fast_prefill:
        # The runner then builds the forward's logits indices into the attention metadata,
        # which P's batch (no logits) does not carry.
        raise ConfigError("ainfer_pd mode='pd' on Model Runner V2 does not run KV-sharing fast "
                          "prefill (--kv-sharing-fast-prefill); use mode='normal'")
    if vllm_config.attention_config.hisparse_config is not None:
        # HiSparse offloads sparse-MLA KV to a host pool behind a per-request hot buffer the
        # runner keeps for D's steps; P's writes into its reserved blocks are not in that
        # bookkeeping.
        raise ConfigError("ainfer_pd mode='pd' on Model Runner V2 does not run HiSparse "
                          "attention (attention_config.hisparse_config); use mode='normal'")


def check_lane_parallelism(parallel, config: AInferPDConfig) -> None:
    """The layouts the P lane cannot run, named. Context parallelism splits each request's KV over
    ranks, which the lane's own attention metadata (`worker/p_batch.py`) does not describe. With
    expert parallelism across DP ranks (vLLM's all-to-all kernels), P's dispatch runs beside D's,
    so each phase needs its own all-to-all state (docs/deepep.md): the stateless backend and
    DeepEP have it, every other backend is refused by name (`deepep.manager.select_backend`).
    Expert load balancing moves expert weights after a D step, while a P epoch may be parked
    between layers with kernels still queued on its stream. `ordering="free"` lets P run
    unordered against D, which only an engine of one rank may: elsewhere P shares collectives
    (or the DP synchronisation) with its peers."""
    ranks = parallel.tensor_parallel_size * parallel.data_parallel_size
    if config.ordering == "free" and ranks != 1:
        raise ConfigError(f"ainfer_pd.ordering='free' runs P unordered against D, which needs an "
                          f"engine of one rank; this one has tensor_parallel_size="
                          f"{parallel.tensor_parallel_size} x data_parallel_size="
                          f"{parallel.data_parallel_size}; use ordering='fine'")
    if parallel.enable_eplb:
        raise ConfigError("ainfer_pd mode='pd' does not run expert load balancing "
                          "(--enable-eplb): it moves expert weights under a parked P epoch; "
                          "use mode='normal'")
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if (size := getattr(parallel, name)) != 1:
            raise ConfigError(f"ainfer_pd mode='pd' does not run context parallelism "
                              f"({name}={size}); use mode='normal'")
    from vllm_ainfer_pd.deepep.manager import select_backend

    select_backend(parallel)


def configure_p_lane(vllm_config, config: AInferPDConfig) -> None:
    """Point vLLM's KV-connector slot at the P lane (`mode="pd"`). Runs in the frontend too (via
    the plugin), so its stat loggers export the lane's metrics, and again in EngineCore, before
    the workers are spawned and the scheduler is built. Idempotent."""
    from vllm.config import KVTransferConfig

    from vllm_ainfer_pd.connector import CONNECTOR_NAME, kv_transfer_config_for, register_connector

    raw = kv_transfer_config_for(config)
    current = vllm_config.kv_transfer_config
    if raw is None or (current is not None and current.kv_connector == CONNECTOR_NAME):
        return
    if current is not None and current.kv_connector is not None:
        raise ConfigError(
            f"ainfer_pd mode='pd' runs its P lane in vLLM's KV-connector slot, which "
            f"--kv-transfer-config already gives to {current.kv_connector!r}; use "
            f"mode='normal' or drop the other connector"
        )
    register_connector()
    vllm_config.kv_transfer_config = KVTransferConfig(**raw)
    # What VllmConfig.__post_init__ does for a connector without hybrid-KV (HMA) support; this
    # runs after it, so repeat it here (vLLM refuses such a connector while HMA is on).
    vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = True
