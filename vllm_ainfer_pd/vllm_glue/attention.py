"""P's boundaries: each decoder layer's attention call, where P's forward can stop.

vLLM runs the attention op outside its compiled pieces (the piecewise split points; an opaque
custom op otherwise), so P runs the same compiled code as a stock prefill and still stops
between layers, with no collective in flight. `install_boundaries` wraps the call that op makes
into each layer of the target model (the impl's `forward`; for MLA layers the layer's
`forward_impl`, since MLA's op calls the impl's `forward_mha` / `forward_mqa` and never its
`forward`): on a thread that called `stop_calling_thread_at(reach)`, layer i's attention first
calls `reach(i + 1)` (boundary 0 is the forward's entry, which the caller publishes), and
`after_attention()` once the attention call returns, where the caller asked for it; on any
other thread (D's) the wrapper costs one thread-local lookup.
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
from collections.abc import Callable
from typing import Any

from vllm_ainfer_pd.vllm_glue.shapes import Patch

logger = logging.getLogger(__name__)

_WHY = "P stops at each layer's attention call, outside vLLM's compiled pieces"
PATCHES = [
    Patch("vllm.v1.attention.backend:AttentionImpl.forward", _WHY, does="wraps (per layer)"),
    Patch("vllm.model_executor.layers.attention.mla_attention:MLAAttention.forward_impl",
          _WHY + " (MLA's op calls it, not the impl's `forward`)", does="wraps (per layer)"),
    Patch("vllm.model_executor.layers.attention_layer_base:AttentionLayerBase", "the attention "
          "layers of vLLM's forward context (those with an `impl`)", does="reads"),
    Patch("vllm.model_executor.models.utils:extract_layer_index", "a layer's index from its "
          "name, to number the boundaries", uses=("layer_name",), does="calls"),
    Patch("vllm.config:CompilationConfig", "where vLLM lists the attention layers by name "
          "(a speculative drafter's too)", uses=("static_forward_context",), does="reads"),
]

Reach = Callable[[int], None]
_STOP = threading.local()  # .hooks: the calling thread's (reach, after_attention), or None


def stop_calling_thread_at(reach: Reach | None,
                           after_attention: Callable[[], None] | None = None) -> None:
    """On the calling thread, call `reach(boundary)` before each layer's attention and
    `after_attention()` after it (None: not)."""
    _STOP.hooks = None if reach is None else (reach, after_attention)


def install_boundaries(model: Any, vllm_config: Any, log_drafter: bool = False) -> int:
    """Wrap the attention call of each decoder layer of `model` (idempotent per layer); return
    the number of boundaries (layers + 1). Raises TypeError unless the model has exactly one
    attention layer per decoder layer."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.model_executor.models.utils import extract_layer_index

    # vLLM's forward context also holds a speculative drafter's attention layers, which P
    # never runs: keep the target model's.
    target = {id(m) for m in model.modules()}
    by_layer: dict[int, list[Any]] = collections.defaultdict(list)
    drafter_layers = 0
    for name, module in vllm_config.compilation_config.static_forward_context.items():
        if not (isinstance(module, AttentionLayerBase) and hasattr(module, "impl")):
            continue
        if id(module) in target:
            by_layer[extract_layer_index(name)].append(module)
        else:
            drafter_layers += 1
    if drafter_layers and log_drafter:
        logger.warning(
            "P lane: P runs the target model only, so the speculative drafter (%d attention "
            "layers) sees none of a lane prompt's tokens before its last; its drafts for those "
            "requests may be accepted less often (outputs are unchanged)", drafter_layers)
    if (sorted(by_layer) != list(range(len(by_layer)))
            or any(len(m) != 1 for m in by_layer.values())):
        raise TypeError(
            f"the P lane stops at attention layers and needs exactly one per decoder layer; "
            f"{type(model).__name__} has { {i: len(m) for i, m in by_layer.items()} }"
        )
    for index, (module,) in by_layer.items():
        if isinstance(module, MLAAttention):
            module.forward_impl = _stop_before(module.forward_impl, index + 1)
        else:
            module.impl.forward = _stop_before(module.impl.forward, index + 1)
    return len(by_layer) + 1


def _stop_before(attention: Any, boundary: int) -> Any:
    if getattr(attention, "_ainfer_pd_boundary", None) == boundary:
        return attention  # wrapped already

    @functools.wraps(attention)
    def forward(*args: Any, **kwargs: Any) -> Any:
        hooks = getattr(_STOP, "hooks", None)
        if hooks is None:
            return attention(*args, **kwargs)
        reach, after = hooks
        reach(boundary)
        out = attention(*args, **kwargs)
        if after is not None:
            after()
        return out

    forward._ainfer_pd_boundary = boundary
    return forward
