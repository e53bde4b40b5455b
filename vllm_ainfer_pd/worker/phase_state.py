"""vLLM's process-wide model state, made per thread for the P thread.

vLLM keeps the forward context (attention metadata, CUDA-graph mode, DP sizes of the running
forward) and the workspace manager (the fused-MoE kernels' scratch and output buffers) in module
globals. P's forward runs on its own thread, beside D's step, so it must see its own of both:
- P's forward context is P's batch, not D's;
- P's MoE must not write D's workspace: D's CUDA graphs captured those bytes, and P's kernels on
  P's stream would write them while D's replay reads them.

~140 vLLM modules imported `get_forward_context` (and `current_workspace_manager`) by value, so
patching the module attributes would miss them. Instead the code objects of the four functions
that read or write the globals are replaced, once per process, by versions that first look at
this thread's P state (`_ainfer_pd_p`, injected into the two modules). Threads that never called
`enter_p` (D's, vLLM's own) see the globals exactly as before.
"""

from __future__ import annotations

import threading
from typing import Any

import vllm.forward_context as forward_context
import vllm.v1.worker.workspace as workspace

_P = threading.local()  # on a P thread inside `enter_p`: .active, .forward_context, .workspace


def enter_p(p_workspace: Any) -> None:
    """From here on, the calling thread has its own forward context (None until P's
    `set_forward_context`) and workspace manager (`p_workspace`). Needs `install()` first."""
    _P.forward_context = None
    _P.workspace = p_workspace
    _P.active = True


def leave_p() -> None:
    _P.active = False
    _P.forward_context = None
    _P.workspace = None


# ---- replacement code objects (run with the vLLM module's globals) -----------------------------
# Global names below resolve in vLLM's modules: `_forward_context`, `_manager` are theirs,
# `_ainfer_pd_p` is `_P`, injected by `install`.


def _get_forward_context():  # vllm.forward_context.get_forward_context
    if getattr(_ainfer_pd_p, "active", False):  # noqa: F821
        context = _ainfer_pd_p.forward_context  # noqa: F821
    else:
        context = _forward_context  # noqa: F821
    assert context is not None, (
        "Forward context is not set. Please use `set_forward_context` to set the forward context."
    )
    return context


def _is_forward_context_available():  # vllm.forward_context.is_forward_context_available
    if getattr(_ainfer_pd_p, "active", False):  # noqa: F821
        return _ainfer_pd_p.forward_context is not None  # noqa: F821
    return _forward_context is not None  # noqa: F821


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


_installed = threading.Lock()


def install() -> None:
    """Swap the code objects in (idempotent)."""
    with _installed:
        if getattr(forward_context, "_ainfer_pd_p", None) is _P:
            return
        forward_context._ainfer_pd_p = _P
        workspace._ainfer_pd_p = _P
        forward_context.get_forward_context.__code__ = _get_forward_context.__code__
        forward_context.is_forward_context_available.__code__ = (
            _is_forward_context_available.__code__)
        forward_context.override_forward_context.__wrapped__.__code__ = (
            _override_forward_context.__code__)
        workspace.current_workspace_manager.__code__ = _current_workspace_manager.__code__
