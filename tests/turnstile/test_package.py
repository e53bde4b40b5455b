"""The protocol package stays free of vLLM when imported (tests/test_import_graph.py reads the same
rule from the source)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)


def test_turnstile_package_imports_no_vllm():
    code = ("import sys, importlib, pkgutil, vllm_ainfer_pd.turnstile as t\n"
            "for m in pkgutil.walk_packages(t.__path__, t.__name__ + '.'):\n"
            "    importlib.import_module(m.name)\n"
            "bad = sorted(n for n in sys.modules if n == 'vllm' or n.startswith('vllm.'))\n"
            "print(bad)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
