"""Inputs and attention metadata of one P epoch: a batched prefill of P jobs into their
reserved KV blocks (docs/worker.md).

Built from the jobs alone, never from the model runner's persistent buffers or `InputBatch`
(those belong to D), with the P lane's own attention-metadata builders: builders may keep
persistent state, so D's must not be shared with P.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.v1.attention.backend import CommonAttentionMetadata

from vllm_ainfer_pd import attention_backends
from vllm_ainfer_pd.vllm_glue import model_runner as model_runner_glue

if TYPE_CHECKING:
    from vllm_ainfer_pd.wire import PJob


@dataclass
class PBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: dict[str, Any] | None  # layer name -> that layer's metadata
    slot_mapping: dict[str, torch.Tensor]  # layer name -> KV slot of each P token
    num_tokens: int


class PBatchBuilder:
    """Builds `PBatch`es for one model runner's KV cache groups."""

    def __init__(self, runner: Any) -> None:
        model_runner_glue.check_model_state(runner)
        self.runner = runner
        self.device = runner.device
        self.vllm_config = runner.vllm_config
        # The backends vLLM chose for the KV cache groups, refused by name where the lane cannot
        # run them (vllm_ainfer_pd.attention_backends).
        self.attention_backends = attention_backends.check_runner(runner)
        self.groups: list[tuple[int, int, list[Any]]] = []  # (kernel bs, per kv block, builders)
        for gid, attn_groups in enumerate(runner.attn_groups):
            builders = []
            for group in attn_groups:
                d_builder = group.get_metadata_builder()
                builders.append(
                    (
                        group.layer_names,
                        type(d_builder)(
                            d_builder.kv_cache_spec, group.layer_names, self.vllm_config,
                            self.device,
                        ),
                    )
                )
            self.groups.append((*model_runner_glue.kernel_blocks(runner, gid), builders))
        if not self.groups:
            raise ValueError("the P lane needs a model with attention KV cache groups")
        self.ids_dtype, self.positions_dtype = model_runner_glue.input_dtypes(runner)

    def no_work(self, num_tokens: int = 1) -> PBatch:
        """Dummy tokens, no attention metadata and no KV slots: attention writes nothing."""
        return PBatch(input_ids=torch.zeros(num_tokens, dtype=self.ids_dtype, device=self.device),
                      positions=torch.zeros(num_tokens, dtype=self.positions_dtype,
                                            device=self.device),
                      attn_metadata=None,
                      slot_mapping={}, num_tokens=num_tokens)

    def build(self, jobs: list[PJob]) -> PBatch:
        jobs = self._in_runner_order(jobs)
        ids = np.concatenate([np.asarray(j.token_ids, dtype=np.int64) for j in jobs])
        positions = np.concatenate([np.arange(j.start, j.end, dtype=np.int64) for j in jobs])
        query_lens = np.array([j.end - j.start for j in jobs], dtype=np.int32)
        seq_lens = np.array([j.end for j in jobs], dtype=np.int32)
        query_start = np.zeros(len(jobs) + 1, dtype=np.int32)
        np.cumsum(query_lens, out=query_start[1:])
        dev = self.device
        pin = dev.type == "cuda"

        def to_dev(a: np.ndarray) -> torch.Tensor:
            # From pinned memory: a copy from pageable memory first waits for P's stream to
            # drain, and P's stream waits for D's work, so the host would wait for the GPU.
            t = torch.from_numpy(a)
            return (t.pin_memory() if pin else t).to(dev, non_blocking=True)

        query_start_cpu = torch.from_numpy(query_start)
        seq_lens_cpu = torch.from_numpy(seq_lens)
        common = dict(
            query_start_loc=to_dev(query_start),
            query_start_loc_cpu=query_start_cpu,
            seq_lens=to_dev(seq_lens),
            **model_runner_glue.private_cpu_copies(seq_lens_cpu,
                                                   torch.from_numpy(seq_lens - query_lens)),
            seq_lens_cpu_upper_bound=seq_lens_cpu,
            num_reqs=len(jobs),
            num_actual_tokens=int(ids.shape[0]),
            max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens.max()),
            causal=True,
            is_prefilling=torch.ones(len(jobs), dtype=torch.bool, device=dev),
            positions=to_dev(positions).to(self.positions_dtype),
        )
        attn_metadata: dict[str, Any] = {}
        slot_mapping: dict[str, torch.Tensor] = {}
        for gid, (kernel_bs, per_kv_block, builders) in enumerate(self.groups):
            table, slots = _kernel_blocks(jobs, gid, kernel_bs, per_kv_block)
            cm = CommonAttentionMetadata(
                block_table_tensor=to_dev(table), slot_mapping=to_dev(slots), **common
            )
            for layer_names, builder in builders:
                md = builder.build(common_prefix_len=0, common_attn_metadata=cm)
                for name in layer_names:
                    attn_metadata[name] = md
                    slot_mapping[name] = cm.slot_mapping
        return PBatch(
            input_ids=to_dev(ids).to(self.ids_dtype),
            positions=common["positions"],
            attn_metadata=attn_metadata,
            slot_mapping=slot_mapping,
            num_tokens=int(ids.shape[0]),
        )

    def _in_runner_order(self, jobs: list[PJob]) -> list[PJob]:
        """The jobs in the order vLLM's runner gives a batch to the attention metadata builders
        (`reorder_batch_to_split_decodes_and_prefills`): chunks with cached context of at most the
        runner's threshold of tokens, then longer ones with context, then prompts' first chunks.
        The builders assume that order: they send the requests before the first one past the
        threshold to their decode kernels and the rest to their prefill kernels. Out of order, a
        short chunk behind a long one would take the prefill kernels where stock vLLM takes the
        decode kernels (MLA: decompressed rather than absorbed attention; the same math, other
        rounding). Model Runner V2 orders a batch by query length instead."""
        if model_runner_glue.runs_model_runner_v2(self.runner):
            order = model_runner_glue.v2_batch_order(self.runner,
                                                     [j.end - j.start for j in jobs])
            return [jobs[i] for i in order]
        threshold = getattr(self.runner, "reorder_batch_threshold", None)
        if threshold is None:
            return jobs

        def region(job: PJob) -> int:
            if job.start == 0:
                return 2
            return 0 if job.end - job.start <= threshold else 1

        return sorted(jobs, key=region)  # stable: the lane's order within a region


def _kernel_blocks(
    jobs: list[PJob], gid: int, kernel_bs: int, per_kv_block: int
) -> tuple[np.ndarray, np.ndarray]:
    """Block table rows (kernel block ids, padded with 0, the null block) and the KV slot of each
    P token. A KV-manager block holds `per_kv_block` kernel blocks when their sizes differ."""
    rows = []
    for job in jobs:
        manager = np.asarray(job.block_ids[gid], dtype=np.int64)
        kernel = (manager[:, None] * per_kv_block + np.arange(per_kv_block)).reshape(-1)
        rows.append(kernel)
    width = max(len(r) for r in rows)
    table = np.zeros((len(jobs), width), dtype=np.int32)
    slots = []
    for i, (job, row) in enumerate(zip(jobs, rows, strict=True)):
        table[i, : len(row)] = row
        pos = np.arange(job.start, job.end)
        if (job.end - 1) // kernel_bs >= len(row):
            raise ValueError(
                f"P job {job.req_id!r} needs {job.end} token slots but holds {len(row)} "
                f"blocks of {kernel_bs}"
            )
        slots.append(row[pos // kernel_bs] * kernel_bs + pos % kernel_bs)
    return table, np.concatenate(slots).astype(np.int64)
