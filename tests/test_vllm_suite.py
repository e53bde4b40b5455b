"""vLLM's own tests drive the backend: a slice of the differential run (`benchmarks/vllm_tests.py`,
`make vllm-tests`), and the overlay's injection rules without an engine.

The slice runs vLLM 0.26.0's tests (from its source distribution, fetched through pip and cached)
with `ainfer_pd` injected into every engine and the lane taking the tests' prompts; each of them
passes on stock vLLM with the same model mapping (benchmarks/results/vllm_tests/).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ainfer_pd_testing.vllm_suite import hooks

# vLLM test node ids that pass on stock with the tiny model (benchmarks/results/vllm_tests/).
SLICE = {
    "tests/v1/sample/test_sampling_params_e2e.py": [
        "test_n_gt_1", "test_penalties", "test_detokenize_false", "test_seed",
        "test_stop_token_ids",
    ],
}


def engine_args(**overrides) -> SimpleNamespace:
    fields = {"distributed_executor_backend": None, "additional_config": {},
              "enforce_eager": False}
    return SimpleNamespace(**{**fields, **overrides})


def test_ours_injects_the_backend_and_a_low_lane_threshold_into_every_engine():
    args = engine_args(additional_config={"other_plugin": {"x": 1}})
    hooks.engine_settings(args, "ours")
    assert args.distributed_executor_backend == "ainfer_pd"
    assert args.additional_config == {
        "other_plugin": {"x": 1}, "ainfer_pd": {"p_lane_min_tokens": hooks.P_LANE_MIN_TOKENS}}
    assert args.enforce_eager
    mp = engine_args(distributed_executor_backend="mp", additional_config='{"ainfer_pd": '
                     '{"p_lane_min_tokens": 64}}')
    hooks.engine_settings(mp, "ours")
    # A test's own lane options win; vLLM's multiprocessing backend is replaced.
    assert (mp.distributed_executor_backend, mp.additional_config) == (
        "ainfer_pd", {"ainfer_pd": {"p_lane_min_tokens": 64}})


def test_stock_keeps_the_tests_backend_and_other_backends_are_left_alone():
    stock = engine_args(distributed_executor_backend="mp")
    hooks.engine_settings(stock, "stock")
    assert (stock.distributed_executor_backend, stock.additional_config) == ("mp", {})
    assert stock.enforce_eager  # the CPU setting both runs share
    ray = engine_args(distributed_executor_backend="ray")
    hooks.engine_settings(ray, "ours")
    assert ray.distributed_executor_backend == "ray"


def test_where_a_test_hides_vllms_plugins_the_backend_goes_in_by_class_path(monkeypatch):
    """Some of vLLM's tests replace importlib.metadata.entry_points with a fake serving only their
    own group, so vLLM loads no plugin in that process (or in one it forks) and cannot resolve
    the name: as there, plugins count as loaded and the name is not registered."""
    from vllm import plugins
    from vllm.v1.executor.abstract import Executor

    args = engine_args()
    hooks.engine_settings(args, "ours")
    assert args.distributed_executor_backend == "ainfer_pd"  # the plugin loads here
    monkeypatch.setattr(plugins, "plugins_loaded", True)
    monkeypatch.setattr(Executor, "get_class", staticmethod(lambda vllm_config: None))
    args = engine_args()
    hooks.engine_settings(args, "ours")
    assert args.distributed_executor_backend == "vllm_ainfer_pd.executor.AInferPDExecutor"


def test_hub_names_resolve_offline_to_the_local_model(tmp_path, monkeypatch):
    from ainfer_pd_testing.vllm_suite.hub import build_hub

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    hub = build_hub(tmp_path / "hub", model, names=("org/name",))
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache("org/name", "config.json", cache_dir=str(hub))
    assert found is not None and open(found).read() == "{}"


@pytest.mark.engine
@pytest.mark.timeout(900)
def test_vllm_own_tests_pass_against_ainfer_pd_with_the_lane_taking_prompts(tmp_path):
    from ainfer_pd_testing.vllm_suite.run import run_suite

    nodes = [f"{module}::{name}" for module, names in SLICE.items() for name in names]
    run = run_suite("ours", list(SLICE), tmp_path)
    outcomes = {n: run.results.get(n, {}).get("outcome", "absent") for n in nodes}
    assert all(o == "passed" for o in outcomes.values()), (outcomes, run.results)
    assert run.engines and all("backend=ainfer_pd" in e for e in run.engines), run.engines
    assert sum(run.results[n]["lane_jobs"] for n in nodes) >= len(nodes), run.results
