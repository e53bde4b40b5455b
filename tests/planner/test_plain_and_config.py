"""No connector, no change: AInferPDScheduler is vLLM's Scheduler; the lane's config and wiring."""

from __future__ import annotations

import pytest
from planner_util import make_request, make_scheduler, step
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from vllm_ainfer_pd.config import AInferPDConfig, ConfigError
from vllm_ainfer_pd.connector import CONNECTOR_NAME, kv_transfer_config_for, register_connector


def _trace(scheduler: Scheduler) -> list[dict[str, int]]:
    """Per-step scheduled tokens of a fixed workload: long and short prompts, an abort."""
    reqs = [
        make_request(n, max_tokens=m, req_id=f"q{i}")
        for i, (n, m) in enumerate([(300, 4), (20, 6), (100, 3), (40, 5)])
    ]
    trace = []
    for i, r in enumerate(reqs):
        scheduler.add_request(r)
        trace.append(dict(step(scheduler).num_scheduled_tokens))
        if i == 2:
            scheduler.finish_requests("q1", RequestStatus.FINISHED_ABORTED)
    while scheduler.has_unfinished_requests():
        trace.append(dict(step(scheduler).num_scheduled_tokens))
    return trace


def test_without_a_connector_the_scheduler_behaves_exactly_like_vllms(tiny_model: str) -> None:
    ours = make_scheduler(tiny_model, connector=False, max_num_batched_tokens=64)
    stock = make_scheduler(tiny_model, connector=False, max_num_batched_tokens=64, cls=Scheduler)
    assert ours.p_lane is None
    assert _trace(ours) == _trace(stock)


def test_normal_mode_has_no_p_lane(tiny_model: str) -> None:
    assert kv_transfer_config_for(AInferPDConfig(mode="normal")) is None


def test_kv_transfer_config_for_pd_mode_names_the_connector_and_the_lane_options() -> None:
    raw = kv_transfer_config_for(AInferPDConfig(p_lane_min_tokens=128, max_p_inflight=2))
    assert raw is not None
    assert raw["kv_connector"] == CONNECTOR_NAME
    assert raw["kv_role"] == "kv_both"
    assert raw["kv_connector_extra_config"]["ainfer_pd"]["p_lane_min_tokens"] == 128
    assert raw["kv_connector_extra_config"]["ainfer_pd"]["max_p_inflight"] == 2


def test_register_connector_is_idempotent() -> None:
    register_connector()
    register_connector()
    assert CONNECTOR_NAME in KVConnectorFactory._registry


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"p_lane_min_tokens": 1}, "ainfer_pd.p_lane_min_tokens=1 must be >= 2"),
        ({"max_p_inflight": 0}, "ainfer_pd.max_p_inflight=0 must be >= 1"),
        ({"max_p_inflight": "4"}, "ainfer_pd.max_p_inflight='4' must be of type int"),
        ({"p_lane_min_tokens": "512"}, "ainfer_pd.p_lane_min_tokens='512' must be of type int"),
        ({"p_lane_min_tokens": 64.0}, "ainfer_pd.p_lane_min_tokens=64.0 must be of type int"),
    ],
)
def test_bad_lane_option_fails_with_a_message_naming_the_value(
    raw: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        AInferPDConfig.from_dict(raw)


def test_the_lane_threshold_is_chosen_by_layout_unless_set() -> None:
    """Unset (the default, or null in the JSON), the threshold is 512 uncached tokens at DP = 1
    and every prompt (2) at DP > 1; a value set wins at every DP size. The unset value survives
    the trip through the KV connector's extra config."""
    for config in (AInferPDConfig(), AInferPDConfig.from_dict({"p_lane_min_tokens": None})):
        assert config.p_lane_min_tokens is None
        assert [config.lane_min_tokens(dp) for dp in (1, 2, 8)] == [512, 2, 2]
    assert [AInferPDConfig(p_lane_min_tokens=64).lane_min_tokens(dp) for dp in (1, 2)] == [64, 64]
    raw = kv_transfer_config_for(AInferPDConfig())
    assert AInferPDConfig.from_dict(raw["kv_connector_extra_config"]["ainfer_pd"]) == \
        AInferPDConfig()
