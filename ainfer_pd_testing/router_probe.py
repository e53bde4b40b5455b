"""How close an MoE router is to choosing other experts, per token: a worker extension
(`LLM(..., worker_extension_cls="ainfer_pd_testing.router_probe.RouterProbe")`) for telling
a near-tie upstream from a real divergence.

The parity harness accepts a differing token only where stock's own output logprobs show a tie.
An MoE layer can hide a tie the output does not show: where a token's k-th and (k+1)-th router
logits are nearly equal, a rounding difference (another batch shape, another kernel) picks
another expert, and the output logits move by far more than rounding. This records, for every
token of a forward and every MoE layer, that margin (k-th largest router logit minus the
(k+1)-th). Run the engine with `enforce_eager=True`: module hooks do not fire inside compiled
graphs.
"""

from __future__ import annotations

import torch

from ainfer_pd_testing.weight_update import WeightUpdate

EXTENSION = "ainfer_pd_testing.router_probe.RouterProbe"


class RouterProbe(WeightUpdate):
    """Mixed into the engine's worker class by vLLM; the weight update stays available."""

    def start_router_margins(self) -> int:
        """Hook every MoE router (a `gate` module beside an `experts` module); returns how many."""
        self._router_rows: list[list[torch.Tensor]] = []
        self._router_hooks = []
        runner = self.model_runner  # `self` is the worker this class is mixed into
        top_k = runner.model_config.hf_config.num_experts_per_tok
        for module in runner.model.modules():
            gate = getattr(module, "gate", None)
            if gate is None or getattr(module, "experts", None) is None:
                continue
            layer = len(self._router_rows)
            self._router_rows.append([])
            self._router_hooks.append(gate.register_forward_hook(
                lambda _m, _in, out, layer=layer, k=top_k: self._router_rows[layer].append(
                    _margin(out[0] if isinstance(out, tuple) else out, k))))
        return len(self._router_hooks)

    def stop_router_margins(self) -> list[list[float]]:
        """Remove the hooks; per MoE layer, the margin of every token routed since the start, in
        the order the forwards ran them."""
        for hook in self._router_hooks:
            hook.remove()
        rows = [torch.cat(r).tolist() if r else [] for r in self._router_rows]
        self._router_hooks, self._router_rows = [], []
        return rows


def prefill_router_margins(llm, tokens: list[int]) -> list[list[float]]:
    """Driver side, on a `vllm.LLM` with this extension: one fresh prefill of `tokens` (the prefix
    cache reset first, so every position is computed) with the routers hooked; rank 0's margins
    per MoE layer, in position order (the prefill's rows come first)."""
    from vllm import SamplingParams, TokensPrompt

    if not llm.reset_prefix_cache():
        raise RuntimeError("cannot reset the prefix cache: requests are still running")
    llm.collective_rpc("start_router_margins")
    llm.generate([TokensPrompt(prompt_token_ids=tokens)],
                 SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    return llm.collective_rpc("stop_router_margins")[0]


def _margin(router_logits: torch.Tensor, k: int) -> torch.Tensor:
    top = torch.topk(router_logits.float(), k + 1, dim=-1).values
    return (top[:, k - 1] - top[:, k]).cpu()
