"""`PhaseEP`: the phase-owned expert-parallel state of one worker process, for the P lane.

Built once per process after vLLM loaded the model (vLLM's groups, kernels and, for DeepEP, D's
low-latency buffer exist; D's CUDA graphs are not captured yet), when the lane runs at DP > 1
with expert parallelism. Which state depends on vLLM's all-to-all backend:

- `allgather_reducescatter` / `naive`: D uses vLLM's EP and DP communicators, P its own
  (`PhaseGroups`).
- `deepep_low_latency` (`deepep_high_throughput` maps to it): D uses the low-latency buffer and
  kernels, P a normal-mode buffer (`PhaseBuffers`) and one kernel per layer (`kernels.py`).

The lane's contract (every call on the main thread unless said otherwise):
- `owns(group)` / `crossed(group)`: whether a collective on `group` is on P's own communicator,
  and if so whether it still needs D's stream (it crosses a D group);
- `open_epoch()`, `note_collective()` (P thread, for each collective on P's own state),
  `close_epoch(failed)`: a failed epoch that used P's state retires it (`retired`);
- `rebuild(drain, timeout_s=, rank=)`: collective over the world; every rank calls it at one
  agreed point, before P's next epoch, when any rank's state is retired;
- `close(timeout_s=, rank=)`: at shutdown, P's buffer and P's communicators destroyed.

Rebuild and close wait in calls that have no timeout of their own (a communicator's destroy and
re-creation over the world, DeepEP's device sync and NVLink barrier), exactly when a peer may be
gone; both run bounded (`bounded`): past `timeout_s` the error names the rank and the wait.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from vllm_ainfer_pd.deepep.buffers import (
    DeepEPSizes,
    PhaseBuffers,
    check_installed,
    import_deep_ep,
)
from vllm_ainfer_pd.deepep.phase_groups import PhaseGroups
from vllm_ainfer_pd.turnstile.errors import DrainTimeout
from vllm_ainfer_pd.vllm_glue import moe_phase

logger = logging.getLogger(__name__)

STATELESS_BACKENDS = ("allgather_reducescatter", "naive")
DEEPEP_BACKENDS = ("deepep_low_latency", "deepep_high_throughput")


def bounded(what: str, fn: Callable[[], None], timeout_s: float, rank: int) -> None:
    """Run `fn()` on a helper thread (on this thread's CUDA device) and wait for it at most
    `timeout_s`; `DrainTimeout` naming `rank` and `what` otherwise, and `fn`'s own error if it
    raised. On timeout the helper is left behind, stuck: nothing can cancel a device sync or a
    barrier whose peer is gone, and the error ends the engine."""
    import torch

    device = torch.cuda.current_device() if torch.cuda.is_initialized() else None
    outcome: list[BaseException | None] = []

    def body() -> None:
        try:
            if device is not None:
                torch.cuda.set_device(device)  # the CUDA device is per host thread
            fn()
            outcome.append(None)
        except BaseException as exc:  # handed to the waiting thread
            outcome.append(exc)

    helper = threading.Thread(target=body, name=f"ainfer-pd-recovery-{rank}", daemon=True)
    helper.start()
    helper.join(timeout_s)
    if helper.is_alive():
        raise DrainTimeout(f"waited for {what}", rank=rank, epoch=None,
                           detail=f"not done after {timeout_s:.3g} s (a peer gone mid-call?)")
    if outcome[0] is not None:
        raise outcome[0]


def needs_phase_ep(parallel_config) -> bool:
    """Whether P's MoE runs vLLM's all-to-all across DP ranks (then P needs its own state)."""
    return parallel_config.enable_expert_parallel and parallel_config.data_parallel_size > 1


def select_backend(parallel_config) -> None:
    """When the backend is selected with the lane on (before vLLM decides on CUDA graphs and
    builds anything): accept the all-to-all backends that have phase-owned state, refuse the
    others by name. Both DeepEP names select the pair, so D runs vLLM's low-latency backend (vLLM
    would turn CUDA graphs off for the high-throughput one); `deep_ep` must be installed."""
    from vllm_ainfer_pd.config import ConfigError

    if not needs_phase_ep(parallel_config):
        return
    backend = parallel_config.all2all_backend
    if backend in STATELESS_BACKENDS:
        return
    if backend in DEEPEP_BACKENDS:
        check_installed()
        parallel_config.all2all_backend = "deepep_low_latency"
        return
    raise ConfigError(
        f"ainfer_pd mode='pd' with expert parallelism over {parallel_config.data_parallel_size} "
        f"DP ranks runs P's MoE dispatch beside D's, and all2all_backend={backend!r} keeps "
        f"buffers both would share; use --all2all-backend allgather_reducescatter, "
        f"deepep_low_latency (phase-owned DeepEP) or mode='normal'")


class PhaseEP:
    def __init__(self, groups: PhaseGroups | None = None,
                 buffers: PhaseBuffers | None = None) -> None:
        self.groups = groups
        self.buffers = buffers
        self.kind = "deepep" if buffers is not None else "stateless"
        self.epoch_collectives = 0
        self.own_collectives = 0  # since start (exported as p_collectives_own)
        self.rebuilds = 0
        self._retired = False

    @classmethod
    def build(cls, vllm_config: Any, model: Any, p_deepep_sms: int,
              p_marker: Any) -> PhaseEP:
        """Collective over the world. `p_marker` is the thread-local the lane sets on its P
        thread (`phase_state._P`)."""
        from vllm.config import set_current_vllm_config

        moe_phase.set_marker(p_marker)
        backend = vllm_config.parallel_config.all2all_backend
        if backend in STATELESS_BACKENDS:
            with set_current_vllm_config(vllm_config):
                state = cls(groups=PhaseGroups.build())
            moe_phase.install_group_view(state.groups)
            logger.info("phase-owned expert parallelism (%s): P's own %s", backend,
                        state.groups.describe())
            return state
        if backend not in DEEPEP_BACKENDS:
            raise ValueError(f"no phase-owned state for all2all_backend={backend!r}")
        return cls._build_deepep(vllm_config, model, p_deepep_sms)

    @classmethod
    def _build_deepep(cls, vllm_config: Any, model: Any, p_sms: int) -> PhaseEP:
        import torch
        from vllm.distributed import get_ep_group

        from vllm_ainfer_pd.deepep import kernels
        from vllm_ainfer_pd.deepep.buffers import DeepEPUnavailable

        deep_ep = import_deep_ep()
        device_sms = torch.cuda.get_device_properties(torch.cuda.current_device())\
            .multi_processor_count
        if p_sms > device_sms:
            raise DeepEPUnavailable(f"ainfer_pd.p_deepep_sms={p_sms} is more than this device's "
                                    f"{device_sms} SMs")
        d_buffer = kernels.d_low_latency_buffer(model)
        methods = moe_phase.moe_quant_methods(model)
        d_kernel = methods[0][1].moe_kernel
        moe = d_kernel.fused_experts.moe_config
        sizes = DeepEPSizes.compute(
            deep_ep, ep_size=moe.moe_parallel_config.ep_size, hidden=moe.hidden_dim,
            num_experts=moe.num_experts, top_k=moe.experts_per_token, p_sms=p_sms,
            p_max_tokens=vllm_config.scheduler_config.max_num_batched_tokens,
            d_max_tokens=d_kernel.prepare_finalize.max_num_tokens_per_rank(),
            d_nvl_bytes=d_buffer.num_nvl_bytes)
        state = cls(buffers=PhaseBuffers(deep_ep, get_ep_group().cpu_group, sizes, d_buffer))
        layers = moe_phase.install_phase_kernels(
            model, kernels.make_p_kernel_factory(state.buffers, state.note_collective))
        logger.info("%s; %d MoE layers with a kernel per phase (device has %d SMs)",
                    sizes.describe(), layers, device_sms)
        return state

    # ---- the lane's calls ----------------------------------------------------------------------

    def owns(self, group: Any) -> bool:
        return self.groups is not None and self.groups.owns(group)

    def crossed(self, group: Any) -> bool:
        return self.groups is not None and self.groups.crossed(group)

    def open_epoch(self) -> None:
        self.epoch_collectives = 0

    def note_collective(self) -> None:
        self.epoch_collectives += 1
        self.own_collectives += 1

    def close_epoch(self, failed: bool) -> None:
        """A failed epoch that issued any call on P's own state retires it: this rank cannot
        tell whether its peers issued the same ones, and state with an unmatched call (a gloo
        pairing, an NCCL sequence, DeepEP's counters and NVLink ring) would meet the next
        epoch's first call half-advanced."""
        if failed and self.epoch_collectives:
            self._retired = True
            logger.warning("P's expert-parallel state (%s) retired: a failed epoch issued %d "
                           "calls on it; rebuilt on every rank before P's next epoch",
                           self.kind, self.epoch_collectives)
        self.epoch_collectives = 0

    @property
    def retired(self) -> bool:
        return self._retired

    def rebuild(self, drain: Callable[[], None] | None = None, *, timeout_s: float,
                rank: int) -> None:
        """Collective over the world (see the module docstring): `drain()` first (it bounds
        itself), then the destroy and re-creation, bounded by `timeout_s`."""
        if self.groups is not None:
            from vllm.config import get_current_vllm_config_or_none

            if get_current_vllm_config_or_none() is None:
                raise RuntimeError("PhaseEP.rebuild needs vLLM's current config")
        if drain is not None:
            drain()

        def rebuild() -> None:
            if self.groups is not None:
                self.groups.rebuild()
            if self.buffers is not None:
                self.buffers.rebuild()

        bounded(f"P's expert-parallel state ({self.kind}) to be destroyed and re-created on "
                f"every rank", rebuild, timeout_s, rank)
        self._retired = False
        self.rebuilds += 1

    def status(self) -> dict[str, Any]:
        return {"kind": self.kind, "own_collectives": self.own_collectives,
                "rebuilds": self.rebuilds, "retired": self._retired,
                "groups": self.groups.describe() if self.groups is not None else None,
                "sizes": self.buffers.sizes.describe() if self.buffers is not None else None}

    def close(self, *, timeout_s: float, rank: int) -> None:
        """At shutdown: P's buffer and P's communicators destroyed, bounded by `timeout_s` (a
        DeepEP destroy syncs the device and waits in an NVLink barrier for its peers)."""

        def destroy() -> None:
            if self.buffers is not None:
                self.buffers.destroy()
            if self.groups is not None:
                self.groups.destroy()

        bounded(f"P's expert-parallel state ({self.kind}) to be destroyed at shutdown", destroy,
                timeout_s, rank)
