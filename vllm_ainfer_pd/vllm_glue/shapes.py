"""The shape a patch assumes of a vLLM symbol, and the start-up check of it."""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass


class GlueShapeError(RuntimeError):
    """The installed vLLM differs from what one of the backend's patches assumes."""


@dataclass(frozen=True)
class Patch:
    """One patched vLLM symbol: `target` is "module:attr.path"; `params` the parameter names the
    patch relies on, in order (None: not a function, only its presence matters); `why` is the
    reason, listed in docs/vllm-glue.md."""

    target: str
    why: str
    params: tuple[str, ...] | None = None

    def resolve(self) -> object:
        module_name, _, path = self.target.partition(":")
        obj: object = importlib.import_module(module_name)
        for part in path.split("."):
            if not hasattr(obj, part):
                raise GlueShapeError(f"vLLM has no {self.target} (the backend patches it: "
                                     f"{self.why})")
            obj = getattr(obj, part)
        return obj

    def check(self) -> None:
        obj = self.resolve()
        if self.params is None:
            return
        # A patched function keeps the original's signature through functools.wraps.
        found = tuple(inspect.signature(obj).parameters)
        if found != self.params:
            raise GlueShapeError(f"vLLM's {self.target} takes ({', '.join(found)}), but the "
                                 f"backend's patch of it expects ({', '.join(self.params)})")


def check_patches(patches: list[Patch]) -> None:
    for patch in patches:
        patch.check()
