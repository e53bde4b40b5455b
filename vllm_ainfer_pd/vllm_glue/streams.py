"""vLLM's per-process compute stream, replaced by one at CUDA's highest priority (GPU).

`vllm.utils.torch_utils.current_stream()` is the stream vLLM captures and replays D's CUDA graphs
on and issues the step's eager kernels to (what the P lane calls D's stream). vLLM tracks it in a
thread-local that its own wrapper of `torch.cuda.set_stream` writes, so setting a new stream
through that wrapper makes `current_stream()` return it from then on.
"""

from __future__ import annotations

from vllm_ainfer_pd.vllm_glue.shapes import Patch

PATCHES = [
    Patch("vllm.utils.torch_utils:current_stream", "with `d_stream_priority=\"high\"` D's kernels "
          "and graph replays go to a stream at CUDA's highest priority; P's stream keeps the "
          "lowest", (), does="replaces the stream returned by"),
    Patch("vllm.utils.torch_utils:_current_stream_tls", "vLLM's `torch.cuda.set_stream` wrapper "
          "records the new stream there, which `current_stream()` then returns", does="relies on"),
]


def raise_compute_stream_priority() -> None:
    """Replace vLLM's per-process compute stream with one at CUDA's highest priority. Called
    before vLLM loads the model and captures its graphs, so everything after runs there; a graph
    replays with the priority of the stream it launches on."""
    import torch
    from vllm.utils.torch_utils import current_stream

    previous = current_stream()
    _, highest = torch.cuda.Stream.priority_range()
    stream = torch.cuda.Stream(priority=highest)
    stream.wait_stream(previous)  # whatever vLLM queued so far stays ahead
    torch.cuda.set_stream(stream)  # vLLM's patched setter: its current_stream() returns this one
