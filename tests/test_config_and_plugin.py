"""Config validation and the plugin's vLLM check, without starting an engine."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from vllm_ainfer_pd import TESTED_VLLM_VERSIONS
from vllm_ainfer_pd.config import AInferPDConfig, ConfigError
from vllm_ainfer_pd.vllm_glue import check_vllm, installed_release

INSTALLED = installed_release()


def test_a_tested_release_runs_without_a_warning(caplog):
    assert INSTALLED in TESTED_VLLM_VERSIONS, (INSTALLED, TESTED_VLLM_VERSIONS)
    check_vllm(INSTALLED)
    check_vllm(INSTALLED + "+cpu")
    assert not _our_warnings(caplog), caplog.text


def _our_warnings(caplog) -> list[str]:
    """The backend's warnings (importing vLLM may log its own, as 0.32 does about Triton), each
    record once: pytest attaches its capture to every logger that does not propagate, and a
    record of ours passes two of them (the package's logger, then vLLM's it hands it to)."""
    records = {id(r): r for r in caplog.records}.values()
    return [r.getMessage() for r in records
            if r.levelname == "WARNING" and r.name.startswith("vllm_ainfer_pd")]


def _later_patches() -> list[str]:
    major, minor, patch = (int(x) for x in INSTALLED.split("."))
    return [f"{major}.{minor}.{patch + 1}", f"{major}.{minor}.{patch + 2}+cpu"]


@pytest.mark.parametrize("found", _later_patches())
def test_an_untested_release_whose_symbols_match_runs_with_a_warning_naming_it(found, caplog):
    """Support is decided by the symbols' shapes (here: the installed vLLM's, which match), not
    by the version string; the log names the release and the tested ones."""
    check_vllm(found)
    warned = _our_warnings(caplog)
    assert len(warned) == 1 and warned[0].startswith(
        f"vllm-ainfer-pd was tested on vLLM {', '.join(TESTED_VLLM_VERSIONS)}; vLLM "
        f"{found.split('+')[0]} is installed and every one of the "), warned


def test_config_defaults_to_pd_mode():
    assert AInferPDConfig.from_dict(None).mode == "pd"
    assert AInferPDConfig.from_dict({"mode": "normal"}).mode == "normal"


def test_the_default_segment_policy_is_the_benchmarked_one_and_a_span_needs_fixed():
    assert AInferPDConfig.from_dict(None).segment_policy == "load"
    fixed = AInferPDConfig.from_dict({"segment_policy": "fixed", "segment_span": 4})
    assert fixed.segment_span == 4
    with pytest.raises(ConfigError, match=r"segment_span=4 applies to segment_policy='fixed'; "
                                          r"segment_policy='load' chooses K itself"):
        AInferPDConfig.from_dict({"segment_span": 4})


def test_d_stream_priority_is_default_or_high():
    assert AInferPDConfig.from_dict(None).d_stream_priority == "default"
    assert AInferPDConfig.from_dict({"d_stream_priority": "high"}).d_stream_priority == "high"
    with pytest.raises(ConfigError, match=r"ainfer_pd.d_stream_priority='urgent' is not one of "
                                          r"default, high"):
        AInferPDConfig.from_dict({"d_stream_priority": "urgent"})


def test_p_sm_count_is_validated_and_refused_off_cuda():
    from vllm_ainfer_pd.worker.p_thread import p_stream

    assert AInferPDConfig.from_dict(None).p_sm_count == 0
    assert AInferPDConfig.from_dict({"p_sm_count": 66}).p_sm_count == 66
    with pytest.raises(ConfigError, match=r"ainfer_pd.p_sm_count=-1 must be >= 0"):
        AInferPDConfig.from_dict({"p_sm_count": -1})
    assert p_stream(torch.device("cpu"), 0) == (None, None)
    with pytest.raises(ConfigError, match=r"ainfer_pd.p_sm_count=8 confines P's CUDA stream "
                                          r"to SMs; this worker runs on cpu"):
        p_stream(torch.device("cpu"), 8)


def test_p_stream_marks_is_segment_layer_or_sublayer():
    assert AInferPDConfig.from_dict(None).p_stream_marks == "segment"
    assert AInferPDConfig.from_dict({"p_stream_marks": "layer"}).p_stream_marks == "layer"
    assert AInferPDConfig.from_dict({"p_stream_marks": "sublayer"}).p_stream_marks == "sublayer"
    with pytest.raises(ConfigError, match=r"ainfer_pd.p_stream_marks='kernel' is not one of "
                                          r"segment, layer"):
        AInferPDConfig.from_dict({"p_stream_marks": "kernel"})


def test_unknown_option_is_named():
    with pytest.raises(ConfigError, match=r"unknown ainfer_pd option\(s\) 'segment_spam'"):
        AInferPDConfig.from_dict({"segment_spam": 2})


def test_bad_mode_value_is_named():
    with pytest.raises(ConfigError, match=r"ainfer_pd.mode='fast' is not one of pd, normal"):
        AInferPDConfig.from_dict({"mode": "fast"})


def test_wrong_type_is_named():
    with pytest.raises(ConfigError, match=r"ainfer_pd.mode=3 must be of type str"):
        AInferPDConfig.from_dict({"mode": 3})


@pytest.mark.slow
def test_the_packages_info_logs_reach_vllms_handler_once():
    """In a fresh process, as in each vLLM process: before the plugin registers, the package's INFO
    records are dropped (no handler); after it, they print once, in vLLM's format."""
    script = (
        "import logging\n"
        "log = logging.getLogger('vllm_ainfer_pd.worker.p_lane')\n"
        "import vllm.logger\n"
        "log.info('before-register')\n"
        "from vllm_ainfer_pd.plugin import register\n"
        "register(); register()\n"
        # vLLM 0.32 sets up its handlers when an engine applies its logging config, which in some
        # processes comes after plugins load.
        "if hasattr(vllm.logger, 'configure_logging'):\n"
        "    from vllm.config.logging import LoggingConfig\n"
        "    vllm.logger.configure_logging(LoggingConfig())\n"
        "log.info('after-register %d', 7)\n"
        "log.debug('below-vllms-level')\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "VLLM_LOGGING_LEVEL": "INFO"})
    assert out.returncode == 0, out.stderr
    printed = out.stdout + out.stderr
    assert "before-register" not in printed
    lines = [line for line in printed.splitlines() if "after-register 7" in line]
    assert len(lines) == 1, printed
    # vLLM's format: "INFO <date> <time> [<file>:<line>] ..." (0.32 prefixes the process name)
    assert "INFO " in lines[0] and "[<string>:10]" in lines[0], lines[0]
    assert "below-vllms-level" not in printed


def test_registration_problem_names_why_vllm_would_not_load_the_plugin(monkeypatch):
    import importlib.metadata

    from vllm_ainfer_pd.plugin import registration_problem

    monkeypatch.setenv("VLLM_PLUGINS", "another")
    assert registration_problem() == "VLLM_PLUGINS='another' leaves out 'ainfer_pd'"
    monkeypatch.setenv("VLLM_PLUGINS", "another,ainfer_pd")
    assert registration_problem() is None  # the package is installed in the test environment
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [])  # on PYTHONPATH only
    assert registration_problem().startswith(
        "no vllm.general_plugins entry point named 'ainfer_pd': the package is importable but "
        "not installed")


@pytest.mark.slow
def test_without_the_plugin_vllm_fails_inside_vllm_config_with_the_unpack_error(tiny_model):
    """What a user sees where the plugin did not load (the package on PYTHONPATH only): vLLM's
    own `Executor.get_class` resolves `ainfer_pd` as a class path (`resolve_obj_by_qualname`:
    `module, name = qualname.rsplit(".", 1)`) and pydantic reports the ValueError."""
    code = ("from vllm.engine.arg_utils import EngineArgs\n"
            f"EngineArgs(model={tiny_model!r}, distributed_executor_backend='ainfer_pd', "
            "enforce_eager=True).create_engine_config()\n")
    run = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True,
                         text=True, timeout=300, env={**os.environ, "VLLM_PLUGINS": "none"})
    assert run.returncode != 0
    assert "ValidationError: 1 validation error for VllmConfig" in run.stderr, run.stderr[-3000:]
    assert "not enough values to unpack (expected 2, got 1)" in run.stderr, run.stderr[-3000:]


@pytest.mark.engine
def test_a_worker_start_refusal_reaches_the_caller_as_vllms_own_error(tiny_model, monkeypatch):
    """vLLM's model runner refuses custom logits processors beside speculative decoding while a
    worker starts; this backend's workers are processes of their own, where vLLM would report
    only 'WorkerProc initialization failed'. The executor raises vLLM's ValueError first, before
    any worker starts, as vLLM's in-process executor would (vLLM's own
    test_rejects_custom_logitsprocs expects exactly this)."""
    from vllm import LLM
    from vllm.v1.sample.logits_processor import (
        STR_SPEC_DEC_REJECTS_LOGITSPROCS,
        MinTokensLogitsProcessor,
    )

    if os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == "1":
        pytest.skip("Model Runner V2 runs custom logits processors beside speculative decoding "
                    "(and refuses V1 ones in the frontend): nothing for the workers to refuse")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # EngineCore in this process
    with pytest.raises(ValueError, match=STR_SPEC_DEC_REJECTS_LOGITSPROCS):
        LLM(model=tiny_model, distributed_executor_backend="ainfer_pd", enforce_eager=True,
            dtype="float32", speculative_config={"method": "ngram", "num_speculative_tokens": 1,
                                                 "prompt_lookup_max": 2},
            logits_processors=[MinTokensLogitsProcessor])


@pytest.fixture
def vllm_config(tiny_model):
    from vllm.config import ModelConfig, VllmConfig

    return VllmConfig(model_config=ModelConfig(model=tiny_model, skip_tokenizer_init=True,
                                               dtype="float32", seed=0))


def test_the_lane_takes_vllms_connector_slot_and_refuses_another_connector(vllm_config):
    from vllm.config import KVTransferConfig

    from vllm_ainfer_pd.connector import CONNECTOR_NAME
    from vllm_ainfer_pd.executor import configure_p_lane

    configure_p_lane(vllm_config, AInferPDConfig())
    assert vllm_config.kv_transfer_config.kv_connector == CONNECTOR_NAME
    assert vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
    configure_p_lane(vllm_config, AInferPDConfig())  # idempotent (frontend, then EngineCore)
    assert vllm_config.kv_transfer_config.kv_connector == CONNECTOR_NAME

    vllm_config.kv_transfer_config = KVTransferConfig(kv_connector="ExampleConnector",
                                                      kv_role="kv_both")
    with pytest.raises(ConfigError, match="already gives to 'ExampleConnector'; use "
                                          "mode='normal' or drop the other connector"):
        configure_p_lane(vllm_config, AInferPDConfig())
    configure_p_lane(vllm_config, AInferPDConfig(mode="normal"))  # no lane: the slot is theirs
    assert vllm_config.kv_transfer_config.kv_connector == "ExampleConnector"


@pytest.mark.parametrize(("field", "value", "message"), [
    ("pipeline_parallel_size", 2,
     r"ainfer_pd does not support pipeline parallelism \(pipeline_parallel_size=2\)"),
    ("worker_cls", "my.Worker", r"ainfer_pd chooses its own worker; got worker_cls='my.Worker'"),
])
def test_a_deployment_the_backend_cannot_run_is_named(vllm_config, field, value, message):
    from vllm_ainfer_pd.executor import AInferPDExecutor

    assert AInferPDExecutor.validate(vllm_config).mode == "pd"
    setattr(vllm_config.parallel_config, field, value)
    with pytest.raises(ConfigError, match=message):
        AInferPDExecutor.validate(vllm_config)


def test_another_scheduler_class_is_named(vllm_config):
    from vllm_ainfer_pd.executor import AInferPDExecutor

    vllm_config.scheduler_config.scheduler_cls = "my.Scheduler"
    with pytest.raises(ConfigError, match=r"got scheduler_cls='my.Scheduler'"):
        AInferPDExecutor.validate(vllm_config)


def test_lora_is_refused_with_the_lane_and_allowed_without(vllm_config):
    from vllm.config import LoRAConfig

    from vllm_ainfer_pd.executor import AInferPDExecutor

    vllm_config.lora_config = LoRAConfig()
    with pytest.raises(ConfigError, match=r"does not run LoRA adapters \(--enable-lora\)"):
        AInferPDExecutor.validate(vllm_config)
    vllm_config.additional_config = {"ainfer_pd": {"mode": "normal"}}
    assert AInferPDExecutor.validate(vllm_config).mode == "normal"


@pytest.mark.parametrize(("fields", "message"), [
    ({"enable_expert_parallel": True, "data_parallel_size": 2,
      "all2all_backend": "mori_low_latency"},
     r"with expert parallelism over 2 DP ranks runs P's MoE dispatch beside D's, and "
     r"all2all_backend='mori_low_latency' keeps buffers both would share; use "
     r"--all2all-backend allgather_reducescatter, deepep_low_latency \(phase-owned DeepEP\) or "
     r"mode='normal'"),
    ({"enable_eplb": True}, r"does not run expert load balancing \(--enable-eplb\)"),
    ({"decode_context_parallel_size": 2},
     r"does not run context parallelism \(decode_context_parallel_size=2\)"),
    ({"prefill_context_parallel_size": 2},
     r"does not run context parallelism \(prefill_context_parallel_size=2\)"),
])
def test_a_layout_the_lane_cannot_run_is_named_and_runs_without_the_lane(vllm_config, fields,
                                                                           message):
    from vllm_ainfer_pd.executor import AInferPDExecutor

    for field, value in fields.items():
        setattr(vllm_config.parallel_config, field, value)
    with pytest.raises(ConfigError, match=message):
        AInferPDExecutor.validate(vllm_config)
    vllm_config.additional_config = {"ainfer_pd": {"mode": "normal"}}
    assert AInferPDExecutor.validate(vllm_config).mode == "normal"


@pytest.mark.parametrize(("field", "value"), [("tensor_parallel_size", 2),
                                              ("data_parallel_size", 2)])
def test_free_ordering_is_refused_on_an_engine_of_several_ranks_and_on_the_cpu(vllm_config,
                                                                               field, value):
    """P may run unordered against D only where it issues no collective (one rank), and only
    on a GPU: on the CPU P's compute would run beside D's on the same cores."""
    from vllm_ainfer_pd.executor import AInferPDExecutor

    vllm_config.additional_config = {"ainfer_pd": {"ordering": "free"}}
    with pytest.raises(ConfigError, match=r"^ainfer_pd.ordering='free' runs P's kernels beside "
                                          r"D's on a GPU; on the CPU use ordering='fine'$"):
        AInferPDExecutor.validate(vllm_config)
    setattr(vllm_config.parallel_config, field, value)
    with pytest.raises(ConfigError, match=r"ainfer_pd.ordering='free' runs P unordered against "
                                          r"D, which needs an engine of one rank; this one has "
                                          r"tensor_parallel_size=\d x data_parallel_size=\d"):
        AInferPDExecutor.validate(vllm_config)


def test_the_stateless_all2all_backend_and_single_dp_expert_parallelism_run_the_lane(
        vllm_config):
    """vLLM's all-to-all kernels run only across DP ranks; the default backend keeps no state."""
    from vllm_ainfer_pd.executor import AInferPDExecutor

    parallel = vllm_config.parallel_config
    parallel.enable_expert_parallel, parallel.all2all_backend = True, "deepep_high_throughput"
    assert AInferPDExecutor.validate(vllm_config).mode == "pd"  # DP=1: no all-to-all kernels
    parallel.data_parallel_size, parallel.all2all_backend = 2, "allgather_reducescatter"
    assert AInferPDExecutor.validate(vllm_config).mode == "pd"


def test_model_runner_v2_runs_the_lane_from_vllm_032_and_is_refused_before(vllm_config,
                                                                          monkeypatch):
    """vLLM picks Model Runner V2 on GPU for dense models and some MoE architectures unless
    VLLM_USE_V2_MODEL_RUNNER=0; the CPU platform builds a V1 config without Triton, so the
    variable is set after the config was built, as vLLM's property reads it each time. From vLLM
    0.32 the lane runs on it, with the V2 features P's batch does not describe refused by name;
    before, it is refused with the variable that turns it off."""
    from vllm_ainfer_pd.executor import AInferPDExecutor
    from vllm_ainfer_pd.vllm_glue import vllm_at_least

    assert AInferPDExecutor.validate(vllm_config).mode == "pd"
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    assert vllm_config.use_v2_model_runner
    if not vllm_at_least("0.32"):
        with pytest.raises(ConfigError, match=r"runs on vLLM's Model Runner V2 from vLLM 0\.32; "
                                              r"vLLM 0\.26\.0 selects it here \(its default for "
                                              r"Qwen3MoeForCausalLM\): set "
                                              r"VLLM_USE_V2_MODEL_RUNNER=0"):
            AInferPDExecutor.validate(vllm_config)
        return
    from vllm.config.attention import HiSparseConfig

    assert AInferPDExecutor.validate(vllm_config).mode == "pd"
    vllm_config.cache_config.kv_sharing_fast_prefill = True
    with pytest.raises(ConfigError, match=r"does not run KV-sharing fast prefill"):
        AInferPDExecutor.validate(vllm_config)
    vllm_config.cache_config.kv_sharing_fast_prefill = False
    vllm_config.attention_config.hisparse_config = HiSparseConfig()
    with pytest.raises(ConfigError, match=r"does not run HiSparse attention"):
        AInferPDExecutor.validate(vllm_config)
    vllm_config.additional_config = {"ainfer_pd": {"mode": "normal"}}
    assert AInferPDExecutor.validate(vllm_config).mode == "normal"  # no lane: nothing refused
