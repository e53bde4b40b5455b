"""What the package's modules import, read from the source with `ast`, without importing anything.

Every `import` and `from ... import` counts, at module level, inside functions and under
`TYPE_CHECKING` alike (a lazy or type-only import still ties the two modules together for a
reader). Importing a submodule is not counted as importing its package's `__init__`. The rules:
the package's modules import each other without a circle; the protocol (`turnstile/`) imports
neither vLLM, nor the rest of the plugin, nor anything outside the package; no shipped module
imports what the wheel does not install (the harness, the benchmarks and the scale model beside
them, the tests), and the package holds no simulator.
"""

from __future__ import annotations

import ast
from pathlib import Path

import vllm_ainfer_pd

PACKAGE = Path(vllm_ainfer_pd.__file__).resolve().parent


def modules(root: Path = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (a package is its __init__)."""
    found = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imported_names(module: str, path: Path) -> set[str]:
    """Every dotted name module `module` (its source at `path`) imports, relative ones resolved:
    `import a.b` gives "a.b", `from a import b` gives "a.b"."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1 packages
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package's modules it imports."""
    mods = modules(root)

    def owner(name: str) -> str | None:  # the module a dotted name lives in
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for module, path in mods.items():
        for name in imported_names(module, path):
            target = owner(name)
            if target is not None and target != module:
                graph[module].add(target)
    return graph


def within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def forbidden_imports(root: Path, scope: str, forbidden: tuple[str, ...],
                      allowed: tuple[str, ...] = ()) -> list[str]:
    """"module imports name" for each import by a module in `scope` of a name within one of
    `forbidden` and within none of `allowed`."""
    found = []
    for module, path in sorted(modules(root).items()):
        if not within(module, scope):
            continue
        for name in sorted(imported_names(module, path)):
            if any(within(name, f) for f in forbidden) and \
                    not any(within(name, a) for a in allowed):
                found.append(f"{module} imports {name}")
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as a path that ends where it starts, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)) is not None:
            return cycle
    return None


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert "vllm_ainfer_pd.wire" in graph["vllm_ainfer_pd.connector"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_check_finds_a_cycle(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from .. import a\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    graph = import_graph(pkg)
    assert graph["pkg.a"] == {"pkg.sub.b"} and graph["pkg.sub.b"] == {"pkg.a"}
    assert find_cycle(graph) == ["pkg.a", "pkg.sub.b", "pkg.a"]
    (pkg / "sub" / "b.py").write_text("from typing import TYPE_CHECKING\n")
    assert find_cycle(import_graph(pkg)) is None


# What the wheel does not install (setup.py packages only vllm_ainfer_pd): the harness, the
# benchmark scripts and the scale model among them, the tests.
CHECKOUT_ONLY = ("ainfer_pd_testing", "benchmarks", "tests")
PROTOCOL = "vllm_ainfer_pd.turnstile"


def test_the_protocol_imports_neither_vllm_nor_the_plugin_nor_the_harness():
    bad = forbidden_imports(PACKAGE, PROTOCOL, ("vllm", "vllm_ainfer_pd", *CHECKOUT_ONLY),
                            allowed=(PROTOCOL,))
    assert bad == [], "the protocol package must stay free of these: " + "; ".join(bad)


def test_no_shipped_module_imports_what_the_wheel_does_not_install():
    bad = forbidden_imports(PACKAGE, "vllm_ainfer_pd", CHECKOUT_ONLY)
    assert bad == [], "; ".join(bad)


def test_the_shipped_package_holds_no_simulator():
    from setuptools import find_packages

    shipped = find_packages(str(PACKAGE.parent), include=["vllm_ainfer_pd", "vllm_ainfer_pd.*"])
    assert "vllm_ainfer_pd.rollout" in shipped
    simulator = [m for m in modules() if m.rpartition(".")[2] in ("scale", "sim", "simulate")]
    assert simulator == [], f"the scale model belongs beside the benchmarks: {simulator}"
    assert not any(p.endswith(".scale") for p in shipped), shipped
    assert (PACKAGE.parent / "benchmarks" / "scale" / "sim.py").is_file()


def test_the_checks_find_forbidden_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "proto").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "glue.py").write_text("")
    (pkg / "proto" / "__init__.py").write_text("from . import core\n")
    (pkg / "proto" / "core.py").write_text(
        "def f():\n    import vllm.config\n    from ..glue import x\n"
        "    from ainfer_pd_testing.launch import RankGroup\n    from pkg.proto import core\n")
    bad = forbidden_imports(pkg, "pkg.proto", ("vllm", "pkg", *CHECKOUT_ONLY),
                            allowed=("pkg.proto",))
    assert bad == ["pkg.proto.core imports ainfer_pd_testing.launch.RankGroup",
                   "pkg.proto.core imports pkg.glue.x", "pkg.proto.core imports vllm.config"]
