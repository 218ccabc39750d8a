"""What an agent reports about its machine: capabilities, measured compute, round trips to peers."""

from __future__ import annotations

import os
import platform
import time

import httpx
import psutil
import torch

from ..memory import available_bytes


def capabilities(max_memory: int | None = None) -> dict:
    """What the machine offers; ram_available_bytes is what this agent may use (see memory.py)."""
    memory = psutil.virtual_memory()
    accelerators = [
        {"type": "cuda", "name": torch.cuda.get_device_name(i), "memory_bytes": torch.cuda.get_device_properties(i).total_memory}
        for i in range(torch.cuda.device_count())
    ]
    if torch.backends.mps.is_available():
        accelerators.append({"type": "mps", "name": "Apple GPU"})
    return {
        "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "ram_total_bytes": memory.total, "ram_available_bytes": available_bytes(max_memory),
        "host_ram_available_bytes": memory.available,
        "platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
        "accelerators": accelerators,
    }


def matmul_gflops(size: int, repeats: int) -> float:
    """Square float32 matmuls: the machine's peak-ish compute."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)  # warm-up: thread pool, caches
    started = time.perf_counter()
    for _ in range(repeats):
        torch.mm(a, b)
    return 2 * size**3 * repeats / (time.perf_counter() - started) / 1e9


def block_gflops(hidden: int, intermediate: int, tokens: int, repeats: int) -> float:
    """The matmuls of one transformer block (q, k, v, o; gate, up, down) on `tokens` tokens: at decode
    (one token) this is bound by memory bandwidth, which is what a generation step meets."""
    x, h = torch.randn(tokens, hidden), torch.randn(tokens, intermediate)
    square = [torch.randn(hidden, hidden) for _ in range(4)]
    wide = [torch.randn(hidden, intermediate) for _ in range(2)]
    down = torch.randn(intermediate, hidden)

    def block() -> None:
        for w in square:
            x @ w
        for w in wide:
            x @ w
        h @ down

    block()
    started = time.perf_counter()
    for _ in range(repeats):
        block()
    flops = 2 * tokens * (4 * hidden * hidden + 3 * hidden * intermediate) * repeats
    return flops / (time.perf_counter() - started) / 1e9


PROBE_LIMIT = 64 * 2**20


def ping(peers: list[str], headers: dict[str, str], timeout: float,
         probe_bytes: int = 0) -> tuple[dict[str, float | None], dict[str, float | None]]:
    """Per peer: the median round trip (seconds) of three health requests, and, with `probe_bytes`,
    the bandwidth (bytes/s) of fetching that many bytes from its `/v1/net/blob`, less one round
    trip. None where a peer is unreachable."""
    rtts: dict[str, float | None] = {}
    bandwidths: dict[str, float | None] = {}
    with httpx.Client(timeout=timeout, headers=headers) as client:
        for peer in peers:
            base = peer.rstrip("/")
            rtts[peer] = bandwidths[peer] = None
            try:
                samples = []
                for _ in range(3):
                    started = time.perf_counter()
                    client.get(base + "/v1/health").raise_for_status()
                    samples.append(time.perf_counter() - started)
                rtts[peer] = sorted(samples)[1]
                if probe_bytes:
                    started = time.perf_counter()
                    response = client.get(base + "/v1/net/blob", params={"size": probe_bytes})
                    response.raise_for_status()
                    elapsed = time.perf_counter() - started - rtts[peer]
                    bandwidths[peer] = len(response.content) / max(elapsed, 1e-6)
            except httpx.HTTPError:
                pass
    return rtts, bandwidths
