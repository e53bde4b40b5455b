"""Routing replay (vLLM's `enable_return_routed_experts`, what verl's R3 reads).

vLLM 0.26 refuses routed-expert capture beside any KV connector (VllmConfig checks it again in
EngineCore, after the model has loaded), and the P lane runs in vLLM's KV-connector slot. So with
the lane (`mode="pd"`) the backend refuses the flag at once, with one line saying what to use;
with `mode="normal"` (no connector) every request returns exactly the experts stock vLLM returns
for it, prompt and output positions alike.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys

import numpy as np
import pytest

from ainfer_pd_testing.parity import parity_waves
from ainfer_pd_testing.pause_resume import async_engine
from vllm_ainfer_pd.config import AInferPDConfig, ConfigError
from vllm_ainfer_pd.vllm_glue import vllm_at_least

pytestmark = [
    pytest.mark.timeout(900),
    # 0.32 returns routed experts only from Model Runner V2 (its aux-output connector; with the V1
    # runner vLLM refuses the flag itself, stock included), and the lane runs on the V1 runner.
    pytest.mark.skipif(vllm_at_least("0.32.0"), reason="vLLM 0.32 returns routed experts only "
                       "with Model Runner V2, which the backend does not run on"),
]

MAX_TOKENS = 8
PROMPTS = [p for wave in parity_waves(vocab_size=512) for p in wave]
REFUSAL = ("ainfer_pd mode='pd' cannot return routed experts (--enable-return-routed-experts): "
           "vLLM refuses them beside a KV connector, and the P lane runs in vLLM's "
           "KV-connector slot; use mode='normal'")


def test_routed_experts_with_the_lane_are_refused_at_validation(tiny_model):
    from vllm.config import ModelConfig, VllmConfig

    from vllm_ainfer_pd.executor import AInferPDExecutor

    config = VllmConfig(model_config=ModelConfig(model=tiny_model, skip_tokenizer_init=True,
                                                 dtype="float32", seed=0,
                                                 enable_return_routed_experts=True))
    with pytest.raises(ConfigError) as refused:
        AInferPDExecutor.validate(config)
    assert str(refused.value) == REFUSAL
    config.additional_config = {"ainfer_pd": {"mode": "normal"}}
    assert AInferPDExecutor.validate(config) == AInferPDConfig(mode="normal")


@pytest.mark.slow
def test_routed_experts_with_the_lane_fail_before_an_engine_starts(tiny_model):
    code = ("from vllm import LLM\n"
            f"LLM(model={tiny_model!r}, distributed_executor_backend='ainfer_pd',\n"
            "    enable_return_routed_experts=True)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=240)
    assert run.returncode != 0
    lines = [line for line in run.stderr.splitlines() if "ConfigError: ainfer_pd mode=" in line]
    assert lines == [f"vllm_ainfer_pd.config.ConfigError: {REFUSAL}"], run.stderr[-3000:]
    assert "EngineCore" not in run.stderr  # refused in the frontend, no engine process


async def _routed(engine) -> list[tuple[list[int], np.ndarray]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

    async def one(i: int):
        async for out in engine.generate(TokensPrompt(prompt_token_ids=PROMPTS[i]), params,
                                         request_id=f"r{i}"):
            pass
        return list(out.outputs[0].token_ids), np.asarray(out.outputs[0].routed_experts)

    return list(await asyncio.gather(*(one(i) for i in range(len(PROMPTS)))))


def _run(model: str, **engine_args):
    with async_engine(model, enable_return_routed_experts=True, **engine_args) as engine:
        return asyncio.run(_routed(engine))


@pytest.mark.engine
def test_normal_mode_returns_stock_routed_experts(tiny_model):
    stock = _run(tiny_model)
    ours = _run(tiny_model, distributed_executor_backend="ainfer_pd",
                additional_config={"ainfer_pd": {"mode": "normal"}})
    for i, ((s_tokens, s_routed), (o_tokens, o_routed)) in enumerate(zip(stock, ours)):
        assert o_tokens == s_tokens, (i, s_tokens, o_tokens)
        # every position that went through a forward: the prompt and all outputs but the last
        assert s_routed.shape == (len(PROMPTS[i]) + MAX_TOKENS - 1, *s_routed.shape[1:]), i
        assert o_routed.shape == s_routed.shape, (i, o_routed.shape, s_routed.shape)
        differ = np.argwhere((o_routed != s_routed).any(axis=(1, 2))).ravel()
        assert differ.size == 0, f"prompt {i}: routing differs at positions {differ[:10]}"
