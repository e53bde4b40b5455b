"""The RL weight sync in flight (ainfer_pd_testing/pause_resume.py): `pause_generation`
with P jobs in the lane, new weights through a worker extension, resume. Each request must return
what stock vLLM returns with the new weights, continuing from its tokens before the pause, and
no KV block may stay held.

Before 2026-12-02 a `keep` pause with P in flight failed: vLLM's prefix-cache reset found blocks
reserved by the lane and raised ("requests waiting for remote KV transfer ... not supported"),
from the engine's idle callback, which ended the engine.

The reference is one stock TP=1 engine with the same weight update, shared by the module. The
pause at DP=2 with expert parallelism (every mode, through `vllm serve`'s endpoints) is in
tests/test_rl_frameworks.py.
"""

from __future__ import annotations

import asyncio

import pytest

from ainfer_pd_testing.parity import compare, offline_llm
from ainfer_pd_testing.pause_resume import (
    async_engine,
    judge_continuations,
    lane_prompts,
    lane_status,
    paused_rollout,
    plain_rollout,
)
from ainfer_pd_testing.weight_update import EXTENSION

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

MAX_TOKENS = 16
SEED = 5  # the "trainer's" weight update: perturb_weights(SEED)
# 64 tokens per step: the lane prefills each 300-400-token prompt in parts over several epochs,
# so a pause meets prompts in P while earlier ones decode.
ENGINE = {"max_num_batched_tokens": 64, "worker_extension_cls": EXTENSION}
LANE = {"distributed_executor_backend": "ainfer_pd",
        "additional_config": {"ainfer_pd": {"p_lane_min_tokens": 32}}}


def prompts(seed: int, n: int = 12) -> list[list[int]]:
    return lane_prompts(seed, n)


@pytest.fixture(scope="module")
def stock_new_weights(tiny_model):
    """Stock vLLM holding the weights our engines have after the update."""
    with offline_llm(tiny_model, 1, **ENGINE) as stock:
        stock.llm.collective_rpc("perturb_weights", args=(SEED,))
        yield stock


async def rollouts(model: str, modes: tuple[str, ...], **layout) -> dict:
    """A paused rollout per mode (the first one with the weight update), then a plain rollout
    and the leak check, on one engine."""
    runs = {}
    with async_engine(model, **ENGINE, **LANE, **layout) as engine:
        for n, mode in enumerate(modes):
            runs[mode] = await paused_rollout(engine, prompts(n), MAX_TOKENS, mode,
                                              weight_seed=SEED if n == 0 else None,
                                              request_prefix=mode)
        runs["fresh"] = await plain_rollout(engine, prompts(9), MAX_TOKENS)
        runs["lane"] = await lane_status(engine)
        # Raises on any engine where a request still holds a KV block (all have ended).
        runs["all_blocks_free"] = await engine.reset_prefix_cache(reset_running_requests=True)
    return runs


def check(runs: dict, modes: tuple[str, ...], stock) -> None:
    for mode in modes:
        run = runs[mode]
        print(mode, f"pause {run.pause_s:.2f} s", "tokens before:", [len(b) for b in run.before],
              "lane in flight before / at the pause:", run.lane_before_pause["inflight"],
              run.lane_at_pause["inflight"])
        assert not run.errors, (mode, run.errors)
        # The pause met P work and left none in flight.
        assert run.lane_before_pause["inflight"] > 0, (mode, run.lane_before_pause)
        assert run.lane_at_pause["inflight"] == 0, (mode, run.lane_at_pause)
        if mode == "abort":
            assert "abort" in run.finish_reasons, run.finish_reasons
            continue
        assert run.finish_reasons == ["length"] * len(run.before), (mode, run.finish_reasons)
        if mode == "keep":  # some requests were decoding at the pause, some still in P
            assert any(run.before) and not all(run.before), [len(b) for b in run.before]
        if mode == "wait":  # requests decoding at the pause finished before it completed
            assert all(len(b) in (0, MAX_TOKENS) for b in run.before), run.before
        report = judge_continuations(prompts(modes.index(mode)), run, MAX_TOKENS, stock)
        print(mode, report)
        assert report.fail == 0, (mode, report)
    lane = runs["lane"]
    assert lane["inflight"] == 0 and lane["jobs_failed"] == 0 and lane["jobs_cancelled"] > 0, lane
    assert runs["all_blocks_free"]
    report = compare(prompts(9), stock.generate(prompts(9), MAX_TOKENS), runs["fresh"],
                     stock.teacher_force)
    print("fresh", report)
    assert report.fail == 0, report


def test_pause_keep_wait_abort_with_p_in_flight_tp1(tiny_model, stock_new_weights):
    modes = ("keep", "wait", "abort")
    check(asyncio.run(rollouts(tiny_model, modes)), modes, stock_new_weights)

