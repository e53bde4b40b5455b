"""The P-lane abort storm: many multi-turn chats through the lane while requests are aborted
mid-P (and, less often, mid-decode), then leak, liveness and stale-token checks.

The engine is built in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0` while `vllm.LLM(...)` is
constructed), so its scheduler can be inspected between steps:
`llm.llm_engine.engine_core` (`InprocClient`) `.engine_core` (`EngineCore`) `.scheduler`. The
worker is still its own process (the backend's executor is vLLM's multiprocess executor).

Workload: up to `pool_size` requests active at once, each one turn of a chat. A chat's first prompt
is 40..400 random token ids (in [3, 512)); each later turn is the previous prompt + its output +
8..120 new ids; `max_tokens` is 4..16 (greedy, `ignore_eos`). A chat ends after its planned number
of turns or when the next prompt would pass `max_prompt_tokens`. At random steps the storm aborts
an active request whose P job is in flight (parked in `WAITING_FOR_REMOTE_KVS` with a job in the
lane: `aborts_in_p`), now and then one that is parked with its P already reported but not yet
promoted (`aborts_in_p_drained`), and less often one that is decoding (`aborts_in_d`). An aborted
turn is resubmitted once (same prompt, a new request id); a second abort of the same turn ends the
chat.

Checks (each failure is one line with the numbers, in `StormReport.failures`):
(a) every request added either finished (one final output, `finished=True`, exactly `max_tokens`
    tokens) or was aborted, and after the storm the scheduler drains to no requests at all (a P
    aborted while in flight keeps its blocks, ref_cnt >= 1, until the worker reports the drain);
(b) free KV blocks after the drain equal free blocks before the first request (prefix-cached blocks
    count as free), and the lane has no job in flight (scheduler side and worker side);
(c) no stale token: every finished request's output equals stock vLLM's greedy output for the same
    prompt and max_tokens, judged by `parity.compare` (a difference passes only where stock's own
    logprobs show a tie);
(d) the engine still serves: a fresh long request after the storm matches stock too;
(e) the lane ran: the worker reports `jobs_done > 0` and `jobs_cancelled > 0`.

The storm is deterministic for a seed (one process drives the in-process engine step by step,
greedy sampling), so a failure reproduces with the same seed and arguments; failures name the step.

CLI: `python -m ainfer_pd_testing.abort_storm --aborts 1000 [--seed 0] [--json out.json]`;
exit code 1 when a check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

LANE_MIN_TOKENS = 32
VOCAB = (3, 512)  # random prompt ids: [3, 512), no special tokens of the tiny models
MAX_DETAILS = 40  # failure/parity detail lines kept in the report


@dataclass
class StormReport:
    model: str
    seed: int
    aborts_target: int
    # the storm
    steps: int = 0
    drain_steps: int = 0
    chats: int = 0
    requests_added: int = 0
    finished: int = 0
    aborted: int = 0
    aborts_in_p: int = 0  # parked, P job in flight in the lane
    aborts_in_p_drained: int = 0  # parked, P reported by the worker, not promoted yet
    aborts_in_d: int = 0  # running, decoding (at least one output token)
    resubmitted: int = 0
    lane_jobs: int = 0  # P jobs the scheduler shipped to the lane, (request id, lifetime) keys
    lane_jobs_after_preemption: int = 0  # jobs with lifetime >= 1 (a re-prefill in the lane)
    preemptions: int = 0  # of requests, seen between steps (0 unless the KV pool is small)
    max_held: int = 0  # most aborted requests holding blocks at once (waiting for the drain)
    max_held_steps: int = 0  # longest an aborted P held its blocks, in engine steps
    # KV blocks
    num_gpu_blocks: int = 0
    free_blocks_before: int = 0
    free_blocks_after: int = 0
    free_blocks_after_final: int = -1  # -1: the final request was not run
    # parity vs stock
    parity_prompts: int = 0
    parity_exact: int = 0
    parity_tie: int = 0
    parity_fail: int = 0
    parity_details: list[str] = field(default_factory=list)
    final_request: str = ""  # exact / tie / fail
    # the worker's lane counters after the storm
    lane: dict = field(default_factory=dict)
    # seconds
    storm_s: float = 0.0
    stock_s: float = 0.0
    duration_s: float = 0.0
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    def fail(self, line: str) -> None:
        self.failures.append(line)

    def summary(self) -> str:
        lane = self.lane or {}
        lines = [
            f"abort storm: model={self.model} seed={self.seed} "
            f"target aborts_in_p>={self.aborts_target}",
            f"  steps {self.steps} (+{self.drain_steps} drain), chats {self.chats}, requests "
            f"{self.requests_added}: finished {self.finished}, aborted {self.aborted} "
            f"(in P {self.aborts_in_p}, in P after its report {self.aborts_in_p_drained}, "
            f"in D {self.aborts_in_d}), resubmitted {self.resubmitted}",
            f"  P jobs shipped to the lane {self.lane_jobs} ({self.lane_jobs_after_preemption} "
            f"after a preemption; {self.preemptions} preemptions); aborted P held blocks: at most "
            f"{self.max_held} at once, for at most {self.max_held_steps} steps",
            f"  free blocks before {self.free_blocks_before}, after drain "
            f"{self.free_blocks_after}, "
            f"after final request "
            f"{self.free_blocks_after_final if self.free_blocks_after_final >= 0 else 'n/a'} "
            f"(of {self.num_gpu_blocks})",
            f"  parity vs stock: {self.parity_prompts} prompts, exact={self.parity_exact} "
            f"tie={self.parity_tie} fail={self.parity_fail}; final fresh request: "
            f"{self.final_request or 'not run'}",
            "  lane: " + ", ".join(
                f"{k}={lane[k]}" for k in ("epochs", "jobs_done", "jobs_cancelled", "jobs_failed",
                                           "p_tokens", "inflight") if k in lane),
            f"  time: storm {self.storm_s:.1f} s, stock {self.stock_s:.1f} s, total "
            f"{self.duration_s:.1f} s",
            "  result: " + ("PASS" if self.ok else f"FAIL ({len(self.failures)} checks)"),
        ]
        lines += [f"  FAIL {f}" for f in self.failures]
        lines += [f"  parity: {d}" for d in self.parity_details[:MAX_DETAILS]]
        return "\n".join(lines)


@dataclass
class _Turn:
    ext_id: str
    chat: int
    turn: int
    attempt: int
    prompt: list[int]
    max_tokens: int
    internal_id: str = ""
    state: str = "active"  # active / finished / aborted
    output: list[int] | None = None
    abort_kind: str = ""


@dataclass
class _Chat:
    idx: int
    turns_left: int
    prompt: list[int] | None = None  # the next turn's prompt (None: a turn is active)
    started: int = 0  # turns started


@contextlib.contextmanager
def _inprocess_env():
    """`VLLM_ENABLE_V1_MULTIPROCESSING=0` only while the engine is constructed."""
    key = "VLLM_ENABLE_V1_MULTIPROCESSING"
    old = os.environ.get(key)
    os.environ[key] = "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old


def _scheduler_of(llm):
    """The in-process EngineCore's scheduler (vLLM 0.26: LLMEngine.engine_core is an InprocClient
    whose .engine_core is the EngineCore)."""
    from vllm.v1.engine.core_client import InprocClient

    client = getattr(llm.llm_engine, "engine_core", None)
    if not isinstance(client, InprocClient):
        raise RuntimeError(
            f"abort storm needs an in-process EngineCore: llm.llm_engine.engine_core is "
            f"{type(client).__name__}, not InprocClient (was VLLM_ENABLE_V1_MULTIPROCESSING=0 "
            f"set while the engine was built?)"
        )
    core = getattr(client, "engine_core", None)
    scheduler = getattr(core, "scheduler", None)
    if scheduler is None:
        raise RuntimeError(
            "abort storm: llm.llm_engine.engine_core.engine_core.scheduler not found "
            f"(InprocClient.engine_core is {type(core).__name__}); vLLM's layout changed"
        )
    lane = getattr(scheduler, "p_lane", None)
    if lane is None:
        raise RuntimeError(
            f"abort storm: the scheduler ({type(scheduler).__name__}) has no P-lane connector; "
            f"the engine must run the ainfer_pd backend with the lane on"
        )
    return scheduler, lane


def _build_engine(model: str, p_lane_min_tokens: int, kv_blocks: int | None = None,
                  max_num_batched_tokens: int | None = None):
    from vllm import LLM

    from vllm_ainfer_pd.rollout.cpu_engine import CPU_ENGINE_ARGS, apply_cpu_env

    apply_cpu_env(1)
    args = {**CPU_ENGINE_ARGS, "tensor_parallel_size": 1,
            "distributed_executor_backend": "ainfer_pd",
            "additional_config": {"ainfer_pd": {"p_lane_min_tokens": p_lane_min_tokens}}}
    if kv_blocks is not None:
        args["num_gpu_blocks_override"] = kv_blocks
    if max_num_batched_tokens is not None:
        args["max_num_batched_tokens"] = max_num_batched_tokens
    with _inprocess_env():
        return LLM(model=model, **args)


def run_storm(
    model: str,
    aborts: int,
    seed: int = 0,
    *,
    pool_size: int = 12,
    first_turn: tuple[int, int] = (40, 400),
    increment: tuple[int, int] = (8, 120),
    max_tokens: tuple[int, int] = (4, 16),
    turns: tuple[int, int] = (1, 8),
    max_prompt_tokens: int = 1200,
    p_abort_p: float = 0.2,
    p_abort_drained: float = 0.05,
    p_abort_d: float = 0.05,
    kv_blocks: int | None = None,
    max_num_batched_tokens: int | None = None,
    final_prompt_tokens: int = 900,
    final_max_tokens: int = 16,
    progress_every: int = 50,
    max_steps: int | None = None,
    drain_step_cap: int = 2000,
    log: Callable[[str], None] | None = None,
) -> StormReport:
    """Run the storm until `aborts` requests have been aborted with their P in flight, drain, then
    check against stock vLLM. Never raises for a failed check or an engine error: both land in
    `StormReport.failures`."""
    from vllm import SamplingParams, TokensPrompt
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.request import RequestStatus

    from ainfer_pd_testing.parity import compare, offline_llm

    if log is None:
        def log(line: str) -> None:
            print(line, flush=True)

    t0 = time.monotonic()
    rng = random.Random(seed)
    report = StormReport(model=model, seed=seed, aborts_target=aborts)
    max_steps = max_steps if max_steps is not None else 60 * aborts + 2000

    def tokens(n: int) -> list[int]:
        return [rng.randrange(*VOCAB) for _ in range(n)]

    def params(n: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True,
                              output_kind=RequestOutputKind.FINAL_ONLY)

    turns_all: list[_Turn] = []
    by_ext: dict[str, _Turn] = {}
    active: dict[str, _Turn] = {}  # internal id -> turn
    held: dict[str, int] = {}  # internal id of an aborted P still in scheduler.requests -> step
    preempted: dict[str, int] = {}
    jobs_seen: set[tuple[str, int]] = set()  # every P job key (admitted in a step's schedule,
    # reported at the earliest in the next step's output, so it is in flight between two steps)
    chats: list[_Chat] = []
    live_chats: list[_Chat] = []
    retry_queue: list[_Turn] = []
    final_prompt = None
    final_out: list[int] | None = None
    where = {"phase": "build", "step": 0}  # for the message of an engine error

    llm = _build_engine(model, LANE_MIN_TOKENS, kv_blocks, max_num_batched_tokens)
    engine = llm.llm_engine
    try:
        scheduler, lane = _scheduler_of(llm)
        pool = scheduler.kv_cache_manager.block_pool
        report.num_gpu_blocks = pool.num_gpu_blocks
        report.free_blocks_before = pool.get_num_free_blocks()
        log(f"[storm] engine up: {report.num_gpu_blocks} KV blocks "
            f"({report.free_blocks_before} free), block size {scheduler.block_size}, "
            f"lane min tokens {lane.lane_min_tokens}, max P in flight "
            f"{lane.config.max_p_inflight}")

        def add(turn: _Turn) -> None:
            internal = engine.add_request(turn.ext_id, TokensPrompt(prompt_token_ids=turn.prompt),
                                          params(turn.max_tokens))
            if not internal.startswith(turn.ext_id + "-") and internal != turn.ext_id:
                raise RuntimeError(f"internal id {internal!r} does not extend {turn.ext_id!r}")
            turn.internal_id = internal
            turns_all.append(turn)
            by_ext[turn.ext_id] = turn
            active[internal] = turn
            report.requests_added += 1

        def next_turn() -> _Turn | None:
            if retry_queue:
                old = retry_queue.pop(0)
                report.resubmitted += 1
                return _Turn(f"c{old.chat}-t{old.turn}-a{old.attempt + 1}", old.chat, old.turn,
                             old.attempt + 1, old.prompt, old.max_tokens)
            busy = {t.chat for t in active.values()}
            idle = [c for c in live_chats if c.idx not in busy and c.prompt is not None]
            if idle and rng.random() < 0.7:
                chat = rng.choice(idle)
            else:
                chat = _Chat(len(chats), rng.randint(*turns))
                chat.prompt = tokens(rng.randint(*first_turn))
                chats.append(chat)
                live_chats.append(chat)
                report.chats += 1
            prompt, chat.prompt = chat.prompt, None  # the chat waits for this turn's output
            turn_no, chat.started = chat.started, chat.started + 1
            return _Turn(f"c{chat.idx}-t{turn_no}-a0", chat.idx, turn_no, 0, prompt,
                         rng.randint(*max_tokens))

        def end_turn(turn: _Turn) -> None:
            """The chat of a finished turn goes on (or ends); an aborted turn is retried once."""
            if turn.chat < 0:
                return  # the final fresh request
            chat = chats[turn.chat]
            if turn.state == "aborted":
                if turn.attempt == 0:
                    retry_queue.append(turn)
                else:
                    _end_chat(chat)
                return
            chat.turns_left -= 1
            nxt = turn.prompt + turn.output + tokens(rng.randint(*increment))
            if chat.turns_left <= 0 or len(nxt) + max_tokens[1] > max_prompt_tokens:
                _end_chat(chat)
            else:
                chat.prompt = nxt

        def _end_chat(chat: _Chat) -> None:
            if chat in live_chats:
                live_chats.remove(chat)

        def do_step(step_no: int) -> None:
            where["step"] = step_no
            for out in engine.step():
                turn = by_ext.get(out.request_id)
                if turn is None:
                    report.fail(f"step {step_no}: output for unknown request {out.request_id}")
                    continue
                toks = list(out.outputs[0].token_ids) if out.outputs else []
                if turn.state != "active":
                    report.fail(f"step {step_no}: output for {turn.ext_id} ({turn.internal_id}), "
                                f"which is {turn.state} ({turn.abort_kind}); finished="
                                f"{out.finished}, {len(toks)} tokens")
                    continue
                if not out.finished:
                    report.fail(f"step {step_no}: non-final output for {turn.ext_id} with "
                                f"FINAL_ONLY ({len(toks)} tokens)")
                    continue
                if len(toks) != turn.max_tokens:
                    report.fail(f"step {step_no}: {turn.ext_id} finished with {len(toks)} tokens, "
                                f"max_tokens={turn.max_tokens} (finish_reason "
                                f"{out.outputs[0].finish_reason if out.outputs else None})")
                turn.state, turn.output = "finished", toks
                active.pop(turn.internal_id, None)
                report.finished += 1
                end_turn(turn)
            jobs_seen.update(job.key for job in lane.inflight.values())
            for iid, turn in active.items():
                req = scheduler.requests.get(iid)
                if req is not None:
                    preempted[iid] = req.num_preemptions
            # Aborted P jobs hold their blocks until the worker reports the drain.
            for iid in [i for i in held if i not in scheduler.requests]:
                report.max_held_steps = max(report.max_held_steps, step_no - held.pop(iid))

        def abort(turn: _Turn, kind: str, step_no: int) -> None:
            req = scheduler.requests[turn.internal_id]
            engine.abort_request([turn.ext_id])  # external id (internal=False), vLLM 0.26
            turn.state, turn.abort_kind = "aborted", kind
            active.pop(turn.internal_id)
            report.aborted += 1
            if not req.is_finished():
                report.fail(f"step {step_no}: abort of {turn.internal_id} ({kind}) left it "
                            f"{req.status.name}")
            if kind == "P":
                report.aborts_in_p += 1
                blocks = scheduler.kv_cache_manager.get_blocks(turn.internal_id).blocks
                flat = [b for group in blocks for b in group]
                if turn.internal_id not in scheduler.requests or not flat:
                    report.fail(f"step {step_no}: {turn.internal_id} aborted with its P in flight "
                                f"but its blocks were freed at once (in requests: "
                                f"{turn.internal_id in scheduler.requests}, {len(flat)} blocks)")
                elif any(b.ref_cnt < 1 for b in flat):
                    report.fail(f"step {step_no}: {turn.internal_id} aborted with its P in flight: "
                                f"blocks {[b.block_id for b in flat if b.ref_cnt < 1]} have "
                                f"ref_cnt 0 (the worker may still write them)")
                else:
                    held[turn.internal_id] = step_no
                    report.max_held = max(report.max_held, len(held))
            elif kind == "P-drained":
                report.aborts_in_p_drained += 1
            else:
                report.aborts_in_d += 1
            end_turn(turn)

        # ---- the storm --------------------------------------------------------------------
        step = 0
        next_progress = progress_every
        storm_start = time.monotonic()
        where["phase"] = "storm"
        while report.aborts_in_p < aborts:
            if step >= max_steps:
                report.fail(f"storm: {step} steps and only {report.aborts_in_p}/{aborts} aborts "
                            f"of in-flight P (no parked request to abort?)")
                break
            while len(active) < pool_size:
                turn = next_turn()
                add(turn)
            parked, drained, decoding = [], [], []
            for iid, turn in active.items():
                req = scheduler.requests.get(iid)
                if req is None:
                    continue
                if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                    if lane.is_current(iid, None):
                        parked.append(turn)
                    elif iid in scheduler.finished_recving_kv_req_ids:
                        drained.append(turn)
                elif req.status == RequestStatus.RUNNING and req.num_output_tokens >= 1:
                    decoding.append(turn)
            r = rng.random()
            if r < p_abort_p and parked:
                abort(rng.choice(parked), "P", step)
            elif r < p_abort_p + p_abort_drained and drained:
                abort(rng.choice(drained), "P-drained", step)
            elif r < p_abort_p + p_abort_drained + p_abort_d and decoding:
                abort(rng.choice(decoding), "D", step)
            do_step(step)
            step += 1
            if report.aborts_in_p >= next_progress:
                next_progress += progress_every
                log(f"[storm] step {step}: aborts in P {report.aborts_in_p}/{aborts} "
                    f"(+{report.aborts_in_p_drained} after report), in D {report.aborts_in_d}, "
                    f"finished {report.finished}, active {len(active)}, held {len(held)}, "
                    f"free blocks {pool.get_num_free_blocks()}, "
                    f"{time.monotonic() - storm_start:.0f} s")
        report.steps = step

        # ---- drain: no new requests, no aborts ---------------------------------------------
        retry_queue.clear()
        where["phase"] = "drain"
        drain = 0
        while scheduler.requests or active:
            if drain >= drain_step_cap:
                stuck = ", ".join(f"{iid}={req.status.name}"
                                  for iid, req in list(scheduler.requests.items())[:20])
                report.fail(f"drain: {len(scheduler.requests)} requests still in the scheduler "
                            f"after {drain} steps: {stuck}; lane in flight "
                            f"{sorted(lane.inflight)}; our active {sorted(active)}")
                break
            do_step(step + drain)
            drain += 1
        report.drain_steps = drain
        report.storm_s = time.monotonic() - storm_start
        report.free_blocks_after = pool.get_num_free_blocks()

        # (a) every request finished or was aborted
        left = [t for t in turns_all if t.state == "active"]
        if left:
            report.fail(f"(a) {len(left)} requests neither finished nor aborted: "
                        f"{[t.internal_id for t in left[:20]]}")
        if report.finished + report.aborted != report.requests_added:
            report.fail(f"(a) finished {report.finished} + aborted {report.aborted} != added "
                        f"{report.requests_added}")
        # (b) no leaked block, nothing left in the lane
        if report.free_blocks_after != report.free_blocks_before:
            report.fail(f"(b) free KV blocks {report.free_blocks_after} after the drain, "
                        f"{report.free_blocks_before} before the first request "
                        f"({report.free_blocks_before - report.free_blocks_after} leaked)")
        if lane.inflight:
            report.fail(f"(b) the scheduler's lane still has jobs in flight: "
                        f"{sorted(lane.inflight)}")
        if held:
            report.fail(f"(b) aborted P requests never released: {sorted(held)}")

        # (d) a fresh long request on our engine (through the lane)
        if not scheduler.requests:
            where["phase"] = "final request"
            final_prompt = tokens(final_prompt_tokens)
            final = _Turn("final", -1, 0, 0, final_prompt, final_max_tokens)
            add(final)
            cap = drain_step_cap
            n = 0
            while final.state == "active" and n < cap:
                do_step(step + drain + n)
                n += 1
            if final.state != "finished":
                report.fail(f"(d) the fresh request after the storm did not finish in {cap} steps "
                            f"(status {scheduler.requests.get(final.internal_id)})")
            else:
                final_out = final.output
            while scheduler.requests and n < 2 * cap:
                do_step(step + drain + n)
                n += 1
            report.free_blocks_after_final = pool.get_num_free_blocks()
            if report.free_blocks_after_final != report.free_blocks_before:
                report.fail(f"(b) free KV blocks {report.free_blocks_after_final} after the final "
                            f"request, {report.free_blocks_before} before the first request")

        # (e) the lane ran, and drained everything
        where["phase"] = "status"
        status = llm.collective_rpc("ainfer_pd_status")
        report.lane = dict(status[0].get("p_lane") or {})
        if not report.lane:
            report.fail(f"(e) the worker reports no P lane: {status[0]}")
        else:
            if report.lane.get("jobs_done", 0) <= 0:
                report.fail(f"(e) the lane completed no job: {report.lane}")
            if report.lane.get("jobs_cancelled", 0) <= 0:
                report.fail(f"(e) the lane cancelled no job (aborts in P: {report.aborts_in_p})")
            if report.lane.get("jobs_failed", 0):
                report.fail(f"(e) {report.lane['jobs_failed']} P jobs failed in the worker")
            report.lane_jobs = len(jobs_seen)
            report.lane_jobs_after_preemption = sum(1 for _, life in jobs_seen if life >= 1)
            report.preemptions = sum(preempted.values())
            drained = sum(report.lane.get(k, 0) for k in ("jobs_done", "jobs_cancelled",
                                                             "jobs_failed"))
            if drained != report.lane_jobs:
                report.fail(f"(e) the scheduler shipped {report.lane_jobs} P jobs, the worker "
                            f"drained {drained} (done+cancelled+failed)")
            if report.lane.get("inflight", 0):
                report.fail(f"(b) the worker's lane still holds {report.lane['inflight']} jobs")
    except Exception as exc:  # an engine error is a failed storm, not a crash of the harness
        report.fail(f"engine error in the {where['phase']} phase at step {where['step']} (seed "
                    f"{seed}): {exc!r}\n" + traceback.format_exc())
    finally:
        with contextlib.suppress(Exception):
            engine.engine_core.shutdown()
        llm = engine = None  # the next engine gets the memory

    # ---- (c)/(d) stock vLLM on the same prompts ------------------------------------------------
    done = [t for t in turns_all if t.state == "finished" and t.ext_id != "final"]
    if final_out is not None:
        done.append(_Turn("final", -1, 0, 0, final_prompt, final_max_tokens, state="finished",
                          output=final_out))
    report.parity_prompts = len(done)
    if done:
        stock_start = time.monotonic()
        try:
            log(f"[storm] stock vLLM on {len(done)} finished prompts")
            with offline_llm(model, 1) as stock:
                stock_out: dict[int, list[int]] = {}
                for n in sorted({t.max_tokens for t in done}):
                    idx = [i for i, t in enumerate(done) if t.max_tokens == n]
                    for i, out in zip(idx, stock.generate([done[i].prompt for i in idx], n)):
                        stock_out[i] = out
                stock_list = [stock_out[i] for i in range(len(done))]
                parity = compare([t.prompt for t in done], stock_list, [t.output for t in done],
                                 stock.teacher_force)
            report.parity_exact, report.parity_tie = parity.exact, parity.tie
            report.parity_fail = parity.fail
            report.parity_details = [_name_detail(d, done) for d in parity.details][:MAX_DETAILS]
            if parity.fail:
                report.fail(f"(c) {parity.fail} of {len(done)} finished requests differ from "
                            f"stock beyond a tie (see parity details)")
            if final_out is not None:
                last = len(done) - 1
                if stock_list[last] == final_out:
                    report.final_request = "exact"
                elif any(d.startswith(f"#{last}: tie") for d in parity.details):
                    report.final_request = "tie"
                else:
                    report.final_request = "fail"
                    report.fail("(d) the fresh request after the storm differs from stock")
        except Exception as exc:
            report.fail(f"stock comparison error: {exc!r}\n" + traceback.format_exc())
        report.stock_s = time.monotonic() - stock_start
    report.duration_s = time.monotonic() - t0
    return report


def _name_detail(detail: str, done: list[_Turn]) -> str:
    """`#i: ...` -> `#i (request id, prompt length, max_tokens): ...`."""
    if detail.startswith("#"):
        head, _, rest = detail.partition(":")
        with contextlib.suppress(ValueError, IndexError):
            t = done[int(head[1:])]
            return f"{head} ({t.ext_id}, {len(t.prompt)} prompt tokens, max_tokens " \
                   f"{t.max_tokens}):{rest}"
    return detail


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ainfer_pd_testing.abort_storm",
        description="Abort requests mid-P (and mid-D) in the ainfer_pd P lane; check for leaks, "
                    "hangs and stale tokens against stock vLLM.")
    parser.add_argument("--model", default=None,
                        help="model folder (default: the generated tiny model)")
    parser.add_argument("--aborts", type=int, default=1000,
                        help="stop once this many requests were aborted with their P in flight")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-blocks", type=int, default=None,
                        help="KV pool size in blocks (default: vLLM's, from 1 GiB); a small pool "
                             "adds preemptions and lane waits to the storm")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="step token budget (default: the CPU harness's); below the longest "
                             "prompt, the lane prefills prompts in parts over several epochs")
    parser.add_argument("--json", default=None, help="write the report here")
    args = parser.parse_args(argv)
    model = args.model
    if model is None:
        from vllm_ainfer_pd.models import ensure_model

        model = str(ensure_model("tiny", seed=0))
    report = run_storm(model, args.aborts, seed=args.seed, kv_blocks=args.kv_blocks,
                       max_num_batched_tokens=args.max_num_batched_tokens)
    print(report.summary(), flush=True)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({**asdict(report), "ok": report.ok}, f, indent=2)
            f.write("\n")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
