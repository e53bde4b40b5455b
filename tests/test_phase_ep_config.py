"""Which all-to-all backends the lane runs at DP > 1 with expert parallelism (each with phase-owned
state, docs/deepep.md), the one-line refusals, and the `p_deepep_sms` option; no engine."""

from __future__ import annotations

import importlib.util

import pytest
from vllm.config import ParallelConfig

from vllm_ainfer_pd.config import AInferPDConfig, ConfigError
from vllm_ainfer_pd.deepep.buffers import DeepEPUnavailable
from vllm_ainfer_pd.deepep.manager import needs_phase_ep, select_backend


def _parallel(backend: str, dp: int = 2, ep: bool = True) -> ParallelConfig:
    return ParallelConfig(data_parallel_size=dp, enable_expert_parallel=ep,
                          all2all_backend=backend)


def test_the_stateless_backend_runs_with_p_own_communicators():
    parallel = _parallel("allgather_reducescatter")  # vLLM maps the removed "naive" to it
    select_backend(parallel)
    assert needs_phase_ep(parallel) and parallel.all2all_backend == "allgather_reducescatter"


@pytest.mark.skipif(importlib.util.find_spec("deep_ep") is not None,
                    reason="deep_ep is installed here: the refusal for its absence cannot show")
def test_without_deep_ep_a_deepep_backend_stops_at_selection_naming_the_build_script():
    for backend in ("deepep_low_latency", "deepep_high_throughput"):
        with pytest.raises(DeepEPUnavailable) as err:
            select_backend(_parallel(backend))
        message = str(err.value)
        assert "\n" not in message and "deep_ep package is not installed" in message
        assert "DEEPEP_SRC=/path/to/DeepEP bash scripts/build_deepep.sh" in message


def test_other_stateful_backends_are_refused_by_name():
    with pytest.raises(ConfigError, match=r"all2all_backend='mori_low_latency' keeps buffers "
                                          r"both would share"):
        select_backend(_parallel("mori_low_latency"))


def test_no_phase_owned_state_without_expert_parallelism_across_dp_ranks():
    for parallel in (_parallel("mori_low_latency", dp=1), _parallel("mori_low_latency", ep=False)):
        select_backend(parallel)  # nothing to own: P's MoE runs no all-to-all
        assert not needs_phase_ep(parallel)


def test_p_deepep_sms_is_a_positive_even_number():
    assert AInferPDConfig().p_deepep_sms == 24
    assert AInferPDConfig.from_dict({"p_deepep_sms": 12}).p_deepep_sms == 12
    for bad in (0, 13, -2):
        with pytest.raises(ConfigError, match=rf"^ainfer_pd.p_deepep_sms={bad} must be a "
                                              rf"positive even number"):
            AInferPDConfig.from_dict({"p_deepep_sms": bad})
