"""The rollout trace: trajectories of causally dependent turns, stored as JSONL (docs/rollout.md).

A turn appends a prompt increment to the trajectory's context, then generates `output_tokens`.
The next turn's prompt is the previous prompt + the model's actual output + the next increment, and
it is released `wait_s` (x the replay's wait scale) after the previous turn's final token. Sizes,
order and dependencies are what a replay preserves; the token ids of increments are either given
in the trace or drawn by the replayer (`increment_ids`).

File layout: an optional first line `{"meta": {...}}` (free-form: preset, seed, ...), then one
trajectory per line:

    {"id": "t0", "start_s": 0.0, "turns": [
        {"input_tokens": 2400, "output_tokens": 88, "wait_s": 0.0},
        {"input_tokens": 292, "output_tokens": 41, "wait_s": 3.1},
        {"input_ids": [17, 99, 230], "output_tokens": 12, "wait_s": 0.4}]}
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class TraceError(ValueError):
    pass


@dataclass(frozen=True)
class Turn:
    """One request. `wait_s`: client wait between the previous turn's final token and this turn's
    release (0 on a trajectory's first turn). `input_ids`, if given, has `input_tokens` entries."""

    input_tokens: int
    output_tokens: int
    wait_s: float = 0.0
    input_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.input_tokens, int) or self.input_tokens < 1:
            raise TraceError(f"input_tokens={self.input_tokens!r} must be an int >= 1")
        if not isinstance(self.output_tokens, int) or self.output_tokens < 1:
            raise TraceError(f"output_tokens={self.output_tokens!r} must be an int >= 1")
        if not isinstance(self.wait_s, (int, float)) or not self.wait_s >= 0:
            raise TraceError(f"wait_s={self.wait_s!r} must be a number >= 0")
        if self.input_ids is not None and len(self.input_ids) != self.input_tokens:
            raise TraceError(f"input_ids has {len(self.input_ids)} ids, input_tokens="
                             f"{self.input_tokens}")


@dataclass(frozen=True)
class Trajectory:
    """Turns in causal order; released `start_s` after the replay starts (not scaled by waits)."""

    id: str
    turns: tuple[Turn, ...]
    start_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.turns:
            raise TraceError(f"trajectory {self.id!r} has no turns")
        if self.turns[0].wait_s != 0:
            raise TraceError(f"trajectory {self.id!r}: first turn has wait_s={self.turns[0].wait_s}"
                             f"; use start_s to delay a trajectory's first release")
        if not self.start_s >= 0:
            raise TraceError(f"trajectory {self.id!r}: start_s={self.start_s!r} must be >= 0")

    def contexts(self) -> list[int]:
        """Prompt length of each turn: all earlier increments and outputs plus its own increment."""
        sizes, total = [], 0
        for turn in self.turns:
            total += turn.input_tokens
            sizes.append(total)
            total += turn.output_tokens
        return sizes

    @property
    def final_len(self) -> int:
        """Tokens held after the last turn: the most this trajectory needs from max_model_len."""
        return self.contexts()[-1] + self.turns[-1].output_tokens


@dataclass(frozen=True)
class Trace:
    trajectories: tuple[Trajectory, ...]
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.trajectories:
            raise TraceError("trace has no trajectories")
        ids = [t.id for t in self.trajectories]
        dup = sorted({i for i in ids if ids.count(i) > 1})
        if dup:
            raise TraceError(f"duplicate trajectory id(s): {', '.join(map(repr, dup[:5]))}")

    @property
    def num_requests(self) -> int:
        return sum(len(t.turns) for t in self.trajectories)

    @property
    def max_len(self) -> int:
        return max(t.final_len for t in self.trajectories)

    def check_fits(self, max_model_len: int) -> None:
        """Raise if a trajectory would outgrow the server's context (its last turn would be cut)."""
        for t in self.trajectories:
            if t.final_len > max_model_len:
                raise TraceError(f"trajectory {t.id!r} needs {t.final_len} tokens, more than the "
                                 f"server's max_model_len={max_model_len}")

    def stats(self) -> dict[str, list[float]]:
        """Samples over requests: `output`, `context` (prompt lengths); over continuations (turns
        after the first): `increment`, `wait`; over trajectories: `initial` (first prompts)."""
        out: dict[str, list[float]] = {"increment": [], "output": [], "context": [], "wait": [],
                                       "initial": []}
        for t in self.trajectories:
            out["context"] += t.contexts()
            out["initial"].append(t.turns[0].input_tokens)
            for k, turn in enumerate(t.turns):
                out["output"].append(turn.output_tokens)
                if k:
                    out["increment"].append(turn.input_tokens)
                    out["wait"].append(turn.wait_s)
        return out


def increment_ids(turn: Turn, key: str, low: int, high: int) -> list[int]:
    """The increment's token ids: the trace's own, or ids drawn uniformly from [low, high) seeded
    by `key` (so every backend and every run with the same key sends the same prompt)."""
    if turn.input_ids is not None:
        return list(turn.input_ids)
    rng = random.Random(key)
    return [rng.randrange(low, high) for _ in range(turn.input_tokens)]


def _turn_from_json(raw: dict, where: str) -> Turn:
    if not isinstance(raw, dict):
        raise TraceError(f"{where}: a turn must be an object, got {raw!r}")
    unknown = sorted(set(raw) - {"input_tokens", "input_ids", "output_tokens", "wait_s"})
    if unknown:
        raise TraceError(f"{where}: unknown turn field(s) {', '.join(unknown)}")
    ids = raw.get("input_ids")
    if ids is not None and not (isinstance(ids, list) and all(isinstance(i, int) for i in ids)):
        raise TraceError(f"{where}: input_ids must be a list of ints")
    n_in = raw.get("input_tokens", len(ids) if ids is not None else None)
    if n_in is None:
        raise TraceError(f"{where}: a turn needs input_tokens or input_ids")
    if "output_tokens" not in raw:
        raise TraceError(f"{where}: a turn needs output_tokens")
    try:
        return Turn(n_in, raw["output_tokens"], raw.get("wait_s", 0.0),
                    tuple(ids) if ids is not None else None)
    except TraceError as e:
        raise TraceError(f"{where}: {e}") from None


def load_trace(path: str | Path) -> Trace:
    """Read a JSONL trace; errors name the file, line and field."""
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"trace file {str(path)!r} does not exist")
    meta: dict[str, Any] = {}
    trajectories = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path} line {lineno}"
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceError(f"{where}: not JSON ({e.msg})") from None
        if isinstance(raw, dict) and set(raw) == {"meta"}:
            meta = dict(raw["meta"])
            continue
        if not isinstance(raw, dict) or not isinstance(raw.get("turns"), list):
            raise TraceError(f"{where}: a trajectory must be an object with a 'turns' list")
        tid = str(raw.get("id", f"t{len(trajectories)}"))
        turns = tuple(_turn_from_json(t, f"{where} turn {k}") for k, t in enumerate(raw["turns"]))
        try:
            trajectories.append(Trajectory(tid, turns, float(raw.get("start_s", 0.0))))
        except TraceError as e:
            raise TraceError(f"{where}: {e}") from None
    try:
        return Trace(tuple(trajectories), meta)
    except TraceError as e:
        raise TraceError(f"{path}: {e}") from None


def dump_trace(trace: Trace, path: str | Path) -> None:
    lines = [json.dumps({"meta": trace.meta})] if trace.meta else []
    for t in trace.trajectories:
        turns = []
        for turn in t.turns:
            raw: dict[str, Any] = {"input_tokens": turn.input_tokens,
                                   "output_tokens": turn.output_tokens,
                                   "wait_s": round(turn.wait_s, 4)}
            if turn.input_ids is not None:
                raw["input_ids"] = list(turn.input_ids)
            turns.append(raw)
        lines.append(json.dumps({"id": t.id, "start_s": t.start_s, "turns": turns}))
    Path(path).write_text("\n".join(lines) + "\n")
