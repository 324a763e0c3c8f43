"""The host memory a batch may take: what this process can still allocate, read from the cgroup
(v2 `memory.max` - `memory.current`, or v1's limit - usage: a Kubernetes sidecar's limit) and from
/proc/meminfo's MemAvailable, whichever is smaller. The batcher bounds a CPU runtime's batches by a
share of it (issue 32, point 6: one Score batch of 8,192 tokens on the CPU raised the peak RSS from
0.7 to 5.0 GB); on a GPU the CUDA graphs' memory is taken at capture, before serving."""

from __future__ import annotations

import math
from pathlib import Path

CGROUP_FILES = (("sys/fs/cgroup/memory.max", "sys/fs/cgroup/memory.current"),  # v2
                ("sys/fs/cgroup/memory/memory.limit_in_bytes", "sys/fs/cgroup/memory/memory.usage_in_bytes"))  # v1


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text(errors="replace")[:64].strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def available_memory_bytes(root: str | Path = "/") -> float:
    """Bytes this process may still allocate (inf when nothing says)."""
    root = Path(root)
    free = math.inf
    for limit_file, usage_file in CGROUP_FILES:
        limit, usage = _read_int(root / limit_file), _read_int(root / usage_file)
        if limit is not None and usage is not None and limit < 1 << 60:  # v1's "no limit" is ~2^63
            free = min(free, max(limit - usage, 0))
            break
    try:
        for line in (root / "proc/meminfo").read_text(errors="replace").splitlines()[:64]:
            if line.startswith("MemAvailable:"):
                free = min(free, int(line.split()[1]) * 1024)
                break
    except (OSError, ValueError, IndexError):
        pass
    return free
