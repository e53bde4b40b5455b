"""The P thread's own phase state: vLLM's forward context and workspace manager, per thread.

P's forward runs on its own thread, beside D's step, so it must see its own of both:
- P's forward context is P's batch, not D's;
- P's MoE must not write D's workspace: D's CUDA graphs captured those bytes, and P's kernels on
  P's stream would write them while D's replay reads them.

vLLM keeps both in module globals; `vllm_glue/forward_context.py` makes the functions that read
them consult `_P` (this module's thread-local) first. Threads that never called `enter_p` (D's,
vLLM's own) see vLLM's globals exactly as before.
"""

from __future__ import annotations

import threading
from typing import Any

from vllm_ainfer_pd.vllm_glue import forward_context

_P = threading.local()  # on a P thread inside `enter_p`: .active, .forward_context, .workspace


def install() -> None:
    """Make vLLM's forward-context and workspace functions per thread (idempotent)."""
    forward_context.install(_P)


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
