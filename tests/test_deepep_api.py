"""The installed DeepEP is checked against what vLLM 0.26 and the lane call, when the backend is
selected; P's SM count is P's own. A stand-in `deep_ep` package is written to a temporary folder
and imported through Python's import machinery: DeepEP's Python API with DeepEP's signatures
(commit d4f41e4e93, or v1.2.1 without `enable_shrink`) and no kernels. No engine, no GPU."""

from __future__ import annotations

import importlib
import sys
import textwrap

import pytest
from vllm.config import ParallelConfig

from vllm_ainfer_pd.deepep import kernels
from vllm_ainfer_pd.deepep.buffers import (
    BUILD_HINT,
    DeepEPSizes,
    DeepEPUnavailable,
    PhaseBuffers,
    check_api,
)
from vllm_ainfer_pd.deepep.manager import select_backend

pytestmark = pytest.mark.timeout(300)

# DeepEP's deep_ep package as the lane and vLLM 0.26 see it; {shrink} is d4f41e4e93's
# `enable_shrink` parameter, which v1.2.1 lacks.
DEEP_EP = '''
__version__ = "{version}"


class Config:
    def __init__(self, num_sms, *sizes):
        self.num_sms, self.sizes = num_sms, sizes

    def get_nvl_buffer_size_hint(self, hidden_bytes, num_ranks):
        return self.num_sms * hidden_bytes * num_ranks


class EventOverlap:
    pass


class Buffer:
    num_sms = 20

    def __init__(self, group, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False,
                 num_qps_per_rank=24, allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False,
                 explicitly_destroy=False, {shrink}comm=None):
        self.passed = {{k: v for k, v in locals().items() if k not in ("self", "group")}}
        self.group, self.low_latency_mode = group, low_latency_mode
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes

    def destroy(self):
        pass

    @staticmethod
    def set_num_sms(new_num_sms):
        assert new_num_sms % 2 == 0, "The SM count must be even"
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture():
        return EventOverlap()

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks,
                                       num_experts):
        return num_max_dispatch_tokens_per_rank * hidden * num_ranks

    @staticmethod
    def get_dispatch_config(num_ranks):
        assert num_ranks in (2, 4, 8), f"Unsupported number of EP ranks: {{num_ranks}}"
        return Config(Buffer.num_sms, 6, 256, 6, 128)

    @staticmethod
    def get_combine_config(num_ranks):
        assert num_ranks in (2, 4, 8), f"Unsupported number of EP ranks: {{num_ranks}}"
        return Config(Buffer.num_sms, 4, 256, 6, 128)

    def get_dispatch_layout(self, topk_idx, num_experts, previous_event=None,
                            async_finish=False, allocate_on_comm_stream=False):
        raise NotImplementedError

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None,
                 topk_weights=None, expert_alignment=1, num_worst_tokens=0, config=None,
                 previous_event=None, async_finish=False, allocate_on_comm_stream=False):
        raise NotImplementedError

    def combine(self, x, handle, topk_weights=None, bias=None, config=None,
                previous_event=None, async_finish=False, allocate_on_comm_stream=False):
        raise NotImplementedError

    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                             cumulative_local_expert_recv_stats=None,
                             dispatch_wait_recv_cost_stats=None, use_fp8=True,
                             round_scale=False, use_ue8m0=False, async_finish=False,
                             return_recv_hook=False):
        raise NotImplementedError

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, use_logfmt=False,
                            zero_copy=False, async_finish=False, return_recv_hook=False,
                            out=None, combine_wait_recv_cost_stats=None):
        raise NotImplementedError
'''
PINNED = {"version": "2.0.0", "shrink": "enable_shrink=False, "}
V1_2_1 = {"version": "1.2.1", "shrink": ""}
# vLLM modules that import deep_ep at module level (imported by the tests that need them).
DEEP_EP_USERS = ("vllm.model_executor.layers.fused_moe.prepare_finalize.deepep_ht",)


@pytest.fixture
def install_deep_ep(tmp_path, monkeypatch):
    """`install_deep_ep(source)`: a `deep_ep` package with that `__init__.py`, first on
    sys.path; the real one (if any) and every module imported from the stand-in are forgotten
    before and after the test."""

    def forget() -> None:
        for name in ("deep_ep", *DEEP_EP_USERS):
            sys.modules.pop(name, None)

    def install(source: str):
        package = tmp_path / "deep_ep"
        package.mkdir(exist_ok=True)
        (package / "__init__.py").write_text(textwrap.dedent(source))
        monkeypatch.syspath_prepend(str(tmp_path))
        importlib.invalidate_caches()
        forget()
        return importlib.import_module("deep_ep")

    monkeypatch.setattr(kernels, "_PNormal", None)  # P's kernel class, made over vLLM's module
    yield install
    forget()


def _deepep_parallel() -> ParallelConfig:
    return ParallelConfig(data_parallel_size=2, enable_expert_parallel=True,
                          all2all_backend="deepep_low_latency")


def test_a_deep_ep_without_enable_shrink_stops_selection_naming_the_parameter_and_the_commit(
        install_deep_ep):
    deep_ep = install_deep_ep(DEEP_EP.format(**V1_2_1))
    with pytest.raises(DeepEPUnavailable) as err:
        select_backend(_deepep_parallel())
    assert str(err.value) == (
        f"deep_ep at {deep_ep.__file__} (DeepEP 1.2.1) has no parameter enable_shrink in "
        f"Buffer.__init__, which vLLM 0.26's deepep_low_latency manager (DeepEPLLAll2AllManager) "
        f"passes; build {BUILD_HINT}")
    assert "29d31c0" in str(err.value) and "\n" not in str(err.value)


def test_the_deep_ep_vllm_pins_passes_selection(install_deep_ep):
    install_deep_ep(DEEP_EP.format(**PINNED))
    parallel = _deepep_parallel()
    select_backend(parallel)
    assert parallel.all2all_backend == "deepep_low_latency"


def test_a_missing_kernel_parameter_names_the_method_and_who_passes_it(install_deep_ep):
    source = DEEP_EP.format(**PINNED).replace("round_scale=False, ", "")
    deep_ep = install_deep_ep(source)
    with pytest.raises(DeepEPUnavailable, match=r"has no parameter round_scale in "
                                                r"Buffer.low_latency_dispatch, which vLLM 0.26's "
                                                r"low-latency prepare/finalize \(D's kernels\) "
                                                r"passes; build"):
        check_api(deep_ep)


def test_a_deep_ep_that_does_not_import_is_one_line_naming_the_build(install_deep_ep):
    with pytest.raises(ImportError):
        install_deep_ep("raise ImportError('libnvshmem_host.so.3: cannot open shared object "
                        "file: No such file or directory')\n")
    with pytest.raises(DeepEPUnavailable) as err:
        select_backend(_deepep_parallel())
    assert str(err.value) == (
        f"import deep_ep failed (ImportError: libnvshmem_host.so.3: cannot open shared object "
        f"file: No such file or directory); rebuild it with {BUILD_HINT}")


def test_the_lane_on_deepep_stops_while_vllm_builds_the_config_before_any_engine(
        install_deep_ep, tiny_model):
    """The refusal through vLLM's own config path: `LLM(...)`/`vllm serve` build this config in
    the process that parses the arguments, before an engine process starts."""
    from vllm.engine.arg_utils import EngineArgs

    install_deep_ep(DEEP_EP.format(**V1_2_1))
    args = EngineArgs(model=tiny_model, distributed_executor_backend="ainfer_pd",
                      data_parallel_size=2, enable_expert_parallel=True,
                      all2all_backend="deepep_low_latency", enforce_eager=True,
                      additional_config={"ainfer_pd": {"p_lane_min_tokens": 32}})
    with pytest.raises(DeepEPUnavailable, match=r"has no parameter enable_shrink in "
                                                r"Buffer.__init__"):
        args.create_engine_config()


def test_p_sm_count_is_p_s_own_whatever_sets_deepeps_class_wide_count(install_deep_ep):
    """DeepEP's recommended configs read `Buffer.num_sms`, a class attribute anything in the
    process may set (vLLM's high-throughput manager's `set_num_sms`). The lane's sizing leaves it
    as it found it, and P's kernels pass P's own configs; vLLM's kernel, the negative control,
    follows the class-wide count."""
    deep_ep = install_deep_ep(DEEP_EP.format(**PINNED))
    sizes = DeepEPSizes.compute(deep_ep, ep_size=2, hidden=2048, num_experts=64, top_k=8,
                                p_sms=24, p_max_tokens=8192, d_max_tokens=256)
    assert deep_ep.Buffer.num_sms == 20  # DeepEP's default, untouched by the sizing
    assert sizes.p_nvl_bytes == 24 * 2048 * 2 * 2  # sized for P's 24 SMs
    d_buffer = deep_ep.Buffer(None, low_latency_mode=True)
    buffers = PhaseBuffers(deep_ep, None, sizes, d_buffer)
    deep_ep.Buffer.set_num_sms(8)  # someone else's setting, after P's buffer was sized

    p_kernel = kernels.p_prepare_finalize_cls()(
        buffers, lambda: None, num_dispatchers=2, dp_size=2, rank_expert_offset=0)
    assert p_kernel._get_dispatch_config().num_sms == 24
    assert p_kernel._get_combine_config().num_sms == 24
    assert buffers.for_p() is not d_buffer

    from vllm.model_executor.layers.fused_moe.prepare_finalize.deepep_ht import (
        DeepEPHTPrepareAndFinalize,
    )

    vllms = DeepEPHTPrepareAndFinalize(buffers.for_p(), num_dispatchers=2, dp_size=2,
                                       rank_expert_offset=0)
    assert vllms._get_dispatch_config().num_sms == 8


def test_explicit_configs_serve_an_ep_size_deepep_recommends_none_for(install_deep_ep):
    deep_ep = install_deep_ep(DEEP_EP.format(**PINNED))
    sizes = DeepEPSizes(1, 2048, 64, 8, 24, 8192, 128, 1 << 20, 1 << 20, 0, 1 << 20)
    with pytest.raises(DeepEPUnavailable, match=r"no config for EP=1"):
        PhaseBuffers(deep_ep, None, sizes, deep_ep.Buffer(None, low_latency_mode=True))
    config = deep_ep.Config(24, 6, 256, 6, 128)
    buffers = PhaseBuffers(deep_ep, None, sizes, deep_ep.Buffer(None, low_latency_mode=True),
                           configs=(config, config))
    assert buffers.dispatch_config is config and deep_ep.Buffer.num_sms == 20


@pytest.mark.slow
def test_vllms_low_latency_manager_builds_d_buffer_as_the_one_gpu_check_does(tmp_path):
    """`benchmarks/deepep_vllm_one_gpu.py`'s path through vLLM 0.26, on the CPU (gloo, world size
    1, the stand-in deep_ep): vLLM's `DeepEPLLAll2AllManager.get_handle` builds D's buffer with
    vLLM's keywords, `enable_shrink` among them, and the lane's normal-mode buffer goes beside
    it. In a fresh process: vLLM's distributed state is process-wide."""
    import json
    import os
    import subprocess
    from pathlib import Path

    (tmp_path / "deep_ep").mkdir()
    (tmp_path / "deep_ep" / "__init__.py").write_text(DEEP_EP.format(**PINNED))
    repo = Path(__file__).resolve().parent.parent
    code = textwrap.dedent("""
        import json, runpy
        one_gpu = runpy.run_path("benchmarks/deepep_vllm_one_gpu.py", run_name="one_gpu")
        manager, d_buffer, group = one_gpu["vllm_low_latency_buffer"](128, 2048, 64, "gloo")
        import deep_ep
        from vllm_ainfer_pd.deepep.buffers import DeepEPSizes, PhaseBuffers, check_normal
        config = deep_ep.Config(24, 6, 256, 6, 128)
        sizes = DeepEPSizes(1, 2048, 64, 8, 24, 8192, 128, 1, d_buffer.num_rdma_bytes,
                            d_buffer.num_nvl_bytes, 1)
        buffers = PhaseBuffers(deep_ep, group, sizes, d_buffer, configs=(config, config))
        try:
            check_normal(d_buffer, d_buffer)
            guard = "not raised"
        except AssertionError as exc:
            guard = str(exc)
        print("RESULT " + json.dumps({"manager": type(manager).__name__,
                                      "passed": d_buffer.passed,
                                      "p_low_latency_mode": buffers.for_p().low_latency_mode,
                                      "guard": guard}))
        """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(repo),
                                                        os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True,
                         text=True, timeout=240, cwd=repo, env=env)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    result = json.loads(lines[0][len("RESULT "):])
    assert result["manager"] == "DeepEPLLAll2AllManager"
    assert result["passed"] == {
        "num_nvl_bytes": result["passed"]["num_nvl_bytes"],  # VLLM_DEEPEP_BUFFER_SIZE_MB
        "num_rdma_bytes": 128 * 2048 * 1,  # the stand-in's size hint for vLLM's arguments
        "low_latency_mode": True, "num_qps_per_rank": 64,
        "allow_nvlink_for_low_latency_mode": True, "allow_mnnvl": False,
        "explicitly_destroy": True, "enable_shrink": False, "comm": None}
    assert result["p_low_latency_mode"] is False
    assert result["guard"] == "a DeepEP normal-mode call reached the low-latency buffer (D's)"
