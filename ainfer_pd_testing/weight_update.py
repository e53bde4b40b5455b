"""A worker extension for the RL loop's weight sync: `LLM(..., worker_extension_cls=EXTENSION)`,
then `llm.collective_rpc("perturb_weights", args=(seed,))` between rollouts, as an RL trainer
pushes new weights into the rollout engine.

The new weights are the checkpoint one stand-in training step on (`trained(checkpoint, seed)`),
loaded through vLLM's own weight reload (`reload_weights`: `model.load_weights` with the
layerwise reload around it, as vLLM's weight-transfer API loads them). Editing the parameters in
place is not an update every kernel sees: on CPUs with oneDNN or AMX, vLLM packs linear and MoE
weights into copies at load time, so an in-place edit changes `named_parameters()` and not what
the kernels multiply by. Through the reload, engines in any layout (TP shards, EP's local
experts, kernel packings) hold the same weights afterwards as a stock TP=1 engine given the same
call, or given `trained(checkpoint, seed)` through a weight transfer.

A model without a checkpoint (`--load-format dummy`) has nothing to reload from; its weights are
edited in place, the same function of each value (`w + scale * sin((997 + seed) * w)`), which
the GPU's unquantized kernels read directly.
"""

from __future__ import annotations

from pathlib import Path

import torch

EXTENSION = "ainfer_pd_testing.weight_update.WeightUpdate"

Weights = list[tuple[str, torch.Tensor]]
CHECKPOINT = "model.safetensors"


def checkpoint(model_dir: str | Path) -> Weights:
    """The model's weights as its checkpoint holds them (names, dtype), in name order."""
    from safetensors.torch import load_file

    return sorted(load_file(str(Path(model_dir) / CHECKPOINT)).items())


def step(t: torch.Tensor, seed: int, scale: float) -> torch.Tensor:
    """`t + scale * sin((997 + seed) * t)`, computed in float32, in `t`'s dtype."""
    return (t.float() + scale * torch.sin(t.float() * (997.0 + seed))).to(t.dtype)


def trained(weights: Weights, seed: int, scale: float = 0.05) -> Weights:
    """A stand-in for a training step, in the checkpoint's format."""
    return [(name, step(t, seed, scale)) for name, t in weights]


class WeightUpdate:
    """Mixed into the engine's worker class by vLLM (`worker_extension_cls`)."""

    def perturb_weights(self, seed: int, scale: float = 0.05) -> float:
        """Load `trained(checkpoint, seed)` (see the module's docstring); returns the sum of the
        new weights as the checkpoint holds them, or, without a checkpoint, of this rank's
        parameters after the in-place edit."""
        model_dir = Path(self.model_config.model)  # `self` is the worker this is mixed into
        if (model_dir / CHECKPOINT).exists():
            new = trained(checkpoint(model_dir), seed, scale)
            self.model_runner.reload_weights(weights_iterator=iter(new),
                                             is_checkpoint_format=True)
            return sum(float(t.float().sum()) for _, t in new)
        total = 0.0
        with torch.no_grad():
            for _, param in sorted(self.model_runner.model.named_parameters()):
                param.copy_(step(param, seed, scale))
                total += float(param.float().sum())
        return total
