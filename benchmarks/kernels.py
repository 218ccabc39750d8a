"""Products from bfloat16 weights on the CPU: stream/half_linear.py's kernel against torch's products.

Run: `PYTHONPATH=src .venv/bin/python benchmarks/kernels.py [--rounds 3] [--shapes mlp-up head] [--rows 1 7 64 512]
[--threads 1 --cpu-time]`. Prints the CPU's bfloat16 flags, then a markdown table per weight shape: for each row
count, the ms and GFLOP/s of each setting, the median of `--rounds` rounds (each the best of a few calls), and
the kernel's speed-up over torch's float32 product per round. A one-row product reads its weight from memory, as
a decode step does (each call multiplies another of copies of it 256 MB in all); more rows, bound by the
multiply-adds, reuse one copy. On a machine shared with other work, `--threads 1
--cpu-time` times each product by the CPU time of the one thread that runs it, which other processes do not
inflate (they still share the caches and memory).

Each setting runs in a worker process of its own, since torch reads the variables that pick its paths once:
- `avx512`: torch's AVX-512 kernels, oneDNN limited to AVX512_CORE (`ONEDNN_MAX_CPU_ISA`): torch's bfloat16
  product takes the path of a CPU without bfloat16 instructions;
- `native`: this CPU's own paths (its bfloat16 instructions, where it has them);
- `avx2`: torch, oneDNN and MKL limited to AVX2 (`ATEN_CPU_CAPABILITY=avx2`): an AVX2 CPU, the kernel's AVX2 build.
The workers are asked in turn, setting after setting, round after round, so drift hits them alike. Each
worker prints which path its products took: the kernel's build, and the oneDNN implementation that ran
torch's bfloat16 product (`ONEDNN_VERBOSE`), or none where torch did not call oneDNN.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

SHAPES = {   # Llama-3.2-1B's weights (out x in), and odd widths
    "mlp-up": (8192, 2048),
    "mlp-down": (2048, 8192),
    "q-o": (2048, 2048),
    "k-v": (512, 2048),
    "head": (128256, 2048),
    "odd": (3001, 1000),
}
HEAD_ROWS = (1, 7, 64)   # the head multiplies the last row of each sequence; 512 rows of it take minutes on the slow path
WORKERS = {
    "avx512": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"},
    "native": {},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
}
# Columns: (title, worker, product)
SETTINGS = [
    ("kernel, AVX-512", "avx512", "kernel"),
    ("torch float32", "avx512", "float32"),
    ("torch bf16, no bf16 ISA", "avx512", "bfloat16"),
    ("torch bf16, this CPU", "native", "bfloat16"),
    ("kernel, AVX2", "avx2", "kernel"),
    ("torch float32, AVX2", "avx2", "float32"),
    ("torch bf16, AVX2", "avx2", "bfloat16"),
]
MIN_SECONDS = 0.2   # each measurement repeats a product until this long, at most MAX_CALLS times
# A one-row product cycles through copies of its weight this large in all: each call reads its weight from
# memory, as a decode step does, not from the caches the previous call filled.
COLD_BYTES = 256 << 20
MAX_CALLS = 20
CPU_FLAGS = ("avx2", "f16c", "fma", "avx512f", "avx512bw", "avx512_bf16", "avx512_fp16", "amx_bf16")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 7, 64, 512])
    parser.add_argument("--settings", nargs="+", choices=[title for title, _, _ in SETTINGS],
                        default=[title for title, _, _ in SETTINGS])
    parser.add_argument("--threads", type=int, help="torch's threads in each worker (default: torch's choice)")
    parser.add_argument("--cpu-time", action="store_true", help="time by the thread's CPU time (with --threads 1)")
    parser.add_argument("--worker", choices=list(WORKERS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cpu_time and args.threads != 1:
        parser.error("--cpu-time measures one thread: add --threads 1")
    if args.worker:
        return serve(args.threads, time.thread_time if args.cpu_time else time.perf_counter)
    settings = [s for s in SETTINGS if s[0] in args.settings]
    options = [f"--threads={args.threads}"] * bool(args.threads) + ["--cpu-time"] * args.cpu_time
    workers = {name: start_worker(name, options) for name in dict.fromkeys(worker for _, worker, _ in settings)}
    print(f"{datetime.date.today()}, {cpu_name()}, {os.cpu_count()} cores, torch threads {workers_threads(workers)}, "
          f"{'CPU time of the thread' if args.cpu_time else 'wall time'}, Python {platform.python_version()}")
    print(f"CPU flags: {', '.join(flag for flag in CPU_FLAGS if flag in cpu_flags()) or 'none of ' + str(CPU_FLAGS)}")
    for name, worker in workers.items():
        info = worker["info"]
        print(f"- worker `{name}` ({' '.join(f'{k}={v}' for k, v in WORKERS[name].items()) or 'default environment'}): "
              f"torch capability {info['capability']}, kernel {info['kernel']}, torch bf16 product: {info['bf16_path']}")
    print(f"\nms per product, median of {args.rounds} rounds (each the best of up to {MAX_CALLS} calls) [GFLOP/s]; "
          "ratio: torch float32's time over the kernel's, same worker, per round (median, min-max)")
    for shape_name in args.shapes:
        out_features, in_features = SHAPES[shape_name]
        rows_list = [r for r in args.rows if shape_name != "head" or r in HEAD_ROWS]
        times: dict[tuple[int, str], list[float]] = {(rows, title): [] for rows in rows_list for title, _, _ in settings}
        for _ in range(args.rounds):
            for rows in rows_list:
                for title, worker, product in settings:
                    times[rows, title].append(ask(workers[worker], out_features, in_features, rows, product))
        print(f"\n**{shape_name}: {out_features} x {in_features}**\n")
        ratios = [(a, b) for a, b in (("kernel, AVX-512", "torch float32"), ("kernel, AVX2", "torch float32, AVX2"))
                  if a in args.settings and b in args.settings]
        print("| rows | " + " | ".join(title for title, _, _ in settings)
              + "".join(f" | {b} / {a}" for a, b in ratios) + " |")
        print("|---" * (1 + len(settings) + len(ratios)) + "|")
        for rows in rows_list:
            flops = 2 * rows * out_features * in_features
            cells = [f"{statistics.median(times[rows, t]) * 1e3:.3g} [{flops / statistics.median(times[rows, t]) / 1e9:.3g}]"
                     for t, _, _ in settings]
            for a, b in ratios:
                per_round = [slow / fast for slow, fast in zip(times[rows, b], times[rows, a])]
                cells.append(f"{statistics.median(per_round):.2f} ({min(per_round):.2f}-{max(per_round):.2f})")
            print(f"| {rows} | " + " | ".join(cells) + " |")
    for worker in workers.values():
        worker["process"].stdin.close()
        worker["process"].wait()


def start_worker(name: str, options: list[str]) -> dict:
    env = {**os.environ, **WORKERS[name]}
    process = subprocess.Popen([sys.executable, __file__, "--worker", name, *options], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, env=env)
    return {"process": process, "info": json.loads(process.stdout.readline())}


def ask(worker: dict, out_features: int, in_features: int, rows: int, product: str) -> float:
    process = worker["process"]
    process.stdin.write(json.dumps([out_features, in_features, rows, product]) + "\n")
    process.stdin.flush()
    return float(process.stdout.readline())


def workers_threads(workers: dict) -> str:
    return ", ".join(sorted({str(worker["info"]["threads"]) for worker in workers.values()}))


def serve(threads: int | None, clock) -> None:
    """A worker: reports its paths, then times the products asked on stdin, one line each, by `clock`."""
    import torch
    import torch.nn.functional as F

    from shardstream.stream import half_linear

    if threads:
        torch.set_num_threads(threads)
    weights: dict[tuple[int, int], dict[str, list[torch.Tensor]]] = {}

    def product(out_features: int, in_features: int, rows: int, kind: str):
        copies = max(1, -(-COLD_BYTES // (out_features * in_features * 2))) if rows == 1 else 1
        if (out_features, in_features) not in weights:
            weights.clear()   # one shape at a time in memory
            weights[out_features, in_features] = {"bfloat16": [], "float32": []}
        held = weights[out_features, in_features]   # made as asked for, kept for the shape's other row counts
        while len(held["bfloat16"]) < copies:
            held["bfloat16"].append(torch.empty(out_features, in_features, dtype=torch.bfloat16).normal_(0, 0.02))
        if kind == "float32":
            held["float32"] += [weight.float() for weight in held["bfloat16"][len(held["float32"]):copies]]
        x = torch.randn(rows, in_features)
        turn = itertools.cycle(range(copies))   # each call multiplies the copy read longest ago
        if kind == "kernel":
            return lambda: half_linear.linear(x, held["bfloat16"][next(turn)], None)
        if kind == "float32":
            return lambda: F.linear(x, held["float32"][next(turn)])
        x16 = x.to(torch.bfloat16)
        return lambda: F.linear(x16, held["bfloat16"][next(turn)])

    kernel = f"{torch.backends.cpu.get_cpu_capability()} build" if half_linear.available() else "off"
    print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(), "kernel": kernel,
                      "threads": torch.get_num_threads(), "bf16_path": onednn_path(torch, F)}), flush=True)
    for line in sys.stdin:
        run = product(*json.loads(line))
        run()
        calls, best, start = 0, float("inf"), time.perf_counter()
        while calls < MAX_CALLS and (calls == 0 or time.perf_counter() - start < MIN_SECONDS):
            began = clock()
            run()
            best = min(best, clock() - began)
            calls += 1
        print(best, flush=True)


def onednn_path(torch, F) -> str:
    """The oneDNN implementation(s) that ran a bfloat16 product of 1 and of 64 rows, from oneDNN's verbose
    lines on stdout (captured at the descriptor: they are C's), or a sentence saying torch did not call oneDNN."""
    weight = torch.randn(256, 512).to(torch.bfloat16)
    with tempfile.TemporaryFile(mode="w+") as capture:
        sys.stdout.flush()
        saved = os.dup(1)
        os.dup2(capture.fileno(), 1)
        try:
            with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
                for rows in (1, 64):
                    F.linear(torch.randn(rows, 512).to(torch.bfloat16), weight)
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
        capture.seek(0)
        lines = [line.split(",") for line in capture if line.startswith("onednn_verbose") and ",exec," in line]
    paths = [f"{fields[5]} {fields[6]}" for fields in lines if len(fields) > 6]
    return "oneDNN " + "; ".join(dict.fromkeys(paths)) if paths else "not oneDNN (torch's own kernels)"


def cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as info:
        return next((set(line.split(":", 1)[1].split()) for line in info if line.startswith("flags")), set())


def cpu_name() -> str:
    with open("/proc/cpuinfo") as info:
        return next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), platform.processor())


if __name__ == "__main__":
    main()
