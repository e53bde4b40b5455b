"""Greedy parity between stock vLLM and the ainfer_pd backend, telling a tie from a bug.

The bar: with greedy sampling, our token ids equal stock's. Random-weight models have near-tied
logits, so where a sequence first differs the harness teacher-forces *stock* on *our* sequence
(prompt logprobs) and accepts our token at every position from there on only if its logprob is
within `TIE_EPSILON` of the best logprob stock computes at that position. Anything else fails.

TIE_EPSILON = 1e-3 nats: float32 reduction-order noise between layouts (TP, EP, prefill vs decode
kernels) is ~1e-5 here, and the median top-2 gap of the tiny models is ~5e-2, so a tie must be a
genuine near-tie, while a real divergence (a wrong token, a stale KV block, a wrong position) lands
far outside it.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

TIE_EPSILON = 1e-3

# For each sequence: per position, {token_id: logprob} with at least stock's best token and the
# sequence's own token (None where a position has no logprobs, i.e. the first token).
TeacherForce = Callable[[list[list[int]]], list[list[dict[int, float] | None]]]


@dataclass
class ParityReport:
    exact: int = 0
    tie: int = 0
    fail: int = 0
    details: list[str] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)  # indices of the prompts that failed

    def __str__(self) -> str:
        head = f"parity: exact={self.exact} tie={self.tie} fail={self.fail}"
        return "\n".join([head, *self.details])


def compare(prompts: Sequence[list[int]], stock: Sequence[list[int]], ours: Sequence[list[int]],
            teacher_force: TeacherForce, epsilon: float = TIE_EPSILON) -> ParityReport:
    """Judge `ours[i]` against `stock[i]` (outputs for `prompts[i]`); `teacher_force` runs stock."""
    if not len(prompts) == len(stock) == len(ours):
        raise ValueError(f"{len(prompts)} prompts, {len(stock)} stock and {len(ours)} our outputs")
    report = ParityReport()
    diverged = []
    for i, (s, o) in enumerate(zip(stock, ours)):
        if list(s) == list(o):
            report.exact += 1
        elif len(s) != len(o):
            report.fail += 1
            report.failed.append(i)
            report.details.append(f"#{i}: {len(o)} tokens, stock produced {len(s)}")
        else:
            diverged.append(i)
    if not diverged:
        return report
    forced = teacher_force([list(prompts[i]) + list(ours[i]) for i in diverged])
    for i, logprobs in zip(diverged, forced):
        first = next(t for t, (a, b) in enumerate(zip(stock[i], ours[i])) if a != b)
        verdict = _judge_suffix(prompts[i], ours[i], logprobs, first, epsilon)
        if verdict is None:
            report.tie += 1
            report.details.append(f"#{i}: tie at output {first} (within {epsilon} of stock's best)")
        else:
            report.fail += 1
            report.failed.append(i)
            report.details.append(f"#{i}: first differs at output {first}; {verdict}")
    return report


def stock_alone(runner, prompts: Sequence[list[int]], stock: Sequence[list[int]],
                ours: Sequence[list[int]], failed: Sequence[int], max_tokens: int) -> list[dict]:
    """A diagnosis of failures, not a verdict: each failed prompt once more on stock, alone in its
    batch. Stock giving our tokens there means its own output depends on its batch (a near-tie
    upstream of the output logits, such as an MoE router's top-k margin, which another batch's
    kernels resolve the other way), so the lane's different batches are enough to differ."""
    found = []
    for i in failed:
        alone = runner.generate([list(prompts[i])], max_tokens)[0]
        found.append({"prompt": i, "stock_alone_is_ours": alone == list(ours[i]),
                      "stock_alone_is_stock": alone == list(stock[i])})
    return found


def _judge_suffix(prompt, output, logprobs, first: int, epsilon: float) -> str | None:
    """None if every token of `output` from `first` on is within epsilon of stock's best, else
    why not."""
    for t in range(first, len(output)):
        pos = len(prompt) + t
        at = logprobs[pos]
        token = output[t]
        if at is None or token not in at:
            return f"no stock logprob for our token {token} at output {t}"
        best_token, best = max(at.items(), key=lambda kv: kv[1])
        gap = best - at[token]
        if gap > epsilon:
            return (f"at output {t} our token {token} has logprob {at[token]:.5f}, stock's best "
                    f"{best_token} has {best:.5f} (gap {gap:.2e} > {epsilon})")
    return None


def parity_waves(vocab_size: int, seed: int = 0, long: bool = False) -> list[list[list[int]]]:
    """Prompts (token ids) in waves: wave 0 holds single prompts of varied lengths and the first
    turn of each chat; wave k holds turn k of each chat, which extends turn k-1 (an assistant reply
    and a new user increment), so later waves reuse cached prefixes. Ids avoid special tokens.
    `long`: prompts of up to 1,500 tokens and turns that add 536-655, past the 512-token chunks
    that some attention backends (MLA's on Hopper) still run with their decode kernels; total
    lengths stay under 1,950 tokens."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, vocab_size) for _ in range(n)]

    singles = [tokens(n) for n in ((40, 300, 600, 1100, 1500) if long
                                   else (1, 5, 13, 40, 97, 160, 230))]
    chats = [[tokens(n)] for n in ((100, 600) if long else (24, 60, 120))]
    increment = (520, 640) if long else (8, 48)
    for chat in chats:
        for _ in range(2):
            chat.append(chat[-1] + tokens(16) + tokens(rng.randrange(*increment)))
    return [singles + [c[0] for c in chats], [c[1] for c in chats], [c[2] for c in chats]]


class LLMRunner:
    """Generation and teacher forcing through an offline `vllm.LLM`."""

    def __init__(self, llm):
        self.llm = llm

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        from vllm import SamplingParams, TokensPrompt

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                                 use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def teacher_force(self, seqs: list[list[int]]) -> list[list[dict[int, float] | None]]:
        from vllm import SamplingParams, TokensPrompt

        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=s) for s in seqs], params,
                                 use_tqdm=False)
        return [[None if d is None else {t: lp.logprob for t, lp in d.items()}
                 for d in o.prompt_logprobs] for o in outs]

    def worker_status(self) -> list[dict]:
        """Every rank's `AInferPDWorker.ainfer_pd_status()` (fails on a stock engine)."""
        return self.llm.collective_rpc("ainfer_pd_status")

    def spec_decode_counts(self) -> dict[str, int]:
        """vLLM's speculative-decoding counters (`drafts`, `draft_tokens`, `accepted_tokens`);
        the engine needs `disable_log_stats=False`."""
        prefix = "vllm:spec_decode_num_"
        return {m.name[len(prefix):]: m.value for m in self.llm.get_metrics()
                if m.name.startswith(prefix) and isinstance(getattr(m, "value", None), int)}


class ServerRunner:
    """Generation and teacher forcing through `/v1/completions` with the OpenAI Python client."""

    def __init__(self, url: str, model: str, timeout_s: float = 300.0,
                 headers: dict[str, str] | None = None):
        self.url = url
        self.model = model
        self.timeout_s = timeout_s
        # e.g. {"X-data-parallel-rank": "0"}: vLLM routes every request to that DP rank.
        self.headers = headers

    def client(self):
        """A fresh client per batch of calls: a pooled keep-alive connection left idle past the
        server's keep-alive timeout is closed by the server, and with retries off (so a server
        error is never hidden) reusing it would fail as "Server disconnected"."""
        from openai import OpenAI

        return OpenAI(base_url=self.url + "/v1", api_key="unused", timeout=self.timeout_s,
                      max_retries=0)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        from concurrent.futures import ThreadPoolExecutor

        def one(prompt: list[int]) -> list[int]:
            # A client per request: a connection another request of the wave left idle past the
            # server's keep-alive timeout (on loaded cores, threads start seconds apart) would
            # fail as "Server disconnected".
            r = self.client().completions.create(
                model=self.model, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                extra_body={"ignore_eos": True, "return_token_ids": True},
                extra_headers=self.headers)
            return list(r.choices[0].token_ids)

        # Concurrent, so the server batches them as it would batch real traffic.
        with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
            return list(pool.map(one, prompts))

    def teacher_force(self, seqs: list[list[int]]) -> list[list[dict[int, float] | None]]:
        result = []
        client = self.client()
        for seq in seqs:
            r = client.completions.create(
                model=self.model, prompt=seq, max_tokens=1, temperature=0.0,
                extra_body={"prompt_logprobs": 1})
            raw = r.choices[0].model_extra["prompt_logprobs"]
            result.append([None if d is None else {int(t): v["logprob"] for t, v in d.items()}
                           for d in raw])
        return result


def run_waves(runner, waves: list[list[list[int]]], max_tokens: int) -> list[list[int]]:
    """Outputs for every prompt of every wave, in order; a wave starts after the previous ends."""
    outputs: list[list[int]] = []
    for wave in waves:
        outputs += runner.generate(wave, max_tokens)
    return outputs


@contextmanager
def offline_llm(model: str, tensor_parallel_size: int = 1, backend: str | None = None,
                **engine_args):
    """An `LLMRunner` over `vllm.LLM` with the harness's CPU settings; the engine is shut down on
    exit so the next engine gets the cores. `backend=None` is stock vLLM."""
    from vllm import LLM

    from vllm_ainfer_pd.rollout.cpu_engine import CPU_ENGINE_ARGS, apply_cpu_env

    apply_cpu_env(tensor_parallel_size)
    args = {**CPU_ENGINE_ARGS, "tensor_parallel_size": tensor_parallel_size, **engine_args}
    if backend is not None:
        args["distributed_executor_backend"] = backend
    llm = LLM(model=model, **args)
    try:
        yield LLMRunner(llm)
    finally:
        llm.llm_engine.engine_core.shutdown()
