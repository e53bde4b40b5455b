"""The overlay's patches, applied in every process of a vLLM suite run right after the module they
patch is imported (an import hook: nothing of vLLM is imported before the process asks for it).

- `vllm.engine.arg_utils`: `EngineArgs.__post_init__` applies `engine_settings` before vLLM's
  own, so every engine a test builds (`VllmRunner`, `LLM(...)`, `AsyncEngineArgs`, `vllm serve`)
  gets them; the settings are logged, one line per engine-args object.
- `vllm.v1.core.sched.scheduler`: each step that schedules tokens is logged, so the report
  tells the tests that made an engine compute from those that pass without one.
- `vllm_ainfer_pd.connector` (the `ours` run): each P-lane job is logged, so the report shows the
  lane took the tests' prompts; with `AINFER_PD_VLLM_SUITE_BREAK=drop-token` each job's prompt
  loses its first token (every token shifts one position left; the last is repeated), the
  negative control.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.abc
import json
import os
import sys
from collections.abc import Callable
from typing import Any

from ainfer_pd_testing.vllm_suite import BREAK_ENV, BREAKS, LOG_ENV, MODE_ENV, MODES

BACKEND = "ainfer_pd"
# The same backend by class path, the form vLLM resolves with no plugin loaded.
BACKEND_CLASS = "vllm_ainfer_pd.executor.AInferPDExecutor"
# The lane takes every prompt of at least this many uncached tokens: vLLM's test prompts are short
# (a handful to a few dozen tokens with the tiny model's 512-token vocabulary).
P_LANE_MIN_TOKENS = 4
# Backends a test may name that `ainfer_pd` stands in for (one process or vLLM's multiprocessing
# executor); anything else (ray, external_launcher, a class) is left as the test asked.
REPLACED_BACKENDS = (None, "mp", "uni")


def mode() -> str:
    value = os.environ.get(MODE_ENV, "")
    if value not in MODES:
        raise RuntimeError(f"{MODE_ENV}={value!r} is not one of {', '.join(MODES)}")
    return value


def broken() -> str | None:
    value = os.environ.get(BREAK_ENV) or None
    if value is not None and value not in BREAKS:
        raise RuntimeError(f"{BREAK_ENV}={value!r} is not one of {', '.join(BREAKS)}")
    return value


def log(kind: str, detail: str = "") -> None:
    """One line in the run's event log (appends are atomic for lines this short)."""
    folder = os.environ.get(LOG_ENV)
    if not folder:
        return
    line = f"{kind} {os.getpid()} {detail}".rstrip() + "\n"
    fd = os.open(os.path.join(folder, "events.log"), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def engine_settings(args: Any, run: str) -> None:
    """What both runs change, then what `ours` adds, on one `EngineArgs` before vLLM reads it."""
    # CPU: no torch.compile (vLLM's tests ask for CUDA graphs, which the CPU has not; compiling
    # the tiny model took most of each engine's start). TORCHDYNAMO_DISABLE=1 is set as well.
    args.enforce_eager = True
    if run != "ours":
        return
    if args.distributed_executor_backend in REPLACED_BACKENDS:
        args.distributed_executor_backend = backend_for_this_process()
    extra = args.additional_config
    if isinstance(extra, str):
        extra = json.loads(extra)
    extra = dict(extra or {})
    extra[BACKEND] = {"p_lane_min_tokens": P_LANE_MIN_TOKENS, **extra.get(BACKEND, {})}
    args.additional_config = extra


def backend_for_this_process() -> str:
    """The backend's name, as users give it, where vLLM has loaded the plugin that registers the
    name in this process; its class path where it has not, as a user without plugins would give
    it. Some of vLLM's tests hide the plugins: they replace `importlib.metadata.entry_points` with
    a fake serving only their own group, in the process or in one it forks, and vLLM loads
    plugins once per process."""
    from vllm.plugins import load_general_plugins

    from vllm_ainfer_pd.vllm_glue import executor_class

    load_general_plugins()  # what EngineArgs.__post_init__ does next; once per process
    return BACKEND if executor_class.installed() else BACKEND_CLASS


def _patch_engine_args(module: Any) -> None:
    cls = module.EngineArgs
    original = cls.__post_init__
    run = mode()

    @functools.wraps(original)
    def __post_init__(self) -> None:
        engine_settings(self, run)
        log("engine", f"{run} backend={self.distributed_executor_backend} model={self.model}")
        original(self)

    cls.__post_init__ = __post_init__


def _patch_connector(module: Any) -> None:
    real = module.PJob
    damage = broken()

    def counted_job(*args: Any, **fields: Any) -> Any:
        job = real(*args, **fields)
        if damage == "drop-token" and len(job.token_ids) > 1:
            ids = job.token_ids
            job = dataclasses.replace(job, token_ids=ids[1:] + ids[-1:])
        log("pjob", f"{len(job.token_ids)}")
        return job

    module.PJob = counted_job


def _patch_scheduler(module: Any) -> None:
    """A `step` line per scheduled step with tokens: which tests made an engine compute (both
    runs; `ainfer_pd`'s schedulers subclass this one and call it)."""
    cls = module.Scheduler
    original = cls.schedule

    # `wraps`: the backend checks the signature of the vLLM methods it overrides.
    @functools.wraps(original)
    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        if out.total_num_scheduled_tokens:
            log("step", str(out.total_num_scheduled_tokens))
        return out

    cls.schedule = schedule


PATCHES: dict[str, Callable[[Any], None]] = {
    "vllm.engine.arg_utils": _patch_engine_args,
    "vllm.v1.core.sched.scheduler": _patch_scheduler,
    "vllm_ainfer_pd.connector": _patch_connector,
}


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader: Any, patch: Callable[[Any], None]) -> None:
        self.loader, self.patch = loader, patch

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        self.patch(module)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds the patched modules through the other finders and wraps their loaders."""

    def find_spec(self, name, path, target=None):
        patch = PATCHES.get(name)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                spec.loader = _PatchingLoader(spec.loader, patch)
                return spec
        return None


def install() -> None:
    mode()  # a bad value fails in every process at once
    broken()
    if any(name in sys.modules for name in PATCHES):
        raise RuntimeError(f"install() must run before {', '.join(PATCHES)} is imported")
    if not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())
