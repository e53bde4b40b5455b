"""Replay a trace against an OpenAI-compatible server (`/v1/completions`), turn by turn.

Each trajectory is one asyncio task. Turn k+1 is released `wait_s * wait_scale` after turn k's
final token, and its prompt is turn k's prompt + the ids the model actually generated + the next
increment, all as token ids so every length is exact. Requests stream (`stream: true`) so the first
token's arrival gives TTFT, ask for `return_token_ids` (vLLM streams each chunk's new ids in
`choices[0].token_ids`) and force the output length with `max_tokens = min_tokens = output_tokens`
and `ignore_eos`.

A failed request (HTTP error, timeout, short output) is recorded with its error and ends its
trajectory; its remaining turns are recorded as skipped. The run itself only fails up front: an
unreachable server or a trace that does not fit the server's context raises `ReplayError`.
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from vllm_ainfer_pd.rollout.trace import Trace, TraceError, Trajectory, increment_ids

# Idle pooled connections older than this are not reused. It must stay below the server's keep-alive
# (`vllm serve`: VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s; aiohttp's own default is 15 s): otherwise a
# request sent on a connection idle for ~5 s can cross the server's close and fail with
# "Server disconnected" before the server reads it (seen once in a CPU TP=2 x DP=2 replay).
CLIENT_KEEPALIVE_S = 2.0


class ReplayError(RuntimeError):
    pass


@dataclass
class RequestRecord:
    """One request's timeline in seconds from the replay's start (NaN where it never got there)."""

    trajectory: str
    turn: int
    release_s: float  # when its dependencies (previous turn + wait) allowed it to go
    requested_tokens: int
    prompt_tokens: int = 0  # prompt length sent
    submit_s: float = math.nan  # sent to the server (after the client's concurrency limit)
    first_token_s: float = math.nan
    end_s: float = math.nan  # final token received
    output_tokens: int = 0
    error: str | None = None
    prompt_ids: list[int] | None = None  # kept only with ReplayConfig.keep_ids
    output_ids: list[int] | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class ReplayConfig:
    """`url`: server root (http://host:port). `wait_scale` multiplies every client wait (the paper's
    P1-P4 are 0.01-0.10; 0 releases continuations at once). `concurrency` bounds requests in flight;
    `timeout_s` bounds each request. Increment ids come from [token_low, token_high), seeded by
    `id_seed` and the turn, so equal seeds send equal prompts. `keep_ids` keeps every prompt and
    output in the records (for checks; costly on large traces)."""

    url: str
    model: str | None = None
    wait_scale: float = 1.0
    concurrency: int = 256
    timeout_s: float = 600.0
    token_low: int = 3
    token_high: int = 500
    id_seed: int = 0
    progress: bool = True
    keep_ids: bool = False  # store each request's prompt and output ids in its record

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url={self.url!r} must start with http:// or https://")
        if not self.wait_scale >= 0:
            raise ValueError(f"wait_scale={self.wait_scale!r} must be >= 0")
        if self.concurrency < 1:
            raise ValueError(f"concurrency={self.concurrency} must be >= 1")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s={self.timeout_s!r} must be > 0")
        if not 0 <= self.token_low < self.token_high:
            raise ValueError(f"token range [{self.token_low}, {self.token_high}) is empty")


@dataclass
class ReplayResult:
    records: list[RequestRecord]
    model: str
    max_model_len: int | None
    wall_start: float  # time.time() at the replay's start
    config: dict[str, Any] = field(default_factory=dict)


async def probe(session: aiohttp.ClientSession, url: str) -> tuple[str, int | None]:
    """(model id, max_model_len) from `GET /v1/models`; ReplayError if the server cannot answer."""
    try:
        async with session.get(url.rstrip("/") + "/v1/models",
                               timeout=aiohttp.ClientTimeout(total=10)) as r:
            if r.status != 200:
                raise ReplayError(f"server at {url} answered GET /v1/models with HTTP {r.status}")
            data = (await r.json())["data"]
    except (asyncio.TimeoutError, aiohttp.ClientError, OSError) as e:  # noqa: UP041 (3.10)
        raise ReplayError(f"cannot reach an OpenAI-compatible server at {url} "
                          f"({type(e).__name__}: {e or 'timed out'})") from None
    if not data:
        raise ReplayError(f"server at {url} serves no model")
    return data[0]["id"], data[0].get("max_model_len")


class _Replay:
    def __init__(self, trace: Trace, cfg: ReplayConfig, model: str,
                 session: aiohttp.ClientSession):
        self.trace, self.cfg, self.model, self.session = trace, cfg, model, session
        self.sem = asyncio.Semaphore(cfg.concurrency)
        self.records: list[RequestRecord] = []
        self.t0 = time.monotonic()
        self.bar = _progress(trace.num_requests, cfg.progress)

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def run(self) -> list[RequestRecord]:
        try:
            await asyncio.gather(*(self.trajectory(t) for t in self.trace.trajectories))
        finally:
            self.bar.close()
        order = {t.id: i for i, t in enumerate(self.trace.trajectories)}
        return sorted(self.records, key=lambda r: (order[r.trajectory], r.turn))

    async def trajectory(self, traj: Trajectory) -> None:
        context: list[int] = []
        release = traj.start_s
        for k, turn in enumerate(traj.turns):
            await asyncio.sleep(max(0.0, release - self.now()))
            key = f"{self.cfg.id_seed}:{traj.id}:{k}"
            prompt = context + increment_ids(turn, key, self.cfg.token_low, self.cfg.token_high)
            rec = RequestRecord(traj.id, k, release, turn.output_tokens, len(prompt))
            async with self.sem:
                output = await self.request(prompt, rec)
            self.records.append(rec)
            self.bar.update(1)
            if not rec.ok:
                for j in range(k + 1, len(traj.turns)):
                    self.records.append(RequestRecord(
                        traj.id, j, math.nan, traj.turns[j].output_tokens,
                        error=f"skipped: turn {k} of trajectory {traj.id!r} failed"))
                    self.bar.update(1)
                return
            if self.cfg.keep_ids:
                rec.prompt_ids, rec.output_ids = prompt, output
            context = prompt + output
            if k + 1 < len(traj.turns):
                release = rec.end_s + traj.turns[k + 1].wait_s * self.cfg.wait_scale

    async def request(self, prompt: list[int], rec: RequestRecord) -> list[int]:
        """Stream one completion into `rec`; returns the generated ids (empty on failure)."""
        n = rec.requested_tokens
        body = {"model": self.model, "prompt": prompt, "max_tokens": n, "min_tokens": n,
                "ignore_eos": True, "temperature": 0.0, "stream": True,
                "return_token_ids": True, "stream_options": {"include_usage": True}}
        ids: list[int] = []
        usage: dict[str, Any] = {}
        rec.submit_s = self.now()
        try:
            async with self.session.post(self.cfg.url.rstrip("/") + "/v1/completions", json=body,
                                         timeout=aiohttp.ClientTimeout(total=self.cfg.timeout_s)
                                         ) as r:
                if r.status != 200:
                    text = await r.text()
                    try:
                        text = _error_text(json.loads(text).get("error", text))
                    except (ValueError, AttributeError):
                        pass
                    rec.error = f"HTTP {r.status}: {text[:300]}"
                    return []
                async for event in _sse_events(r):
                    if "error" in event:
                        # vLLM reports a rejected streamed request in an event, after HTTP 200.
                        err = event["error"]
                        code = err.get("code", "?") if isinstance(err, dict) else "?"
                        rec.error = f"server error {code}: {_error_text(err)[:300]}"
                        return []
                    usage = event.get("usage") or usage
                    for choice in event.get("choices", []):
                        if choice.get("token_ids"):
                            if not ids:
                                rec.first_token_s = self.now()
                            ids += choice["token_ids"]
        except asyncio.TimeoutError:  # noqa: UP041 (Python 3.10: not the builtin)
            rec.error = f"timed out after {self.cfg.timeout_s:g} s"
            return []
        except (aiohttp.ClientError, OSError, ValueError) as e:
            rec.error = f"{type(e).__name__}: {e}"
            return []
        rec.end_s = self.now()
        rec.output_tokens = len(ids)
        if len(ids) != n:
            rec.error = f"short output: {len(ids)} of {n} tokens"
        elif usage and usage.get("prompt_tokens") != len(prompt):
            rec.error = (f"server counted {usage.get('prompt_tokens')} prompt tokens, "
                         f"sent {len(prompt)}")
        return ids


def _error_text(err: Any) -> str:
    return str(err.get("message", err)) if isinstance(err, dict) else str(err)


async def _sse_events(r: aiohttp.ClientResponse):
    """JSON events of a server-sent-event stream. Reads raw chunks rather than lines: the first
    event carries the whole prompt's ids and can outgrow aiohttp's line limit."""
    buf = b""
    async for chunk in r.content.iter_any():
        buf += chunk
        while b"\n\n" in buf:
            raw, buf = buf.split(b"\n\n", 1)
            for line in raw.splitlines():
                if line.startswith(b"data:"):
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        return
                    yield json.loads(data)


def _progress(total: int, enabled: bool):
    # A bar redrawn with carriage returns only makes sense on a terminal, not in a log file.
    enabled = enabled and sys.stderr.isatty()
    try:
        from tqdm import tqdm
    except ImportError:  # a plain counter is enough
        return _Counter(total, enabled)
    return tqdm(total=total, unit="req", file=sys.stderr, disable=not enabled, leave=False)


class _Counter:
    def __init__(self, total: int, enabled: bool):
        self.total, self.done, self.enabled = total, 0, enabled

    def update(self, n: int) -> None:
        self.done += n
        if self.enabled:
            print(f"\r{self.done}/{self.total} requests", end="", file=sys.stderr)

    def close(self) -> None:
        if self.enabled:
            print(file=sys.stderr)


async def replay_async(trace: Trace, cfg: ReplayConfig) -> ReplayResult:
    """Replay `trace` once; ReplayError if the server is unreachable or too small for the trace."""
    connector = aiohttp.TCPConnector(limit=cfg.concurrency, keepalive_timeout=CLIENT_KEEPALIVE_S)
    async with aiohttp.ClientSession(connector=connector) as session:
        served, max_len = await probe(session, cfg.url)
        if max_len is not None:
            try:
                trace.check_fits(max_len)
            except TraceError as e:
                raise ReplayError(str(e)) from None
        wall = time.time()
        records = await _Replay(trace, cfg, cfg.model or served, session).run()
    return ReplayResult(records, cfg.model or served, max_len, wall,
                        {"wait_scale": cfg.wait_scale, "concurrency": cfg.concurrency,
                         "timeout_s": cfg.timeout_s, "id_seed": cfg.id_seed})


def replay(trace: Trace, cfg: ReplayConfig) -> ReplayResult:
    """Synchronous `replay_async`."""
    return asyncio.run(replay_async(trace, cfg))
