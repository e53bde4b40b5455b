"""vLLM's forward context and workspace manager, consulted per thread (the P thread's own).

vLLM keeps the forward context (attention metadata, CUDA-graph mode, DP sizes of the running
forward) and the workspace manager (the fused-MoE kernels' scratch and output buffers) in module
globals. ~140 vLLM modules imported `get_forward_context` (and `current_workspace_manager`) by
value, so replacing the module attributes would miss them. Instead `install(state)` replaces the
code objects of the four functions that read or write the globals, once per process, by versions
that first look at `state`, a thread-local the caller owns (`worker/phase_state.py`): on a thread
whose `state.active` is true they use `state.forward_context` and `state.workspace`; every other
thread (D's, vLLM's own) sees the globals exactly as before.
"""

from __future__ import annotations

import threading
from typing import Any

from vllm_ainfer_pd.vllm_glue.shapes import Patch

_WHY = "the P thread, beside D's step, needs its own forward context and workspace"
PATCHES = [
    Patch("vllm.forward_context:get_forward_context", _WHY, (), does="replaces the code of"),
    Patch("vllm.forward_context:is_forward_context_available", _WHY, (),
          does="replaces the code of"),
    Patch("vllm.forward_context:override_forward_context.__wrapped__",
          _WHY + " (the generator under the context manager)", ("forward_context",),
          does="replaces the code of"),
    Patch("vllm.forward_context:_forward_context", "the global the replaced code reads for D",
          does="reads"),
    Patch("vllm.forward_context:set_forward_context", "P's forward sets its own context: P's "
          "batch, explicit DP token counts (no hidden DP sync), no CUDA graphs",
          uses=("attn_metadata", "vllm_config", "num_tokens", "num_tokens_across_dp",
                "cudagraph_runtime_mode", "slot_mapping"), does="calls"),
    Patch("vllm.v1.worker.workspace:current_workspace_manager", "P's MoE must not write the "
          "workspace D's CUDA graphs captured", (), does="replaces the code of"),
    Patch("vllm.v1.worker.workspace:_manager", "the global the replaced code reads for D",
          does="reads"),
    Patch("vllm.v1.worker.workspace:WorkspaceManager", "P's own workspace manager (and the "
          "bytes it holds, `ainfer_pd_status`)", uses=("_current_workspaces",), does="builds"),
    Patch("vllm.v1.worker.workspace:is_workspace_manager_initialized", "P gets a workspace "
          "manager only where vLLM uses one (not on CPU)", (), does="calls"),
]


# ---- replacement code objects (run with the vLLM module's globals) -----------------------------
# Global names below resolve in vLLM's modules: `_forward_context`, `_manager` are theirs,
# `_ainfer_pd_p` is the caller's thread-local, injected by `install`.


def _get_forward_context():  # vllm.forward_context.get_forward_context
    if getattr(_ainfer_pd_p, "active", False):  # noqa: F821
        context = _ainfer_pd_p.forward_context  # noqa: F821
    else:
        context = _forward_context
    assert context is not None, (
        "Forward context is not set. Please use `set_forward_context` to set the forward context."
    )
    return context


def _is_forward_context_available():  # vllm.forward_context.is_forward_context_available
    if getattr(_ainfer_pd_p, "active", False):  # noqa: F821
        return _ainfer_pd_p.forward_context is not None  # noqa: F821
    return _forward_context is not None


def _override_forward_context(forward_context):  # its @contextmanager generator
    global _forward_context
    if getattr(_ainfer_pd_p, "active", False):  # noqa: F821
        prev_context = _ainfer_pd_p.forward_context  # noqa: F821
        _ainfer_pd_p.forward_context = forward_context  # noqa: F821
        try:
            yield
        finally:
            _ainfer_pd_p.forward_context = prev_context  # noqa: F821
        return
    prev_context = _forward_context
    _forward_context = forward_context
    try:
        yield
    finally:
        _forward_context = prev_context


def _current_workspace_manager():  # vllm.v1.worker.workspace.current_workspace_manager
    if getattr(_ainfer_pd_p, "active", False):  # noqa: F821
        manager = _ainfer_pd_p.workspace  # noqa: F821
    else:
        manager = _manager  # noqa: F821
    assert manager is not None, (
        "WorkspaceManager not initialized. Call init_workspace_manager() "
        "with a device before using workspace functions."
    )
    return manager


_installing = threading.Lock()


def install(state: threading.local) -> None:
    """Swap the code objects in, reading the per-thread state from `state` (idempotent for the
    same `state`)."""
    from vllm import forward_context
    from vllm.v1.worker import workspace

    with _installing:
        if getattr(forward_context, "_ainfer_pd_p", None) is state:
            return
        forward_context._ainfer_pd_p = state
        workspace._ainfer_pd_p = state
        forward_context.get_forward_context.__code__ = _get_forward_context.__code__
        forward_context.is_forward_context_available.__code__ = (
            _is_forward_context_available.__code__)
        forward_context.override_forward_context.__wrapped__.__code__ = (
            _override_forward_context.__code__)
        workspace.current_workspace_manager.__code__ = _current_workspace_manager.__code__


def workspace_bytes(manager: Any) -> int:
    """Bytes a vLLM workspace manager holds."""
    return sum(t.numel() * t.element_size() for t in manager._current_workspaces if t is not None)
