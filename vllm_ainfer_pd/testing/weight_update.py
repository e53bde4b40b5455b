"""A worker extension for the RL loop's weight sync: `LLM(..., worker_extension_cls=
"vllm_ainfer_pd.testing.weight_update.WeightUpdate")`, then `llm.collective_rpc("perturb_weights",
args=(seed,))` between rollouts, as an RL trainer pushes new weights into the rollout engine.

The update is deterministic (a seeded perturbation of every parameter, in place), so a stock
engine and an ainfer_pd engine that get the same call hold the same weights afterwards.
"""

from __future__ import annotations

import torch


class WeightUpdate:
    """Mixed into the engine's worker class by vLLM (`worker_extension_cls`)."""

    def perturb_weights(self, seed: int, scale: float = 0.05) -> float:
        """Add `scale * N(0, 1)` noise (seeded per parameter) to every parameter; returns the sum
        of the new weights (a checksum the caller can compare across engines)."""
        model = self.model_runner.model  # `self` is the worker this class is mixed into
        total = 0.0
        with torch.no_grad():
            for index, (_, param) in enumerate(sorted(model.named_parameters())):
                gen = torch.Generator().manual_seed(seed * 100_003 + index)
                noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
                param.add_((scale * noise).to(param.device, param.dtype))
                total += float(param.float().sum())
        return total
