"""The memory this process may really use: the host's available RAM, capped by its cgroup (as
Docker, Kubernetes and `memcap` set one) and by an explicit limit. Shared by the streaming runtime's
budgets and the pipeline agent's report: the host's RAM inside a 700 MiB container is a lie that
ends with the kernel killing the process. On a GPU, what is free on the GPU instead.
"""

from __future__ import annotations

from pathlib import Path

import psutil

CGROUP_ROOT = Path("/sys/fs/cgroup")


def available_bytes(max_memory: int | None = None, proc_cgroup: Path = Path("/proc/self/cgroup"),
                    root: Path = CGROUP_ROOT) -> int:
    """min(host available, cgroup limit minus usage at every level of this process's cgroup, max_memory)."""
    limits = [psutil.virtual_memory().available, *cgroup_headroom(proc_cgroup, root)]
    if max_memory is not None:
        limits.append(max_memory)
    return max(0, min(limits))


def available_memory() -> tuple[int, bool]:
    """RAM this process may still use, and whether a cgroup (container) cap set it."""
    host = psutil.virtual_memory().available
    headroom = min(cgroup_headroom(), default=host)
    return (max(0, headroom), True) if headroom < host else (host, False)


def gpu_free_bytes(device) -> int:
    """Bytes still free on a CUDA device for this process: what the driver reports free plus what torch's
    caching allocator holds without using (the driver counts that as taken)."""
    import torch

    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def cgroup_headroom(proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = CGROUP_ROOT) -> list[int]:
    """Limit minus usage for each memory-limited cgroup from this process's up to the root (v1 or v2).
    Usage leaves out the inactive file pages (clean page cache the kernel reclaims before it kills
    anything), as Kubernetes' working set does: a cgroup that read a store through the page cache
    is otherwise "full" of cache it can drop."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return []
    for line in lines:   # "ID:controllers:path"; v2 is "0::path"
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return _headroom(root / "memory", path, "memory.limit_in_bytes", "memory.usage_in_bytes",
                             "total_inactive_file")
    v2 = [path for _, controllers, path in (line.split(":", 2) for line in lines) if controllers == ""]
    if v2 and (root / "cgroup.controllers").is_file():
        return _headroom(root, v2[0], "memory.max", "memory.current", "inactive_file")
    return []


def _headroom(mount: Path, path: str, limit_file: str, usage_file: str, inactive_key: str) -> list[int]:
    found, folder = [], mount / path.lstrip("/")
    if not folder.is_dir():   # a cgroup namespace: our own cgroup is the mount's root
        folder = mount
    while True:
        limit, usage = _read_int(folder / limit_file), _read_int(folder / usage_file)
        if limit is not None and usage is not None and limit < 2**60:   # v1 writes "no limit" as ~2**63
            found.append(limit - max(0, usage - _stat(folder / "memory.stat", inactive_key)))
        if folder == mount:
            return found
        folder = folder.parent


def _stat(file: Path, key: str) -> int:
    """One counter of a cgroup's memory.stat; 0 when it (or the file) is missing."""
    try:
        lines = file.read_text().splitlines()
    except OSError:
        return 0
    return next((int(line.split()[1]) for line in lines if line.startswith(key + " ")), 0)


def _read_int(file: Path) -> int | None:
    try:
        text = file.read_text().strip()
    except OSError:
        return None
    return None if text == "max" else int(text)
