"""Planning time against model depth and device count, printed as markdown tables.

Every device can hold every block, which is the planner's worst case (no start is ruled out by
memory). Run: `.venv/bin/python benchmarks/planner.py [--repeat N]`; each cell is the best of N runs.
"""

import argparse
import platform
import random
import time

from shardstream.pipeline.planner import Device, LayerCost, ModelCost, PlanOptions, plan

LAYERS = (8, 16, 32, 64, 80, 128, 160)
DEVICES = (1, 2, 4, 8, 16, 32)
GIB = 1024**3


def seconds_to_plan(num_layers: int, num_devices: int, objective: str, repeat: int) -> float:
    rng = random.Random(num_layers * 1000 + num_devices)
    model = ModelCost(
        [LayerCost(GIB, 2**17, 2e9 * rng.choice([1, 1, 4])) for _ in range(num_layers)],
        activation_bytes_per_token=16384,
        start_bytes=GIB,
        end_bytes=GIB,
        end_flops_per_token=2e9,
    )
    devices = [Device(f"d{k}", 10**6 * GIB, rng.uniform(10, 200), GIB) for k in range(num_devices)]
    options = PlanOptions(context_length=4096, objective=objective)
    runs = []
    for _ in range(repeat):
        start = time.perf_counter()
        plan(model, devices, options)
        runs.append(time.perf_counter() - start)
    return min(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    python = f"Python {platform.python_version()}, {platform.machine()}"
    print(f"Planning time in ms, best of {args.repeat}; {python}.")
    for objective in ("latency", "throughput"):
        print(f"\n**{objective}**\n")
        print("| layers \\ devices | " + " | ".join(map(str, DEVICES)) + " |")
        print("|---" * (len(DEVICES) + 1) + "|")
        for num_layers in LAYERS:
            cells = [seconds_to_plan(num_layers, d, objective, args.repeat) * 1e3 for d in DEVICES]
            print(f"| {num_layers} | " + " | ".join(f"{ms:.1f}" for ms in cells) + " |")


if __name__ == "__main__":
    main()
