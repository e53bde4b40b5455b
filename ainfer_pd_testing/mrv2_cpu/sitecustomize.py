"""Model Runner V2 on the CPU through Triton's interpreter, for development and checks only.

vLLM's CPU build runs Model Runner V2 only where Triton has a CPU backend, which PyPI's Triton
lacks; the runner's kernels (input preparation, slot mappings, sampling) then have no other path.
With this folder first on PYTHONPATH and AINFER_PD_MRV2_CPU=1, every Python process (vLLM's engine
core and workers are spawned, so each imports this at start) runs those kernels in Triton's
interpreter (TRITON_INTERPRET=1, about 5 ms a launch on the CPU):

- a `cpu` entry in `triton.backends.backends`, whose driver reports itself inactive, is what
  vLLM's `triton_utils` looks for before it sets HAS_TRITON on the CPU build (inactive, so
  Triton's own driver choice never takes it);
- top-k/top-p sampling takes its PyTorch path: its Triton kernel calls a tensor method on a
  `tl.range` index, a plain int in the interpreter.

Nothing of the product imports this.
"""

import os

if os.environ.get("AINFER_PD_MRV2_CPU") == "1":
    import importlib.abc
    import importlib.util
    import sys

    os.environ.setdefault("TRITON_INTERPRET", "1")
    from triton.backends import Backend, backends

    class _InterpreterDriver:  # vLLM reads only `.driver.is_active`
        @staticmethod
        def is_active() -> bool:
            return False

    backends.setdefault("cpu", Backend(compiler=None, driver=_InterpreterDriver))

    _TOPK_TOPP = "vllm.v1.sample.ops.topk_topp_sampler"

    class _TopkToppOnTorch(importlib.abc.MetaPathFinder):
        """Imports the top-k/top-p module with HAS_TRITON off (read at call time there)."""

        def find_spec(self, name, path, target=None):
            if name != _TOPK_TOPP:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            exec_module = spec.loader.exec_module

            def exec_with_torch_path(module):
                exec_module(module)
                module.HAS_TRITON = False

            spec.loader.exec_module = exec_with_torch_path
            return spec

    sys.meta_path.insert(0, _TopkToppOnTorch())
