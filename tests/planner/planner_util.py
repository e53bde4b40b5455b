"""Helpers for planner tests: the real AInferPDScheduler over a real VllmConfig on CPU, a fake
KVCacheConfig and no model (vLLM's own scheduler-test pattern)."""

from __future__ import annotations

import itertools
from typing import Any

import torch
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from vllm_ainfer_pd.config import AInferPDConfig
from vllm_ainfer_pd.connector import kv_transfer_config_for, register_connector
from vllm_ainfer_pd.executor.scheduler import AInferPDScheduler

BLOCK_SIZE = 16
NUM_BLOCKS = 40  # block 0 is vLLM's null block: 39 usable


def make_scheduler(
    model: str,
    *,
    lane: dict[str, Any] | None = None,
    connector: bool = True,
    num_blocks: int = NUM_BLOCKS,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 256,
    failure_policy: str = "recompute",
    cls: type[Scheduler] = AInferPDScheduler,
    prefix_caching: bool = False,
    kv_spec: Any = None,
) -> AInferPDScheduler:
    """A real scheduler; `lane` are ainfer_pd options for the connector (None: defaults);
    `kv_spec`: the one KV cache group's spec (default: full attention)."""
    register_connector()
    kv_transfer = None
    if connector:
        raw = kv_transfer_config_for(AInferPDConfig.from_dict(lane))
        assert raw is not None
        raw["kv_load_failure_policy"] = failure_policy
        kv_transfer = KVTransferConfig(**raw)
    vllm_config = VllmConfig(
        model_config=ModelConfig(model=model, skip_tokenizer_init=True, dtype="float32", seed=0),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=prefix_caching),
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_num_batched_tokens * 4,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
        kv_transfer_config=kv_transfer,
    )
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer0"],
                kv_spec or FullAttentionSpec(
                    block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8, dtype=torch.float32
                ),
            )
        ],
    )
    return cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK_SIZE,
        log_stats=False,
    )


_ids = itertools.count()
init_none_hash(sha256)  # once: the root of every block hash chain (random per call)


def make_request(num_prompt_tokens: int, max_tokens: int = 8, req_id: str | None = None,
                 hashed: bool = False, **sampling: Any) -> Request:
    """`hashed`: with the block hashes EngineCore gives requests when prefix caching is on."""
    rid = req_id or f"r{next(_ids)}"
    hasher = get_request_block_hasher(BLOCK_SIZE, sha256) if hashed else None
    return Request(
        request_id=rid,
        prompt_token_ids=[(i % 50) + 1 for i in range(num_prompt_tokens)],
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling),
        pooling_params=None,
        block_hasher=hasher,
    )


def free_blocks(scheduler: AInferPDScheduler) -> int:
    return scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


def step(
    scheduler: AInferPDScheduler,
    *,
    finished_recving: set[str] | None = None,
    invalid_block_ids: set[int] | None = None,
    lifetimes: dict[str, int] | None = None,
) -> SchedulerOutput:
    """One engine step: schedule, then a hand-made worker output (token 7 for every scheduled row
    that reaches the end of its prompt) carrying the given P-lane reports."""
    from vllm_ainfer_pd.wire import PLaneWorkerMeta

    # Positional, as EngineCore calls it (`schedule(self._should_throttle_prefills())`).
    out = scheduler.schedule(False)
    req_ids = list(out.num_scheduled_tokens)
    sampled = []
    for rid in req_ids:
        req = scheduler.requests[rid]
        done = req.num_computed_tokens >= req.num_tokens  # advanced at schedule time
        sampled.append([7] if done else [])
    kv_out = KVConnectorOutput(
        finished_recving=finished_recving or None,
        invalid_block_ids=invalid_block_ids or set(),
        kv_connector_worker_meta=PLaneWorkerMeta(lifetimes) if lifetimes else None,
    )
    runner_out = ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
        kv_connector_output=kv_out,
    )
    scheduler.update_from_output(out, runner_out)
    return out
