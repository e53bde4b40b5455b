"""A worker extension for the RL loop's weight sync: `LLM(..., worker_extension_cls=EXTENSION)`,
then `llm.collective_rpc("perturb_weights", args=(seed,))` between rollouts, as an RL trainer
pushes new weights into the rollout engine.

The update is deterministic and a function of each weight's value alone (no random stream over a
tensor's elements), so engines in any layout (TP shards, EP's local experts, kernel packings of
the same values) that get the same call hold the same weights afterwards as a stock TP=1 engine.
"""

from __future__ import annotations

import torch

EXTENSION = "ainfer_pd_testing.weight_update.WeightUpdate"


class WeightUpdate:
    """Mixed into the engine's worker class by vLLM (`worker_extension_cls`)."""

    def perturb_weights(self, seed: int, scale: float = 0.05) -> float:
        """Add `scale * sin((997 + seed) * w)` to every weight `w`, in place; returns the sum of
        this rank's new weights (a checksum the caller can compare across engines of one
        layout)."""
        model = self.model_runner.model  # `self` is the worker this class is mixed into
        total = 0.0
        with torch.no_grad():
            for _, param in sorted(model.named_parameters()):
                noise = torch.sin(param.float() * (997.0 + seed))
                param.add_((scale * noise).to(param.dtype))
                total += float(param.float().sum())
        return total
