"""The fields of vLLM's engine config the executor reads and sets (`executor/__init__.py`).

No patch: `AInferPDExecutor` validates the deployment from these fields and, before vLLM builds
the workers and the scheduler, sets the worker and scheduler classes and puts the P lane in the
KV-connector slot (after `VllmConfig.__post_init__`, so it repeats what that does for a
connector without hybrid-KV support).
"""

from __future__ import annotations

from typing import Any

from vllm_ainfer_pd.vllm_glue.shapes import Patch, vllm_at_least

PATCHES = [
    Patch("vllm.config:VllmConfig", "the lane takes vLLM's KV-connector slot; Model Runner V2 "
          "before 0.32 and LoRA are refused",
          uses=("kv_transfer_config", "use_v2_model_runner", "lora_config", "additional_config",
                "attention_config", "speculative_config", "device_config", "cache_config"),
          does="sets"),
    Patch("vllm.config:SchedulerConfig", "the planner's scheduler class; a connector without "
          "hybrid-KV support needs the hybrid KV cache manager off",
          uses=("scheduler_cls", "async_scheduling", "disable_hybrid_kv_cache_manager",
                "max_num_batched_tokens", "max_num_seqs"), does="sets"),
    Patch("vllm.config:ParallelConfig", "the worker class, and the layouts the lane cannot run",
          uses=("worker_cls", "pipeline_parallel_size", "data_parallel_size",
                "data_parallel_rank", "enable_expert_parallel", "all2all_backend", "enable_eplb",
                "decode_context_parallel_size", "prefill_context_parallel_size"), does="sets"),
    Patch("vllm.config:ModelConfig", "custom logits processors meet the model runner's own "
          "refusals before any worker starts", uses=("logits_processors", "runner_type")),
    Patch("vllm.config:ModelConfig", "routed-expert capture (refused beside the lane's KV "
          "connector by vLLM itself) is refused at validation",
          uses=("enable_return_routed_experts",), vllm="<0.32"),
    Patch("vllm.config:VllmConfig", "routed-expert capture is refused at validation (an "
          "auxiliary output of Model Runner V2, whose hooks would record P's routing)",
          uses=("aux_output_config",), vllm=">=0.32"),
    Patch("vllm.config.aux_output:AuxOutputConfig", "where routed-expert capture is asked for",
          uses=("enable_return_routed_experts",), vllm=">=0.32"),
    Patch("vllm.config:CacheConfig", "KV-sharing fast prefill is refused with the lane on Model "
          "Runner V2", uses=("kv_sharing_fast_prefill",), vllm=">=0.32"),
    Patch("vllm.config:AttentionConfig", "HiSparse attention is refused with the lane on Model "
          "Runner V2", uses=("hisparse_config",), vllm=">=0.32"),
    Patch("vllm.config:AttentionConfig", "an attention backend the user names is checked "
          "against the ones the lane serves (`attention_backends.py`)",
          uses=("backend", "backend_per_kind")),
    Patch("vllm.config:SpeculativeConfig", "a speculative drafter's attention backend is "
          "checked too", uses=("attention_backend",)),
    Patch("vllm.v1.sample.logits_processor:STR_SPEC_DEC_REJECTS_LOGITSPROCS", "the message of "
          "vLLM's refusal of custom logits processors beside speculative decoding"),
    Patch("vllm.v1.sample.logits_processor:STR_POOLING_REJECTS_LOGITSPROCS", "the message of "
          "vLLM's refusal of custom logits processors for pooling models"),
    Patch("vllm.config:KVTransferConfig", "the lane's connector settings",
          uses=("kv_connector", "kv_role", "kv_load_failure_policy",
                "kv_connector_extra_config"), does="builds"),
]


def raise_worker_start_errors(vllm_config) -> None:
    """Raise, in the engine's own process, the errors vLLM's model runner raises while a worker
    starts (custom logits processors with a pooling model, and with speculative decoding on the
    V1 runner: its `build_logitsprocs`; Model Runner V2's `build_custom_logits_processors`),
    with vLLM's exception type and message. This backend's workers are always processes of their
    own, where vLLM reports any start failure as its generic 'WorkerProc initialization failed';
    raised here, the caller sees vLLM's ValueError, as with vLLM's in-process executor."""
    from vllm.v1.sample import logits_processor

    model = vllm_config.model_config
    if not model.logits_processors:
        return
    if model.runner_type == "pooling":
        raise ValueError(logits_processor.STR_POOLING_REJECTS_LOGITSPROCS)
    # Model Runner V2 runs custom logits processors beside speculative decoding.
    if vllm_config.speculative_config is not None and not vllm_config.use_v2_model_runner:
        raise ValueError(logits_processor.STR_SPEC_DEC_REJECTS_LOGITSPROCS)


def returns_routed_experts(vllm_config: Any) -> bool:
    """Whether the engine was asked to return each token's routed experts."""
    if vllm_at_least("0.32"):
        return vllm_config.aux_output_config.enable_return_routed_experts
    return vllm_config.model_config.enable_return_routed_experts
