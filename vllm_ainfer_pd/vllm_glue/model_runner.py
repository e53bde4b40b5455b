"""What the P lane reads of vLLM's GPU model runner (which the CPU runner subclasses) to build
P's batch and attention metadata beside D's (`worker/p_batch.py`, `worker/p_lane.py`).

No patch: P never touches the runner's persistent buffers or input batch, but it copies their
shapes (block sizes, input dtypes, the batch order the attention builders assume) and builds
its own metadata builders of the same classes as D's.
"""

from __future__ import annotations

from vllm_ainfer_pd.vllm_glue.shapes import Patch

PATCHES = [
    Patch("vllm.v1.worker.gpu_model_runner:GPUModelRunner", "P's model, device, KV cache "
          "groups, input dtypes and batch order come from D's runner",
          uses=("vllm_config", "device", "get_model", "attn_groups", "input_batch", "input_ids",
                "positions", "reorder_batch_threshold"), does="reads"),
    Patch("vllm.v1.worker.gpu_input_batch:InputBatch", "the block tables of D's batch give each "
          "KV cache group's kernel block size", uses=("block_table",), does="reads"),
    Patch("vllm.v1.worker.block_table:BlockTable", "P's block table rows and KV slots, in kernel "
          "blocks", uses=("block_size", "blocks_per_kv_block"), does="reads"),
    Patch("vllm.v1.worker.utils:AttentionGroup", "P builds one metadata builder per attention "
          "group, of the class of D's; the group's backend is checked against the ones the lane "
          "serves", uses=("layer_names", "get_metadata_builder", "backend"), does="reads"),
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
          "runner describes D's (private CPU copies included)",
          uses=("query_start_loc", "query_start_loc_cpu", "seq_lens", "_seq_lens_cpu",
                "_num_computed_tokens_cpu", "seq_lens_cpu_upper_bound", "num_reqs",
                "num_actual_tokens", "max_query_len", "max_seq_len", "causal", "is_prefilling",
                "positions", "block_table_tensor", "slot_mapping"), does="builds"),
]
