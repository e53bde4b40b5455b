"""The start-up check of the vLLM symbols the backend patches or relies on (vllm_glue), without
an engine: it passes against the installed vLLM, and a changed symbol stops the backend's
validation with one line that names it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from vllm_ainfer_pd.vllm_glue import GlueShapeError, all_patches, check_vllm_shapes

DOC = Path(__file__).resolve().parent.parent / "docs" / "vllm-glue.md"


def test_the_installed_vllm_has_every_shape_the_glue_assumes():
    check_vllm_shapes()


def _one_line(err: pytest.ExceptionInfo) -> str:
    message = str(err.value)
    assert "\n" not in message, message
    return message


def test_a_patched_function_with_another_signature_is_named(monkeypatch):
    from vllm.v1.worker import dp_utils

    def _run_ar(should_ubatch, num_tokens, cudagraph_mode, parallel_config):
        raise AssertionError("never called")

    monkeypatch.setattr(dp_utils, "_run_ar", _run_ar)
    with pytest.raises(GlueShapeError) as err:
        check_vllm_shapes()
    assert _one_line(err) == (
        "vLLM's vllm.v1.worker.dp_utils:_run_ar takes (should_ubatch, num_tokens, "
        "cudagraph_mode, parallel_config), but the backend, which replaces it, expects "
        "(should_ubatch, orig_num_tokens_per_ubatch, padded_num_tokens_per_ubatch, "
        "cudagraph_mode, parallel_config)")


def test_a_missing_private_method_the_planner_relies_on_is_named(monkeypatch):
    from vllm.v1.core.sched.scheduler import Scheduler

    monkeypatch.delattr(Scheduler, "_handle_invalid_blocks")
    with pytest.raises(GlueShapeError) as err:
        check_vllm_shapes()
    assert _one_line(err).startswith(
        "vLLM has no vllm.v1.core.sched.scheduler:Scheduler._handle_invalid_blocks (the backend "
        "relies on it: ")


def test_an_instance_attribute_is_found_in_the_source_and_a_missing_one_is_named(
        tmp_path, monkeypatch):
    from vllm_ainfer_pd.vllm_glue import Patch

    (tmp_path / "glue_probe.py").write_text(
        "class Base:\n    def __init__(self):\n        self.block_pool: object = None\n\n"
        "class Manager(Base):\n    def free(self, request):\n        self.freed = request\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    Patch("glue_probe:Manager", "test", uses=("block_pool", "freed", "free")).check()
    Patch("glue_probe:Manager.free", "test", ("self", "request"), uses=("request",)).check()
    with pytest.raises(GlueShapeError, match=r"^vLLM's glue_probe:Manager has no pool, blocks "
                                             r"\(the backend reads it: test\)$"):
        Patch("glue_probe:Manager", "test", uses=("pool", "blocks"), does="reads").check()


def test_validation_fails_with_the_line_naming_the_changed_symbol(tiny_model, monkeypatch):
    from vllm.config import ModelConfig, VllmConfig
    from vllm.v1.worker import dp_utils

    from vllm_ainfer_pd.executor import AInferPDExecutor

    config = VllmConfig(model_config=ModelConfig(model=tiny_model, skip_tokenizer_init=True,
                                                 dtype="float32", seed=0))
    assert AInferPDExecutor.validate(config).mode == "pd"
    monkeypatch.setattr(dp_utils, "_run_ar", lambda tensor, group: None)
    with pytest.raises(GlueShapeError, match=r"^vLLM's vllm.v1.worker.dp_utils:_run_ar takes "
                                             r"\(tensor, group\), but the backend"):
        AInferPDExecutor.validate(config)


def test_every_symbol_has_its_row_in_docs_vllm_glue_md():
    rows = [line for line in DOC.read_text().splitlines() if line.startswith("| `vllm.")]
    documented = {re.match(r"\| `([^`]+)`", row).group(1) for row in rows}
    targets = {patch.target for patch in all_patches()}
    assert targets - documented == set(), "not in docs/vllm-glue.md"
    assert documented - targets == set(), "in docs/vllm-glue.md but not in any PATCHES"


def test_the_shape_report_lists_every_symbol_and_names_each_difference(monkeypatch):
    """`python -m vllm_ainfer_pd.vllm_glue`: how far another vLLM release is, all at once (the
    symbols of the installed release's code paths: a symbol of another release's is not
    checked)."""
    from vllm.v1.worker import dp_utils

    from vllm_ainfer_pd.vllm_glue import installed_release, shape_report

    report = shape_report()
    release = installed_release()
    this_release = [p for p in all_patches() if p.applies(release=release)]
    other_release = [p for p in all_patches() if not p.applies(release=release)]
    assert len(report) == len(this_release) and all(problem is None for _, problem in report)
    assert other_release, "every symbol the same on every release the backend runs on"
    monkeypatch.setattr(dp_utils, "_run_ar", lambda tensor, group: None)
    problems = {patch.target: problem for patch, problem in shape_report() if problem}
    assert list(problems) == ["vllm.v1.worker.dp_utils:_run_ar"]
    assert problems["vllm.v1.worker.dp_utils:_run_ar"].startswith(
        "vLLM's vllm.v1.worker.dp_utils:_run_ar takes (tensor, group), but the backend")


def test_a_symbol_of_one_vllm_release_is_checked_on_that_release_only(monkeypatch):
    """A `Patch` with a `vllm` range applies to the releases in it; the start-up check of another
    release passes over it, so a symbol that a later vLLM dropped stops neither release."""
    import vllm_ainfer_pd.vllm_glue as glue

    gone = glue.Patch("vllm.v1.worker.block_table:BlockTable", "dropped in a later release",
                      uses=("no_such_field",), vllm="<0.26")
    assert gone.applies(release="0.25.1") and not gone.applies(release="0.26.0")
    assert glue.Patch("m:a", "w", vllm=">=0.32").applies(release="0.32.1.dev3")
    with pytest.raises(GlueShapeError, match="has no no_such_field"):
        gone.check()
    patches = all_patches() + [gone]
    monkeypatch.setattr(glue, "all_patches", lambda: patches)
    check_vllm_shapes(glue.installed_release())  # passes over `gone`
    monkeypatch.setattr(glue, "all_patches", lambda: [gone])
    with pytest.raises(GlueShapeError, match="no_such_field"):
        check_vllm_shapes("0.25.0")


def test_the_attention_wrapper_calls_the_p_threads_callbacks_around_attention_only_there():
    import threading

    from vllm_ainfer_pd.vllm_glue import attention

    calls: list[str] = []
    wrapped = attention._stop_before(lambda x: calls.append(f"attention {x}") or x, boundary=3)
    assert attention._stop_before(wrapped, boundary=3) is wrapped  # wrapped once per layer

    def p_thread() -> None:
        attention.stop_calling_thread_at(lambda b: calls.append(f"reach {b}"),
                                         lambda: calls.append("after"))
        try:
            assert wrapped(7) == 7
        finally:
            attention.stop_calling_thread_at(None)

    t = threading.Thread(target=p_thread)
    t.start()
    t.join()
    assert calls == ["reach 3", "attention 7", "after"]
    calls.clear()
    assert wrapped(8) == 8  # another thread (D's): the attention call alone
    assert calls == ["attention 8"]
