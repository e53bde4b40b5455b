"""Rollout workload: trace format, generator, replayer, metrics, comparison driver.

See docs/rollout.md.

Module map: trace.py (format, load/dump), generator.py (synthetic traces with the paper's
statistics), replayer.py (asyncio client for /v1/completions), metrics.py (makespan, completion
times, TTFT/TPOT), backend_metrics.py (the server's /metrics counters), report.py (report.json/.md,
plots), server.py (`vllm serve` lifecycle), cpu_engine.py (engine settings on the CPU), compare.py
(start servers, replay, report), __main__.py (CLI).
"""
