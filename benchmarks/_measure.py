"""Measuring helpers shared by the benchmarks: cold caches, RSS, a memcap cgroup's peak, peak disk, raw disk
speed, tables.

Standard library only, so that a benchmark can run its children under another interpreter (a
throwaway venv holding a competitor) and still import this module.
"""

from __future__ import annotations

import os
import platform
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

MB = 1_000_000
_CHUNK = 8 * 1024 * 1024
# The environment the benchmark started with, captured when it first imports this module, before anything imports
# shardstream: `import shardstream` sets OMP_WAIT_POLICY=PASSIVE where it is unset, and a peer (llama.cpp,
# transformers, accelerate, AirLLM: OpenMP programs all) run in the environment after that would wait at its
# barriers as we do, not as it does by default (docs/BENCHMARKS.md, "Beside llama.cpp on the CPU").
STARTED_WITH = dict(os.environ)
OUR_WAIT_POLICY = "PASSIVE"   # what `import shardstream` sets where OMP_WAIT_POLICY is unset


def peer_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default this process's) for a peer: its OpenMP wait policy as the benchmark started with it (its own
    default unless the user set one)."""
    env = {name: value for name, value in (os.environ if env is None else env).items() if name != "OMP_WAIT_POLICY"}
    if "OMP_WAIT_POLICY" in STARTED_WITH:
        env["OMP_WAIT_POLICY"] = STARTED_WITH["OMP_WAIT_POLICY"]
    return env


def our_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default this process's) for a shardstream child: the wait policy `import shardstream` gives a user's
    process, set here since a child may load torch before it imports shardstream."""
    env = dict(os.environ if env is None else env)
    env["OMP_WAIT_POLICY"] = STARTED_WITH.get("OMP_WAIT_POLICY", OUR_WAIT_POLICY)
    return env


def openmp(env: dict[str, str]) -> str:
    """The OpenMP wait settings in `env`, as a benchmark's path line says them."""
    said = [f"{name}={env[name]}" for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if name in env]
    return " ".join(said) or "libgomp's defaults"


def our_openmp(env: dict[str, str]) -> str:
    """`openmp` for a shardstream child, and whose threads split its decode steps' products (stream/work_pool.h):
    its kernels' own where OpenMP's threads sleep, else OpenMP's."""
    from shardstream import openmp as policy
    from shardstream.switches import WORK_POOL

    own = env.get(WORK_POOL.name) != "0" and not policy.spins(env, torch_loaded=False)
    threads = "its kernels' own threads" if own else "OpenMP's threads"
    return f"{openmp(env)}, a decode step's products on {threads}"


def files_under(path: Path) -> list[Path]:
    path = Path(path)
    if path.is_file():
        return [path]
    return [Path(folder, name) for folder, _, names in os.walk(path) for name in names]


def tree_bytes(path: Path) -> int:
    """Apparent size (st_size) of every file under path: what a copy or a conversion reads."""
    return sum(f.stat().st_size for f in files_under(path))


def evict(path: Path) -> None:
    """Flush, then drop from the page cache, every file under path, so the next read hits the disk.

    fsync first: POSIX_FADV_DONTNEED silently keeps dirty pages.
    """
    for file in files_under(path):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cgroup_peak(reset: bool = False) -> int | None:
    """Peak bytes of the memcap cgroup this process runs in so far (page cache included), None outside one;
    `reset` starts the peak again from the current usage (cgroup v1, or v2 on Linux 6.12+)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        number, controllers, path = line.split(":", 2)
        v1 = "memory" in controllers.split(",")
        if v1 or (number == "0" and not controllers):
            file = (Path("/sys/fs/cgroup/memory") / path.lstrip("/") / "memory.max_usage_in_bytes" if v1
                    else Path("/sys/fs/cgroup") / path.lstrip("/") / "memory.peak")
            if file.exists() and "/memcap-" in path:
                peak = int(file.read_text())
                if reset:
                    file.write_text("0")
                return peak
    return None


def disk_usage(path: Path) -> int:
    """Bytes allocated (st_blocks) under path; files vanishing mid-walk are skipped, not fatal."""
    total = 0
    for folder, _, names in os.walk(path):
        for name in names:
            try:
                total += os.lstat(os.path.join(folder, name)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


class DiskSampler:
    """Samples disk_usage(path) in a thread every `interval` seconds and keeps the peak."""

    def __init__(self, path: Path, interval: float = 0.005):
        self.path, self.interval = Path(path), interval
        self.peak = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, disk_usage(self.path))
            self.samples += 1
            self._stop.wait(self.interval)

    def __enter__(self) -> "DiskSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, disk_usage(self.path))


@dataclass
class Timed:
    seconds: float   # wall time of the whole child process
    stdout: str


def run_timed(argv: list[str], cwd: Path | None = None) -> Timed:
    """Run a command (stderr passed through, stdout captured); fail loudly if it fails."""
    started = time.perf_counter()
    done = subprocess.run(argv, cwd=cwd, stdout=subprocess.PIPE, text=True, check=True)
    return Timed(time.perf_counter() - started, done.stdout)


def memory_of_self() -> tuple[int, int]:
    """(current RSS, peak RSS) in bytes of this process, from /proc/self/status.

    Not ru_maxrss: Linux carries the parent's high-water mark across fork + exec, so a child
    started by a 500 MB parent reports at least 500 MB. VmHWM belongs to the new address space.
    """
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) * 1024
    return fields["VmRSS"], fields["VmHWM"]


def disk_speed(folder: Path, nbytes: int) -> tuple[float, float]:
    """(write MB/s with fsync, cold read MB/s) of one sequential nbytes file; the file is removed.

    The data is random so that a compressing or deduplicating disk cannot flatter the result.
    """
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "disk-probe.bin"
    block = os.urandom(_CHUNK)
    try:
        started = time.perf_counter()
        with open(path, "wb", buffering=0) as handle:
            for offset in range(0, nbytes, _CHUNK):
                handle.write(block[: min(_CHUNK, nbytes - offset)])
            os.fsync(handle.fileno())
        write = nbytes / (time.perf_counter() - started) / MB
        evict(path)
        buffer = bytearray(_CHUNK)
        started = time.perf_counter()
        with open(path, "rb", buffering=0) as handle:
            while handle.readinto(buffer):
                pass
        read = nbytes / (time.perf_counter() - started) / MB
    finally:
        path.unlink(missing_ok=True)
    return write, read


def cpu_model() -> str:
    """The CPU's marketing name (platform.processor() is empty on most Linux systems)."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def cpu_times() -> list[int]:
    """The machine's CPU time counters (the `cpu` line of /proc/stat), or [] where there is none."""
    try:
        return [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError):
        return []


def stolen_share(before: list[int], after: list[int]) -> float:
    """Share of CPU time the hypervisor gave to other guests between two `cpu_times()` (its 8th counter,
    `steal`; 0 on bare metal): a compute-bound run slows by about that much, so runs with different
    steal are not comparable."""
    spent = [b - a for a, b in zip(before, after)]
    return spent[7] / sum(spent) if len(spent) > 7 and sum(spent) else 0.0


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)
