"""TP export and per-rank load, expert placement and relocation, local and over HTTP, on a tiny store.

Run: `.venv/bin/python benchmarks/shard.py [--family mixtral] [--tp 4]`. Reports wall time and the
bytes each load moved, next to loading the whole part: a rank should move about 1/tp of it.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from http_server import serve_directory  # noqa: E402
from tiny_models import save_checkpoint  # noqa: E402

import shardstream  # noqa: E402
from shardstream.convert import convert  # noqa: E402
from shardstream.shard import export_tp, load_expert, load_tp, place_experts, relocate  # noqa: E402
from shardstream.store.remote import open_remote_store  # noqa: E402


def timed(label: str, action) -> None:
    started = time.perf_counter()
    action()
    print(f"{label:<40} {1000 * (time.perf_counter() - started):8.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--family", default="mixtral")
    parser.add_argument("--tp", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        root = Path(work) / "store"
        save_checkpoint(args.family, Path(work) / "src")
        convert(Path(work) / "src", root, progress=False)
        store = shardstream.open_store(root)
        timed(f"export_tp --tp {args.tp}", lambda: export_tp(store, args.tp))
        timed("load_tp mid/0 rank 0 (local)", lambda: load_tp(store, "mid/0", 0, args.tp))
        has_experts = any(r.expert is not None for r in store.manifest.tensors.values())
        if has_experts:
            tiers = {"hot": ".", "cold": str(Path(work) / "cold")}
            timed("place_experts (2 tiers)", lambda: place_experts(store, tiers))
            timed("relocate 0:1 hot -> cold", lambda: relocate(store, 0, 1, "cold"))
            timed("load_expert 0:1 (first read)", lambda: load_expert(store, 0, 1).tensors)
        with serve_directory(root) as (url, log):
            remote = open_remote_store(url)
            loads = [("load mid/0 (whole part, HTTP)", lambda: remote.load("mid/0")),
                     ("load_tp mid/0 rank 0 (HTTP)", lambda: load_tp(remote, "mid/0", 0, args.tp))]
            if has_experts:
                loads.append(("load_expert 0:0 (HTTP)", lambda: load_expert(remote, 0, 0).tensors))
            for label, action in loads:
                log.clear()
                timed(label, action)
                print(f"{'':<40} {sum(r.body_bytes for r in log):8,d} bytes in {len(log)} requests")


if __name__ == "__main__":
    main()
