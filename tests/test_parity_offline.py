"""Greedy parity through the offline `LLM()` API: ainfer_pd vs stock vLLM, same layout, float32.

Stock's TP=1 engine is shared by the tests of this module (it is the reference and the teacher
forcer); each test starts the engine it compares.
"""

from __future__ import annotations

import pytest

from ainfer_pd_testing.model_runner_v2 import expected_runner
from ainfer_pd_testing.parity import compare, offline_llm, parity_waves, run_waves, stock_alone
from ainfer_pd_testing.router_probe import EXTENSION as ROUTER_PROBE
from ainfer_pd_testing.router_probe import prefill_router_margins

pytestmark = [pytest.mark.engine, pytest.mark.timeout(1200)]

MAX_TOKENS = 24
WAVES = parity_waves(vocab_size=512)
PROMPTS = [p for wave in WAVES for p in wave]
# Prompts with >= 32 uncached tokens take the background P lane (most of the waves' prompts, and
# the later turns' increments on top of their cached prefixes); shorter ones go inline.
LANE_ON = {"ainfer_pd": {"p_lane_min_tokens": 32}}


def assert_lane_overlapped_d(status: list[dict]) -> None:
    """Every rank ran P jobs in the lane, with segments released right after D forwards."""
    for rank in status:
        lane = rank["p_lane"]
        assert lane["jobs_done"] >= 8 and lane["jobs_failed"] == 0, rank
        assert lane["segments_after_d"] > 0, rank
        assert lane["inflight"] == 0, rank


@pytest.fixture(scope="module")
def stock_tp1(tiny_model):
    with offline_llm(tiny_model, 1) as stock:
        yield stock, run_waves(stock, WAVES, MAX_TOKENS)


def test_offline_tp1_matches_stock(stock_tp1, tiny_model):
    stock, stock_out = stock_tp1
    k1 = {"ainfer_pd": {**LANE_ON["ainfer_pd"], "segment_policy": "fixed"}}
    with offline_llm(tiny_model, 1, backend="ainfer_pd", additional_config=k1) as ours:
        ours_out = run_waves(ours, WAVES, MAX_TOKENS)
        status = ours.worker_status()
    assert [(s["worker"], s["rank"], s["mode"]) for s in status] == [("AInferPDWorker", 0, "pd")]
    assert status[0]["model_runner"] == expected_runner()  # V2 under AINFER_PD_TEST_RUNNER=v2
    assert status[0]["attention_backends"] == ["CPU_ATTN"]  # checked by the worker at start
    assert_lane_overlapped_d(status)
    # fine ordering, K=1, 4 decoder layers: each epoch is 5 segments (entry + embedding, then one
    # layer per D iteration).
    lane = status[0]["p_lane"]
    assert lane["segments"] == 5 * lane["epochs"], lane
    report = compare(PROMPTS, stock_out, ours_out, stock.teacher_force)
    print(report)
    assert report.fail == 0, report
    assert report.exact + report.tie == len(PROMPTS)


def tp1_lane_matches_stock(stock_tp1, model: str, lane: dict, budget: int = 48) -> list[dict]:
    """Our TP=1 engine with these lane options and step budget (48 tokens unless given): the
    waves' tokens equal stock's (by the tie rule) and the lane ran; returns every rank's status."""
    stock, stock_out = stock_tp1
    with offline_llm(model, 1, backend="ainfer_pd", additional_config={"ainfer_pd": lane},
                     max_num_batched_tokens=budget) as ours:
        ours_out = run_waves(ours, WAVES, MAX_TOKENS)
        status = ours.worker_status()
    report = compare(PROMPTS, stock_out, ours_out, stock.teacher_force)
    print(report, status[0]["p_lane"])
    assert report.fail == 0, report
    assert_lane_overlapped_d(status)
    return status


def test_offline_tp1_global_complete_with_load_selected_span_matches_stock(stock_tp1, tiny_model):
    """The other end of the ordering ladder: the whole epoch after one D iteration, D fenced on
    P's completion; same admission and state, same tokens. With a 48-token step budget, an epoch
    (one forward of the graph vLLM compiled for at most that many tokens) takes at most 48 P
    tokens, so the longer prompts are prefilled in parts over several epochs."""
    status = tp1_lane_matches_stock(stock_tp1, tiny_model, {
        "p_lane_min_tokens": 32, "ordering": "global-complete", "segment_policy": "load"})
    lane_stats = status[0]["p_lane"]
    assert lane_stats["segments"] == lane_stats["epochs"], status
    # Parts: more epochs than 48-token epochs could hold whole jobs (P tokens / 48, rounded up).
    assert lane_stats["epochs"] > lane_stats["jobs_done"]
    assert lane_stats["epochs"] >= -(-lane_stats["p_tokens"] // 48)


def test_offline_tp1_fine_with_load_selected_span_matches_stock(stock_tp1, tiny_model):
    """Fine ordering with K chosen per round: P pressure counts the open epoch's work still ahead
    of its permit, so with a 48-token budget and a light D the policy releases several layers per
    D iteration (fewer segments than the 5 per epoch of K=1), with the same tokens. P's host work
    runs beside D's step (`p_host="concurrent"`, the GPU default), on its own forward context."""
    status = tp1_lane_matches_stock(stock_tp1, tiny_model, {
        "p_lane_min_tokens": 32, "segment_policy": "load", "p_host": "concurrent"})
    lane_stats = status[0]["p_lane"]
    assert lane_stats["epochs"] < lane_stats["segments"] < 5 * lane_stats["epochs"], lane_stats


def test_offline_tp1_fine_with_work_per_round_span_releases_short_epochs_whole(
        stock_tp1, tiny_model):
    """`segment_policy="work"` sizes K by the epoch: with an 8192-token step budget, no epoch of
    these waves (at most 4 jobs of <= 230 tokens) holds more than 1/8 of a full-budget forward
    over the model's 5 boundaries, so every epoch is one release (K=1 would take 5, and `load`
    gives such small epochs K=1 too), with the same tokens."""
    status = tp1_lane_matches_stock(stock_tp1, tiny_model, {
        "p_lane_min_tokens": 32, "segment_policy": "work", "p_host": "concurrent"}, budget=8192)
    lane_stats = status[0]["p_lane"]
    assert lane_stats["segments"] == lane_stats["epochs"] > 0, lane_stats


def test_offline_tp1_fine_with_a_span_past_the_last_boundary_runs_one_segment_per_epoch(
        stock_tp1, tiny_model):
    """Fine ordering with K beyond the model's boundaries (`gpu_run.sh`'s `pd_whole`): the permit
    lies past the last boundary, so each epoch is one release, with the same tokens."""
    status = tp1_lane_matches_stock(stock_tp1, tiny_model, {
        "p_lane_min_tokens": 32, "segment_policy": "fixed", "segment_span": 64,
        "p_host": "concurrent"})
    lane_stats = status[0]["p_lane"]
    assert lane_stats["segments"] == lane_stats["epochs"] > 0, lane_stats


def test_parity_fails_for_a_model_with_other_weights(stock_tp1, tiny_model_other_seed):
    """The harness can fail: the same backend on differently seeded weights must not pass. (This
    engine is also the one that proves the fully qualified executor path works without the
    plugin's short name.)"""
    stock, stock_out = stock_tp1
    with offline_llm(tiny_model_other_seed, 1,
                     backend="vllm_ainfer_pd.executor.AInferPDExecutor") as other:
        assert other.worker_status()[0]["worker"] == "AInferPDWorker"
        other_out = run_waves(other, WAVES, MAX_TOKENS)
    report = compare(PROMPTS, stock_out, other_out, stock.teacher_force)
    print(report)
    assert report.fail >= len(PROMPTS) // 2, report
    # The diagnosis of failures must not blame stock's batching for other weights' tokens.
    alone = stock_alone(stock, PROMPTS, stock_out, other_out, report.failed, MAX_TOKENS)
    assert [a["prompt"] for a in alone] == report.failed
    assert not any(a["stock_alone_is_ours"] for a in alone), alone


def test_offline_tp2_drafting_stays_inside_the_round(tiny_model, tmp_path):
    """TP=2 with a drafter model (the tiny model drafting for itself, so the drafter's forward has
    TP all-reduces) and P's host work beside D's step (`p_host="concurrent"`), with rank 1's
    drafting delayed after its forward: P's segment is released only after the drafter's last
    enqueue, so both ranks issue the same collectives in the same order (recorded per rank: had
    P been released after the forward, rank 1's P would issue its all-reduces during the delay,
    ahead of its drafter's, and rank 0's in another order). Greedy outputs equal stock's."""
    from ainfer_pd_testing.collective_log import first_divergence, read_logs

    spec = {"speculative_config": {"method": "draft_model", "model": tiny_model,
                                   "num_speculative_tokens": 2}}
    lane = {"ainfer_pd": {**LANE_ON["ainfer_pd"], "p_host": "concurrent", "timeout_s": 60.0}}
    prefix = str(tmp_path / "collectives")
    with offline_llm(tiny_model, 2, **spec) as stock:
        stock_out = run_waves(stock, WAVES, MAX_TOKENS)
        with offline_llm(tiny_model, 2, backend="ainfer_pd", additional_config=lane,
                         worker_extension_cls="ainfer_pd_testing.collective_log.CollectiveLog",
                         **spec) as ours:
            ours.llm.collective_rpc("start_collective_log", args=(prefix, 1, 0.02))
            ours_out = run_waves(ours, WAVES, MAX_TOKENS)
            status = ours.worker_status()
        report = compare(PROMPTS, stock_out, ours_out, stock.teacher_force)
    logs = read_logs(prefix, 2)
    assert [(s["worker"], s["model_runner"]) for s in status] == \
        [("AInferPDWorker", expected_runner())] * 2
    assert_lane_overlapped_d(status)
    lanes = [s["p_lane"] for s in status]
    # Both TP ranks ran the same epochs and segments; P's TP all-reduces went through the stream
    # route, the same number on both ranks (two per layer per epoch).
    assert lanes[0]["segments"] == lanes[1]["segments"]
    assert lanes[0]["p_collectives_routed"] == lanes[1]["p_collectives_routed"] > 0
    assert lanes[0]["p_collectives_routed"] % lanes[0]["epochs"] == 0
    # Both phases' collectives were recorded, and in one order on both ranks.
    assert any(e.startswith("P ") for e in logs[0]) and any(e.startswith("D ") for e in logs[0])
    assert len(logs[0]) == len(logs[1]) and first_divergence(logs) is None, \
        first_divergence(logs)
    print(report)
    assert report.fail == 0, report


def test_rl_weight_sync_between_rollouts_matches_stock(tiny_model):
    """The RL loop: rollout, the trainer pushes new weights through a worker extension
    (`collective_rpc`), the prefix cache is reset, rollout again. The extension mixes into our
    worker as into stock's; the lane's P runs the updated weights (the outputs change, and equal
    stock's after the same update). Then the router probe (`ainfer_pd_testing/router_probe.py`, a
    subclass of the weight update): one lane-sized prompt routes every token of every MoE layer
    with the same top-k margins in the lane as in stock's prefill."""
    ext = {"worker_extension_cls": ROUTER_PROBE}
    with offline_llm(tiny_model, 1, **ext) as stock, \
            offline_llm(tiny_model, 1, backend="ainfer_pd", additional_config=LANE_ON,
                        **ext) as ours:
        rollouts = {}
        for step in ("before", "after"):
            if step == "after":
                checksums = [r.llm.collective_rpc("perturb_weights", args=(5,))
                             for r in (stock, ours)]
                assert checksums[0] == checksums[1], checksums
                assert stock.llm.reset_prefix_cache() and ours.llm.reset_prefix_cache()
            stock_out, ours_out = (run_waves(r, WAVES, MAX_TOKENS) for r in (stock, ours))
            report = compare(PROMPTS, stock_out, ours_out, stock.teacher_force)
            print(step, report)
            assert report.fail == 0, (step, report)
            rollouts[step] = (stock_out, ours.worker_status()[0]["p_lane"]["jobs_done"])
        prompt = max(PROMPTS, key=len)
        margins = [prefill_router_margins(r.llm, prompt) for r in (stock, ours)]
        jobs_probe = ours.worker_status()[0]["p_lane"]["jobs_done"]
    (before, jobs_before), (after, jobs_after) = rollouts["before"], rollouts["after"]
    assert sum(a != b for a, b in zip(before, after)) >= len(PROMPTS) // 2  # the update took
    assert jobs_before >= 8 and jobs_after - jobs_before >= 8  # both rollouts used the lane
    assert jobs_probe == jobs_after + 1  # the probed prompt's P ran in the lane
    stock_margins, ours_margins = margins
    assert len(stock_margins) == 4  # the tiny model's MoE layers
    for layer, (s, o) in enumerate(zip(stock_margins, ours_margins)):
        assert len(s) == len(o) == len(prompt), (layer, len(s), len(o))
        assert min(s) > 0 and o == pytest.approx(s, abs=1e-4), layer
