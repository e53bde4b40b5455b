"""Test harness shared by tests/ and benchmarks/: the parity rule, the abort storm, pause and resume
in flight, worker extensions (weight update, router probe, faults), and the turnstile's
diagnostics (the crossed cycle, the rank-skew stress and the rank launcher they share). It lives
beside the package, not in it: the wheel does not install it. Run it from a checkout (pytest.ini
puts the checkout on `sys.path`; the benchmark scripts do it themselves).

Worker extensions are imported by qualified name in processes the harness does not start itself:
vLLM's spawned engine and worker processes and `vllm serve` subprocesses. Importing the harness
puts the checkout on PYTHONPATH, which every process started afterwards inherits.
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _export_root() -> None:
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if str(ROOT) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, paths)])


_export_root()
