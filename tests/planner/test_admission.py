"""D-first admission: D rows before new P, token budget and KV accounting, the lane's policy."""

from __future__ import annotations

import pytest
from planner_util import free_blocks, make_request, make_scheduler, step
from vllm.v1.request import RequestStatus

LANE = {"p_lane_min_tokens": 64, "max_p_inflight": 4}


def test_short_prompt_goes_inline_with_no_p_job(tiny_model: str) -> None:
    s = make_scheduler(tiny_model, lane=LANE)
    r = make_request(40)
    s.add_request(r)
    out = s.schedule()
    assert out.num_scheduled_tokens == {r.request_id: 40}
    assert r.status == RequestStatus.RUNNING
    assert out.kv_connector_metadata.new_jobs == []


@pytest.mark.parametrize("sampling", [{"prompt_logprobs": 1},
                                      {"skip_reading_prefix_cache": True}])
def test_long_prompt_that_needs_d_forward_goes_inline(tiny_model: str, sampling: dict) -> None:
    """The lane's P returns no prompt logits and reads no cache it was told to skip."""
    s = make_scheduler(tiny_model, lane=LANE)
    r = make_request(100, **sampling)
    s.add_request(r)
    out = s.schedule()
    assert out.num_scheduled_tokens == {r.request_id: 100}
    assert r.status == RequestStatus.RUNNING
    assert out.kv_connector_metadata.new_jobs == []


def test_long_prompt_given_as_embeddings_goes_inline(tiny_model: str) -> None:
    """The lane's P embeds token ids; a prompt given as embeddings has none."""
    import torch
    from vllm import SamplingParams
    from vllm.v1.request import Request

    s = make_scheduler(tiny_model, lane=LANE)
    r = Request(request_id="embeds", prompt_token_ids=None, pooling_params=None,
                sampling_params=SamplingParams(max_tokens=4), prompt_embeds=torch.zeros(100, 128))
    s.add_request(r)
    out = s.schedule()
    assert out.num_scheduled_tokens == {"embeds": 100}
    assert out.kv_connector_metadata.new_jobs == []


@pytest.mark.parametrize("window", ["sliding_window", "attention_chunk_size"])
def test_prompt_longer_than_an_attention_window_whose_blocks_vllm_drops_goes_inline(
        tiny_model: str, window: str) -> None:
    """For a sliding-window (or chunked-local) KV cache group, vLLM gives a connector-loaded
    prompt the null block before its last token's window: the lane would write the earlier
    tokens' KV there. Prompts of up to the window still take the lane, into real blocks."""
    import torch
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, SlidingWindowSpec

    spec_cls = SlidingWindowSpec if window == "sliding_window" else ChunkedLocalAttentionSpec
    spec = spec_cls(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float32,
                    **{window: 96})
    s = make_scheduler(tiny_model, lane=LANE, kv_spec=spec)
    assert s.connector.max_lane_prompt == 96
    longer, within = make_request(200), make_request(96)
    s.add_request(longer)
    s.add_request(within)
    out = s.schedule()
    assert out.num_scheduled_tokens == {longer.request_id: 200}  # inline
    (job,) = out.kv_connector_metadata.new_jobs
    assert (job.req_id, job.start, job.end) == (within.request_id, 0, 95)
    assert s.kv_cache_manager.block_pool.null_block.block_id not in job.block_ids[0]


def test_a_model_that_mixes_windowed_and_full_attention_layers_keeps_every_prompt_whole() -> None:
    """The backend turns vLLM's hybrid KV cache manager off (executor), and vLLM then gives
    sliding-window layers of such a model full-attention KV blocks: no window limit."""
    import torch
    from vllm.v1.core.kv_cache_utils import unify_hybrid_kv_cache_specs
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    from vllm_ainfer_pd.connector import window_prompt_limit

    shape = dict(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float32)
    specs = {"windowed": SlidingWindowSpec(**shape, sliding_window=96),
             "full": FullAttentionSpec(**shape)}
    unify_hybrid_kv_cache_specs(specs)
    assert isinstance(specs["windowed"], FullAttentionSpec)
    config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[],
                           kv_cache_groups=[KVCacheGroupSpec(list(specs), specs["windowed"])])
    assert window_prompt_limit(config) is None


def test_long_prompt_is_parked_with_blocks_reserved_and_no_token_budget(tiny_model: str) -> None:
    s = make_scheduler(tiny_model, lane=LANE)
    initial = free_blocks(s)
    r = make_request(100)
    s.add_request(r)
    out = s.schedule()
    assert out.num_scheduled_tokens == {}
    assert out.total_num_scheduled_tokens == 0
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    # The lane computes the first 99 tokens: ceil(99 / 16) = 7 blocks reserved.
    assert initial - free_blocks(s) == 7
    (job,) = out.kv_connector_metadata.new_jobs
    assert (job.req_id, job.lifetime, job.start, job.end) == (r.request_id, 0, 0, 99)
    assert job.token_ids == tuple(r.prompt_token_ids[:99])
    assert job.block_ids == (tuple(s.kv_cache_manager.get_block_ids(r.request_id)[0]),)


def test_d_rows_are_scheduled_before_new_p_and_p_gets_the_rest_of_the_budget(
    tiny_model: str,
) -> None:
    s = make_scheduler(tiny_model, lane=LANE, max_num_batched_tokens=64)
    d1, d2 = make_request(20, max_tokens=50), make_request(20, max_tokens=50)
    s.add_request(d1)
    s.add_request(d2)
    step(s)  # both prefill inline (40 <= 64) and sample their first token
    p = make_request(63)  # below the lane's minimum: inline, chunked by the budget
    s.add_request(p)
    out = s.schedule()
    assert out.num_scheduled_tokens[d1.request_id] == 1
    assert out.num_scheduled_tokens[d2.request_id] == 1
    assert out.num_scheduled_tokens[p.request_id] == 62  # 64 - the two D rows
    assert [n.req_id for n in out.scheduled_new_reqs] == [p.request_id]
    assert set(out.scheduled_cached_reqs.req_ids) == {d1.request_id, d2.request_id}


def test_background_p_does_not_take_token_budget_from_d(tiny_model: str) -> None:
    s = make_scheduler(tiny_model, lane=LANE, max_num_batched_tokens=64)
    d = make_request(20, max_tokens=50)
    s.add_request(d)
    step(s)
    p = make_request(200)
    s.add_request(p)
    out = s.schedule()
    assert out.num_scheduled_tokens == {d.request_id: 1}
    assert p.status == RequestStatus.WAITING_FOR_REMOTE_KVS


def test_max_p_inflight_makes_further_long_prompts_wait(tiny_model: str) -> None:
    s = make_scheduler(tiny_model, lane={**LANE, "max_p_inflight": 1})
    p1, p2 = make_request(80), make_request(80)
    s.add_request(p1)
    s.add_request(p2)
    out = step(s)
    assert p1.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert p2.status == RequestStatus.WAITING  # waits for the lane, not inline
    assert out.total_num_scheduled_tokens == 0
    step(s, finished_recving={p1.request_id})  # p1's P drained
    out = step(s)  # p1 promoted (1-token row), p2 now admitted to the lane
    assert out.num_scheduled_tokens == {p1.request_id: 1}
    assert p2.status == RequestStatus.WAITING_FOR_REMOTE_KVS


def test_p_reservation_leaves_one_block_of_headroom_per_running_d_row(tiny_model: str) -> None:
    # 11 usable blocks; two D rows of 24 tokens hold 2 blocks each: 7 free.
    s = make_scheduler(tiny_model, lane=LANE, num_blocks=12)
    d1, d2 = make_request(24, max_tokens=50), make_request(24, max_tokens=50)
    s.add_request(d1)
    s.add_request(d2)
    step(s)
    assert free_blocks(s) == 7
    p = make_request(97)  # needs 7 blocks: it would fit, but leave D no room to grow
    s.add_request(p)
    step(s)
    assert p.status == RequestStatus.WAITING
    assert free_blocks(s) == 7
    assert s.p_lane.inflight == {}
