"""Which host a rank runs on, for grouping the ranks that can share memory."""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence

HOST_ID_ENV = "VLLM_AINFER_PD_HOST_ID"


def host_identity() -> str:
    """This rank's host, for grouping ranks that can share memory: `$VLLM_AINFER_PD_HOST_ID`
    when set (e.g. to run several "hosts" on one machine), else the hostname with the boot id
    and the device of /dev/shm, where readable."""
    override = os.environ.get(HOST_ID_ENV, "").strip()
    if override:
        return override
    # A hostname alone can repeat across machines (cloned images, pods on the host network) and
    # two containers on one machine may each have their own /dev/shm; the boot id tells machines
    # apart and /dev/shm's device the shared-memory filesystems of one machine.
    parts = []
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f"boot {f.read().strip()[:8]}")
    except OSError:
        pass
    try:
        dev = os.stat("/dev/shm").st_dev
        parts.append(f"/dev/shm {os.major(dev)}:{os.minor(dev)}")
    except OSError:
        pass
    name = socket.gethostname()
    return f"{name} ({', '.join(parts)})" if parts else name


def by_host(hosts: Sequence[str]) -> list[tuple[str, list[int]]]:
    """(host, its ranks ascending) for each host of `hosts` (one identity per rank), hosts in the
    order of their lowest rank."""
    out: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        out.setdefault(host, []).append(rank)
    return list(out.items())


def ranks_text(ranks: Sequence[int]) -> str:
    """Ranks as runs, e.g. [0, 1, 2, 5] -> "0-2, 5"."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
