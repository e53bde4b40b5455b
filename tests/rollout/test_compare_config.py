"""The comparison driver gives every backend identical flags except its own (no server here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_ainfer_pd.rollout.compare import AINFER, CompareConfig
from vllm_ainfer_pd.rollout.cpu_engine import CPU_ENGINE_ARGS, serve_args


def test_backends_differ_only_in_their_own_flags():
    cfg = CompareConfig("m", Path("o"), tp=2, dp=2, enable_expert_parallel=True,
                        variants=(("normal", '{"ainfer_pd": {"mode": "normal"}}'),),
                        extra_backends=(("stock_mp", ("--distributed-executor-backend", "mp")),))
    assert cfg.backends() == {
        "stock": [],
        "ainfer_pd": AINFER,
        "normal": [*AINFER, "--additional-config", '{"ainfer_pd": {"mode": "normal"}}'],
        "stock_mp": ["--distributed-executor-backend", "mp"],
    }
    common = cfg.common_args()
    assert common[:len(serve_args(CPU_ENGINE_ARGS))] == serve_args(CPU_ENGINE_ARGS)
    assert common[-5:] == ["--tensor-parallel-size", "2", "--data-parallel-size", "2",
                           "--enable-expert-parallel"]
    assert cfg.env()["VLLM_CPU_OMP_THREADS_BIND"].count("|") == 3  # one entry per rank (tp*dp)


@pytest.mark.parametrize("kwargs, message", [
    ({"variants": (("v", "{not json"),)}, "variant 'v': additional config '{not json' is not JSON"),
    ({"variants": (("stock", "{}"),)}, "backend names must be unique"),
    ({"reps": 0}, "reps=0 must be >= 1"),
    ({"platform": "tpu"}, "platform='tpu'"),
    ({"schedule": "random"}, "schedule='random'"),
    ({"cached_replay": True, "extra_backends": (("stock_cached", ("--seed", "1")),)},
     r"backend names \['stock_cached'\] clash with them"),
])
def test_bad_settings_fail_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CompareConfig("m", Path("o"), **kwargs)


def test_only_runs_the_named_backends_in_its_order_and_rejects_unknown_names():
    variants = (("normal", '{"ainfer_pd": {"mode": "normal"}}'),)
    cfg = CompareConfig("m", Path("o"), variants=variants, only=("stock", "normal"))
    assert list(cfg.backends()) == ["stock", "normal"]
    reversed_cfg = CompareConfig("m", Path("o"), variants=variants, only=("normal", "stock"))
    assert list(reversed_cfg.backends()) == ["normal", "stock"]
    with pytest.raises(ValueError, match=r"no backend named \['nromal'\]"):
        CompareConfig("m", Path("o"), variants=variants, only=("nromal",))
