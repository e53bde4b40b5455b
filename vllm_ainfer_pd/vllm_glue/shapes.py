"""The shape a patch assumes of a vLLM symbol, and the start-up check of it."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import re
from dataclasses import dataclass

from packaging.specifiers import SpecifierSet
from packaging.version import Version


class GlueShapeError(RuntimeError):
    """The installed vLLM differs from what one of the backend's patches assumes."""


@dataclass(frozen=True)
class Patch:
    """One vLLM symbol the backend patches or relies on (one row of docs/vllm-glue.md).

    `target` is "module:attr.path"; `why` the reason. `params` are the parameter names the code
    relies on, in order (a function it wraps, replaces or calls positionally; None: not checked,
    only the symbol's presence matters). `uses` are further names the code relies on: for a
    class, attributes of its instances (class attributes, dataclass fields, or assigned as
    `self.<name>` in the class or a base); for a function, parameters it passes by keyword.
    `does` says what the backend does with the symbol. `platform` ("cpu" or "cuda") limits the
    check to the platform whose code path uses the symbol; `vllm` (a version specifier, "<0.32"
    or ">=0.32") to the vLLM releases whose code path uses it."""

    target: str
    why: str
    params: tuple[str, ...] | None = None
    uses: tuple[str, ...] = ()
    does: str = "relies on"
    platform: str | None = None
    vllm: str = ""

    def applies(self, platform: str | None = None, release: str | None = None) -> bool:
        """Whether the code path that uses the symbol runs on `platform` with vLLM `release`
        (None: any)."""
        if platform is not None and self.platform is not None and self.platform != platform:
            return False
        return release is None or not self.vllm or _release(release) in SpecifierSet(self.vllm)

    def resolve(self) -> object:
        module_name, _, path = self.target.partition(":")
        try:
            obj: object = importlib.import_module(module_name)
        except ImportError as exc:
            raise GlueShapeError(f"vLLM has no module {module_name} (the backend {self.does} "
                                 f"{self.target}: {self.why})") from exc
        for part in path.split("."):
            if not hasattr(obj, part):
                raise GlueShapeError(f"vLLM has no {self.target} (the backend {self.does} it: "
                                     f"{self.why})")
            obj = getattr(obj, part)
        return obj

    def check(self) -> None:
        obj = self.resolve()
        if self.params is not None:
            # A wrapped function keeps the original's signature through functools.wraps.
            found = tuple(inspect.signature(obj).parameters)
            if found != self.params:
                raise GlueShapeError(f"vLLM's {self.target} takes ({', '.join(found)}), but the "
                                     f"backend, which {self.does} it, expects "
                                     f"({', '.join(self.params)})")
        missing = [name for name in self.uses if not _has(obj, name)]
        if missing:
            raise GlueShapeError(f"vLLM's {self.target} has no {', '.join(missing)} (the backend "
                                 f"{self.does} it: {self.why})")


def _has(obj: object, name: str) -> bool:
    """Whether a class's instances have `name`, or a function takes a parameter `name`."""
    if not inspect.isclass(obj):
        return name in inspect.signature(obj).parameters
    if hasattr(obj, name):
        return True
    if dataclasses.is_dataclass(obj) and name in {f.name for f in dataclasses.fields(obj)}:
        return True
    # An instance attribute: assigned in a method of the class or of a base (read from vLLM's
    # source, which its wheels ship; without the source the attribute is not checked).
    # A target of a tuple assignment counts too: `(self.a, self.b) = ...` over several lines.
    assigned = re.compile(rf"\bself\.{re.escape(name)}\b\s*(:[^=\n]*)?=[^=]"
                          rf"|\bself\.{re.escape(name)}\s*,[\w\s.,]*\)?\s*=[^=]")
    for klass in obj.__mro__:
        source = _source(klass)
        if source is None and klass.__module__.startswith("vllm"):
            return True
        if source is not None and assigned.search(source):
            return True
    return False


@functools.cache
def _source(klass: type) -> str | None:
    # Cached: finding a class's source parses its whole module (vLLM's model runner is 7k lines).
    try:
        return inspect.getsource(klass)
    except (OSError, TypeError):
        return None


def check_patches(patches: list[Patch], platform: str | None = None,
                  release: str | None = None) -> None:
    """Check each patch that applies on `platform` ("cpu", "cuda") with vLLM `release` (None:
    any)."""
    for patch in patches:
        if patch.applies(platform, release):
            patch.check()


def installed_release() -> str:
    """The installed vLLM's release, without a local build tag ("0.32.0" for "0.32.0+cpu")."""
    import vllm

    return vllm.__version__.split("+")[0]


@functools.cache
def vllm_at_least(release: str) -> bool:
    """Whether the installed vLLM is `release` or later: the one test the code paths that differ
    between vLLM releases branch on (each such symbol a `Patch` with its `vllm` range). Cached:
    P's batch builder asks on every batch, and the installed vLLM does not change."""
    return _release(installed_release()) >= Version(release)


def _release(release: str) -> Version:
    # A development build of a release counts as that release (0.32.1.dev3 as 0.32.1).
    return Version(Version(release).base_version)
