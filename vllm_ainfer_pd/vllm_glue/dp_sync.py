"""Two more rows in vLLM's per-forward DP synchronisation: each DP rank's queued P tokens and
its decode rows (the forward's, plus the lane's jobs about to decode: `Epochs.awaiting_decode`).

At DP > 1, vLLM all-reduces a small [4, dp_size] int32 tensor before every forward, real or
dummy, on every DP rank (`vllm.v1.worker.dp_utils._run_ar`: tokens, padded tokens,
micro-batching, CUDA-graph mode; the drafters call it too), and reads it back on the host. The
P lane needs rank-consistent inputs every round to decide, without a rendezvous, whether the
round may open an epoch (the epoch gate, `turnstile/round_plan.py`): a rank-local answer would
let one rank enter a rendezvous its peers skip. Carrying each rank's queued P tokens and decode
rows as rows 5 and 6 costs no extra synchronisation: every rank reads the same all-reduced rows,
after the same sequence of forwards.

`install()` patches `_run_ar` once per process (a copy of vLLM 0.26's body with the extra rows);
the patched function copies the reduced tensor to the host once, where vLLM's post-processing
would read it (`.item()`) anyway, and hands vLLM its four rows on the host, so the lane's rows
add no device synchronisation. `set_source(fn)` names what the rows carry on this rank (the
lane's queued P tokens and decode rows); without a source the stock function runs.
`lane_rows()` gives the rows of the last all-reduce.

Model Runner V2 (vLLM 0.32 on) synchronises DP ranks in its own function instead
(`vllm.v1.worker.gpu.dp_utils.sync_cudagraph_and_dp_padding`, a [6, dp_size] CPU tensor
all-reduced on the DP group's gloo group); `_run_ar` is never called there. `install()` wraps
that function too: the lane's two rows go in a [2, dp_size] all-reduce of their own on the same
group just before it, one more small host all-reduce per forward, since copying the function's
140 lines to widen its tensor would tie the lane to every change vLLM makes to it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from vllm_ainfer_pd.vllm_glue.shapes import Patch, vllm_at_least

PATCHES = [
    Patch("vllm.v1.worker.dp_utils:_run_ar",
          "carry each DP rank's queued P tokens in the all-reduce vLLM runs before every forward",
          ("should_ubatch", "orig_num_tokens_per_ubatch", "padded_num_tokens_per_ubatch",
           "cudagraph_mode", "parallel_config"), does="replaces"),
    Patch("vllm.v1.worker.dp_utils:_get_device_and_group", "the group the patched all-reduce uses",
          ("parallel_config",), does="calls"),
    Patch("vllm.v1.worker.gpu.dp_utils:sync_cudagraph_and_dp_padding", "Model Runner V2's "
          "per-forward DP sync: the lane's rows are all-reduced on its group just before it",
          ("cudagraph_manager", "desired_batch_desc", "num_tokens", "num_reqs",
           "uniform_token_count", "dp_size", "dp_rank", "max_query_len", "num_active_loras",
           "parallel_config", "allow_ubatching", "uniform_decode"), does="wraps", vllm=">=0.32"),
    Patch("vllm.v1.worker.gpu.dp_utils:get_dp_group", "the group Model Runner V2's DP sync "
          "all-reduces on (its `cpu_group`)", (), does="calls", vllm=">=0.32"),
    Patch("vllm.v1.worker.gpu.dp_utils:should_skip_dp_coordination", "a forward whose DP sync "
          "vLLM skips (elastic EP) carries no lane rows either", (), does="calls", vllm=">=0.32"),
]

_source: Callable[[], tuple[int, int]] | None = None
_last_rows: list[list[int]] | None = None  # rows 5 and 6 of the last all-reduce, on the host


def set_source(source: Callable[[], tuple[int, int]] | None) -> None:
    """What this rank contributes to the rows: (queued P tokens, decode rows). Every DP rank must
    set one (or none) at the same point of its start-up, before the forwards that follow: the
    tensors must match in shape."""
    global _source, _last_rows
    _source, _last_rows = source, None


def lane_rows() -> tuple[list[int], list[int]] | None:
    """Every DP rank's queued P tokens and decode rows as of the last forward's all-reduce (the
    same lists on every rank), or None before the first one."""
    return None if _last_rows is None else (_last_rows[0], _last_rows[1])


def install() -> None:
    """Patch the DP sync of both runners (only the one the engine's runner uses is called)."""
    _install_v1()
    if vllm_at_least("0.32"):
        _install_v2()


def _install_v2() -> None:
    from vllm.v1.worker.gpu import dp_utils

    if getattr(dp_utils.sync_cudagraph_and_dp_padding, "_ainfer_pd", False):
        return
    stock = dp_utils.sync_cudagraph_and_dp_padding

    @functools.wraps(stock)
    def sync_cudagraph_and_dp_padding(cudagraph_manager, desired_batch_desc, num_tokens,
                                      num_reqs, uniform_token_count, dp_size, dp_rank,
                                      *args, **kwargs):
        global _last_rows
        if _source is not None and not dp_utils.should_skip_dp_coordination():
            rows = torch.zeros(2, dp_size, dtype=torch.int32)
            rows[0][dp_rank], rows[1][dp_rank] = _source()
            torch.distributed.all_reduce(rows, group=dp_utils.get_dp_group().cpu_group)
            _last_rows = rows.tolist()
        return stock(cudagraph_manager, desired_batch_desc, num_tokens, num_reqs,
                     uniform_token_count, dp_size, dp_rank, *args, **kwargs)

    sync_cudagraph_and_dp_padding._ainfer_pd = True
    dp_utils.sync_cudagraph_and_dp_padding = sync_cudagraph_and_dp_padding


def _install_v1() -> None:
    from vllm.v1.worker import dp_utils

    if getattr(dp_utils._run_ar, "_ainfer_pd", False):
        return
    stock = dp_utils._run_ar

    def _run_ar(should_ubatch, orig_num_tokens_per_ubatch, padded_num_tokens_per_ubatch,
                cudagraph_mode, parallel_config):
        global _last_rows
        if _source is None:
            return stock(should_ubatch, orig_num_tokens_per_ubatch,
                         padded_num_tokens_per_ubatch, cudagraph_mode, parallel_config)
        dp_size = parallel_config.data_parallel_size
        dp_rank = parallel_config.data_parallel_rank
        device, group = dp_utils._get_device_and_group(parallel_config)
        tensor_cpu = torch.zeros(6, dp_size, dtype=torch.int32)
        tensor_cpu[0][dp_rank] = orig_num_tokens_per_ubatch
        tensor_cpu[1][dp_rank] = padded_num_tokens_per_ubatch
        tensor_cpu[2][dp_rank] = 1 if should_ubatch else 0
        tensor_cpu[3][dp_rank] = cudagraph_mode
        tensor_cpu[4][dp_rank], tensor_cpu[5][dp_rank] = _source()
        tensor = tensor_cpu.to(device, non_blocking=True)
        torch.distributed.all_reduce(tensor, group=group)
        host = tensor.cpu()  # the one read vLLM's post-processing makes anyway
        _last_rows = host[4:].tolist()
        return host[:4]  # vLLM's rows, as its post-processing expects them

    _run_ar._ainfer_pd = True
    dp_utils._run_ar = _run_ar
