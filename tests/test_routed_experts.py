"""Routing replay (vLLM's `enable_return_routed_experts`, what verl's R3 reads).

vLLM records each token's experts inside the model runner's step, which the P lane's prefills run
beside (and vLLM 0.26 refuses the flag beside any KV connector, the slot the lane runs in). So
with the lane (`mode="pd"`) the backend refuses the flag at once, with one line saying what to
use; with `mode="normal"` every request returns exactly the experts stock vLLM returns for it,
prompt and output positions alike. vLLM 0.32 returns routed experts from Model Runner V2 only
(with the V1 runner it refuses the flag itself, stock included): there these tests run under
AINFER_PD_TEST_RUNNER=v2.
"""

from __future__ import annotations

import asyncio
import os
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
    pytest.mark.skipif(vllm_at_least("0.32.0")
                       and os.environ.get("VLLM_USE_V2_MODEL_RUNNER") != "1",
                       reason="vLLM 0.32 returns routed experts only from Model Runner V2 "
                       "(AINFER_PD_TEST_RUNNER=v2 runs these tests there)"),
]

MAX_TOKENS = 8
PROMPTS = [p for wave in parity_waves(vocab_size=512) for p in wave]
REFUSAL = ("ainfer_pd mode='pd' cannot return routed experts (--enable-return-routed-experts): "
           "the P lane prefills prompts outside the model runner's steps, where vLLM records "
           "them; use mode='normal'")


def test_routed_experts_with_the_lane_are_refused_at_validation(tiny_model):
    from vllm.config import ModelConfig, VllmConfig

    from vllm_ainfer_pd.executor import AInferPDExecutor

    model = {"model": tiny_model, "skip_tokenizer_init": True, "dtype": "float32", "seed": 0}
    if vllm_at_least("0.32.0"):
        from vllm.config.aux_output import AuxOutputConfig

        config = VllmConfig(model_config=ModelConfig(**model),
                            aux_output_config=AuxOutputConfig(enable_return_routed_experts=True))
    else:
        config = VllmConfig(model_config=ModelConfig(**model, enable_return_routed_experts=True))
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
