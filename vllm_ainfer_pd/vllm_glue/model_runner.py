"""What the P lane reads of vLLM's GPU model runner (which the CPU runner subclasses) to build
P's batch and attention metadata beside D's (`worker/p_batch.py`, `worker/p_lane.py`): the V1
runner (`gpu_model_runner`), or Model Runner V2 (`gpu/model_runner`, vLLM 0.32 on), which keeps
the same attention groups but no persistent input batch (docs/model-runner-v2.md).

No patch: P never touches the runner's persistent buffers or input batch, but it copies their
shapes (block sizes, input dtypes, the batch order the attention builders assume) and builds
its own metadata builders of the same classes as D's.
"""

from __future__ import annotations

from typing import Any

from vllm_ainfer_pd.vllm_glue.shapes import Patch, vllm_at_least

PATCHES = [
    Patch("vllm.v1.worker.gpu_model_runner:GPUModelRunner", "P's model, device, KV cache "
          "groups, input dtypes and batch order come from D's runner",
          uses=("vllm_config", "device", "get_model", "attn_groups", "input_batch", "input_ids",
                "positions", "reorder_batch_threshold"), does="reads"),
    Patch("vllm.v1.worker.gpu_input_batch:InputBatch", "the block tables of D's batch give each "
          "KV cache group's kernel block size", uses=("block_table",), does="reads"),
    Patch("vllm.v1.worker.block_table:BlockTable", "P's block table rows and KV slots, in kernel "
          "blocks", uses=("block_size",), does="reads"),
    Patch("vllm.v1.worker.block_table:BlockTable", "how many kernel blocks a KV-manager block "
          "holds (the table's `block_size` is the kernel block size)",
          uses=("blocks_per_kv_block",), does="reads", vllm="<0.32"),
    Patch("vllm.v1.worker.utils:AttentionGroup", "P builds one metadata builder per attention "
          "group, of the class of D's; the group's backend is checked against the ones the lane "
          "serves", uses=("layer_names", "get_metadata_builder", "backend"), does="reads"),
    Patch("vllm.v1.worker.utils:AttentionGroup", "the group's kernel block size (None: the "
          "KV-manager block's; the table's `block_size` is the manager's), which vLLM applies in "
          "the group's `build_metadata`: P applies it to its own table",
          uses=("kernel_block_size", "kv_cache_spec"), does="reads", vllm=">=0.32"),
    Patch("vllm.v1.worker.gpu.model_runner:GPUModelRunner", "Model Runner V2: P's model, device, "
          "KV cache groups, manager block sizes, input dtypes and batch order",
          uses=("vllm_config", "device", "get_model", "attn_groups", "block_tables",
                "input_buffers", "decode_query_len", "model_state"), does="reads",
          vllm=">=0.32"),
    Patch("vllm.v1.worker.gpu.model_states.default:DefaultModelState", "Model Runner V2: the "
          "model state whose inputs are P's token ids and positions alone", vllm=">=0.32"),
    Patch("vllm.v1.worker.gpu.block_table:BlockTables", "Model Runner V2: each KV cache group's "
          "KV-manager block size", uses=("block_sizes",), does="reads", vllm=">=0.32"),
    Patch("vllm.v1.worker.gpu.input_batch:InputBuffers", "Model Runner V2: the dtypes of D's "
          "token ids and positions", uses=("input_ids", "positions"), does="reads",
          vllm=">=0.32"),
    Patch("vllm.v1.worker.gpu.model_runner:sort_batch_req_ids", "Model Runner V2's order of a "
          "batch's requests, which its attention builders assume: P's batch takes it too",
          ("num_tokens_per_req", "draft_tokens", "decode_query_len"), does="calls",
          vllm=">=0.32"),
    Patch("vllm.v1.attention.backend:AttentionBackend.get_name", "the attention backend vLLM "
          "chose for a KV cache group, by name (`attention_backends.py`)", (), does="calls"),
    Patch("vllm.v1.attention.backend:AttentionMetadataBuilder.__init__", "P's builders are new "
          "instances (builders keep state, so D's are not shared)",
          ("self", "kv_cache_spec", "layer_names", "vllm_config", "device"), does="calls"),
    Patch("vllm.v1.attention.backend:AttentionMetadataBuilder.build", "P's attention metadata",
          uses=("common_prefix_len", "common_attn_metadata"), does="calls"),
    Patch("vllm.v1.attention.backend:AttentionMetadataBuilder", "the builders' KV cache spec",
          uses=("kv_cache_spec",), does="reads"),
    Patch("vllm.v1.attention.backend:CommonAttentionMetadata", "P's batch, described as vLLM's "
          "runner describes D's",
          uses=("query_start_loc", "query_start_loc_cpu", "seq_lens", "seq_lens_cpu_upper_bound",
                "num_reqs", "num_actual_tokens", "max_query_len", "max_seq_len", "causal",
                "is_prefilling", "positions", "block_table_tensor", "slot_mapping"),
          does="builds"),
    Patch("vllm.v1.attention.backend:CommonAttentionMetadata", "the private CPU copies vLLM's "
          "runner gives D's builders", uses=("_seq_lens_cpu", "_num_computed_tokens_cpu"),
          does="builds", vllm="<0.32"),
]


def runs_model_runner_v2(runner: Any) -> bool:
    """Whether `runner` is Model Runner V2 (the runner vLLM's worker built from this flag)."""
    return bool(runner.vllm_config.use_v2_model_runner)


def kernel_blocks(runner: Any, gid: int) -> tuple[int, int]:
    """(kernel block size, kernel blocks per KV-manager block) of KV cache group `gid`: the
    attention kernels address KV in kernel blocks, which may be smaller than the manager's."""
    if not vllm_at_least("0.32"):
        table = runner.input_batch.block_table[gid]
        return table.block_size, table.blocks_per_kv_block
    manager = (runner.block_tables.block_sizes[gid] if runs_model_runner_v2(runner)
               else runner.input_batch.block_table[gid].block_size)
    sizes = {group.kernel_block_size for group in runner.attn_groups[gid]}
    if sizes == {None}:
        return manager, 1
    if len(sizes) != 1 or None in sizes:
        raise ValueError(f"the P lane needs one kernel block size per KV cache group; group "
                         f"{gid} has {sorted(map(str, sizes))}")
    kernel = sizes.pop()
    return kernel, manager // kernel


def check_model_state(runner: Any) -> None:
    """Model Runner V2 keeps a model's own inputs (Mamba state, encoder outputs, M-RoPE positions,
    multimodal embeddings, prompt embeddings) in a model state beside its batch; P's batch carries
    only token ids and positions, which is what the default model state gives the model."""
    if not runs_model_runner_v2(runner):
        return
    from vllm.v1.worker.gpu.model_states.default import DefaultModelState

    if type(runner.model_state) is not DefaultModelState:
        raise ValueError(f"ainfer_pd mode='pd' on Model Runner V2 runs models of vLLM's default "
                         f"model state; this model's is {type(runner.model_state).__name__}: use "
                         f"mode='normal'")


def input_dtypes(runner: Any) -> tuple[Any, Any]:
    """The dtypes of D's token ids and positions. P runs D's compiled graph, which vLLM calls
    without guards, so P's inputs must have the dtypes D's buffers gave it at compile time (token
    ids are int32 there: an int64 tensor would be read as pairs of int32 words)."""
    if runs_model_runner_v2(runner):
        return runner.input_buffers.input_ids.dtype, runner.input_buffers.positions.dtype
    return (getattr(runner.input_ids, "gpu", runner.input_ids).dtype,
            getattr(runner.positions, "gpu", runner.positions).dtype)


def v2_batch_order(runner: Any, query_lens: list[int]) -> list[int]:
    """The indices of a batch's requests in Model Runner V2's order (`sort_batch_req_ids`: decodes,
    then ascending query length), for requests without draft tokens, as P's are."""
    from vllm.v1.worker.gpu.model_runner import sort_batch_req_ids

    order = sort_batch_req_ids({str(i): n for i, n in enumerate(query_lens)}, {},
                               runner.decode_query_len)
    return [int(i) for i in order]


def private_cpu_copies(seq_lens_cpu: Any, num_computed_tokens_cpu: Any) -> dict[str, Any]:
    """The private CPU copies of `CommonAttentionMetadata` vLLM's runner sets, where it has them."""
    if vllm_at_least("0.32"):
        return {}
    return {"_seq_lens_cpu": seq_lens_cpu, "_num_computed_tokens_cpu": num_computed_tokens_cpu}
