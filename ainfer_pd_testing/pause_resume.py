"""The RL loop's weight sync in flight: pause generation in the middle of a rollout (vLLM's
`pause_generation`, what `POST /pause` calls), push new weights through a worker extension
(`collective_rpc`), resume, and check every request against stock vLLM with the new weights.

What stock vLLM does, and so what each request must return:
- `mode="keep"` (with vLLM's default `clear_cache=True`): generation freezes, the prefix cache is
  reset and running requests are preempted, so after the resume each request recomputes its
  prompt and the tokens it had before the pause with the new weights, and goes on from there.
  Its tokens after the pause equal stock's greedy continuation of (prompt + tokens before the
  pause) with the new weights. A request in the P lane had no token yet: the pause returned it
  to waiting, and its whole output is stock's with the new weights.
- `mode="wait"`: requests already decoding finish first; the rest are held until the resume.
- `mode="abort"`: every request ends with `finish_reason="abort"`.

The run drives a real engine (`AsyncLLM`, whose engine core is its own process, as behind
`vllm serve`). It waits until the lane has jobs in flight before it pauses, so the pause meets P
work, and it reads each request's tokens 0.5 s after the pause (no token is made while paused;
that leaves time for the outputs already on their way).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

from ainfer_pd_testing.parity import ParityReport, compare


def lane_prompts(seed: int, n: int) -> list[list[int]]:
    """`n` prompts of 300-400 random tokens (ids 3-511 of the tiny models' vocabulary): long
    enough to reach the lane, and split over several epochs at a 64-token step budget."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randrange(300, 400))] for _ in range(n)]

@dataclass
class PausedRollout:
    mode: str
    before: list[list[int]]  # each request's tokens when the pause had settled
    outputs: list[list[int]]  # each request's final tokens
    finish_reasons: list[str | None]
    lane_at_pause: dict | None = None  # rank 0's `p_lane` status right after the pause
    lane_before_pause: dict | None = None
    pause_s: float = 0.0
    errors: list[str] = field(default_factory=list)


@contextmanager
def async_engine(model: str, **engine_args):
    """An `AsyncLLM` (engine core in its own process) with the harness's CPU settings."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from vllm_ainfer_pd.rollout.cpu_engine import CPU_ENGINE_ARGS, apply_cpu_env

    apply_cpu_env(engine_args.get("tensor_parallel_size", 1)
                  * engine_args.get("data_parallel_size", 1))
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=model,
                                                       **{**CPU_ENGINE_ARGS, **engine_args}))
    try:
        yield engine
    finally:
        engine.shutdown()


async def lane_status(engine) -> dict | None:
    """Rank 0's lane counters, or None without a lane (stock, `mode="normal"`)."""
    try:
        return (await engine.collective_rpc("ainfer_pd_status"))[0]["p_lane"]
    except Exception:
        return None


async def plain_rollout(engine, prompts: list[list[int]], max_tokens: int,
                        request_prefix: str = "plain") -> list[list[int]]:
    """Every prompt at once, greedy, no pause: each request's tokens."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    async def one(i: int) -> list[int]:
        async for out in engine.generate(TokensPrompt(prompt_token_ids=prompts[i]), params,
                                         request_id=f"{request_prefix}{i}"):
            pass
        return list(out.outputs[0].token_ids)

    return list(await asyncio.gather(*(one(i) for i in range(len(prompts)))))


async def paused_rollout(engine, prompts: list[list[int]], max_tokens: int, mode: str,
                         weight_seed: int | None = None, busy_timeout_s: float = 60.0,
                         request_prefix: str = "r", timeout_s: float = 180.0,
                         sleep_level: int | None = None,
                         after_pause: Callable[[], Awaitable[None]] | None = None
                         ) -> PausedRollout:
    """Start every prompt, pause with `mode` once the P lane has jobs in flight (stock: once a
    request has a token), push new weights (`perturb_weights(weight_seed)`) if a seed is given,
    resume, and collect every request's output. With `sleep_level` the pause is vLLM's
    `sleep(sleep_level, mode)` (GPU: weights to host memory, KV cache dropped) and the resume
    `wake_up()`. `after_pause`, if given, is what the trainer does while the engine is paused
    instead (its own weight update, its own resume calls): it must leave the engine resumed."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    tokens: list[list[int]] = [[] for _ in prompts]
    reasons: list[str | None] = [None] * len(prompts)

    async def one(i: int) -> None:
        async for out in engine.generate(TokensPrompt(prompt_token_ids=prompts[i]), params,
                                         request_id=f"{request_prefix}{i}"):
            tokens[i] = list(out.outputs[0].token_ids)
            reasons[i] = out.outputs[0].finish_reason

    tasks = [asyncio.create_task(one(i)) for i in range(len(prompts))]
    try:
        run = await _pause_when_busy(engine, mode, weight_seed, tokens, busy_timeout_s,
                                     timeout_s, sleep_level, after_pause)
    except BaseException:
        # Abort the requests while the engine still runs: left to asyncio.run's teardown, their
        # aborts would wait on an engine already shut down.
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    done, late = await asyncio.wait(tasks, timeout=timeout_s)
    for task in late:
        task.cancel()
        run.errors.append(f"not finished {timeout_s} s after the resume")
    for task in done:
        if task.exception() is not None:  # a failed request is a finding, not a crash of the run
            run.errors.append(repr(task.exception()))
    run.outputs, run.finish_reasons = tokens, reasons
    return run


async def _pause_when_busy(engine, mode: str, weight_seed: int | None, tokens: list[list[int]],
                           busy_timeout_s: float, timeout_s: float, sleep_level: int | None,
                           after_pause: Callable[[], Awaitable[None]] | None) -> PausedRollout:
    """Wait until the rollout is busy, pause, note the tokens, update the weights, resume."""
    deadline = time.monotonic() + busy_timeout_s
    lane = await lane_status(engine)
    while time.monotonic() < deadline:
        lane = await lane_status(engine)
        # Some requests decoding, and (with the lane) some still in P.
        if any(tokens) and (lane is None or lane["inflight"] > 0):
            break
        await asyncio.sleep(0.05)
    else:
        raise TimeoutError(f"no token, or no P job in flight, after {busy_timeout_s} s: {lane}")
    run = PausedRollout(mode, [], [], [], lane_before_pause=lane)
    start = time.monotonic()
    call = f"pause_generation(mode={mode!r})" if sleep_level is None else \
        f"sleep(level={sleep_level}, mode={mode!r})"
    pause = asyncio.create_task(engine.pause_generation(mode=mode) if sleep_level is None
                                else engine.sleep(level=sleep_level, mode=mode))
    while not pause.done():  # a pause whose engine died never returns
        await asyncio.wait([pause], timeout=0.5)
        if not pause.done() and (engine.errored or time.monotonic() - start > timeout_s):
            pause.cancel()
            raise RuntimeError(f"{call} did not return after "
                               f"{time.monotonic() - start:.0f} s; engine errored: "
                               f"{engine.errored}")
    pause.result()
    run.pause_s = time.monotonic() - start
    run.lane_at_pause = await lane_status(engine)
    await asyncio.sleep(0.5)
    run.before = [list(t) for t in tokens]
    if after_pause is not None:
        await after_pause()
        return run
    if weight_seed is not None:
        await engine.collective_rpc("perturb_weights", args=(weight_seed,))
    await (engine.resume_generation() if sleep_level is None else engine.wake_up())
    return run


def judge_continuations(prompts: list[list[int]], run: PausedRollout, max_tokens: int,
                        stock) -> ParityReport:
    """Each finished request's tokens after the pause against stock's greedy continuation of
    (prompt + its tokens before the pause): `stock` is an `LLMRunner` holding the weights the
    engine had after the pause."""
    heads, tails, budgets = [], [], []
    for prompt, before, out in zip(prompts, run.before, run.outputs):
        if out[:len(before)] != before:
            raise AssertionError(f"tokens before the pause changed: {before} -> {out}")
        heads.append(prompt + before)
        tails.append(out[len(before):])
        budgets.append(max_tokens - len(before))
    expected: list[list[int]] = [[] for _ in heads]
    for budget in sorted(set(budgets)):
        idx = [i for i, b in enumerate(budgets) if b == budget]
        if budget > 0:
            for i, toks in zip(idx, stock.generate([heads[i] for i in idx], budget)):
                expected[i] = toks
    return compare(heads, expected, tails, stock.teacher_force)
