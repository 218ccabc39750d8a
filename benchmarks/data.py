"""Training-data benchmark: tracker claims per second, and samples per second delivered to training.

    .venv/bin/python benchmarks/data.py [--chunks 4000] [--samples 200000] [--postgres URL]

Claims: N processes each loop claim -> complete over pre-registered chunks, all starting at one
instant (after all have started and connected); the figure is completed claims over wall time. Without --postgres a throwaway server is
started (tests/conftest_data.py). Loader: the same JSON-lines corpus read (a) by BlockManager into
chunks, cold (blocks built) and warm (cache), (b) by HF datasets streaming, (c) by a plain loop of
json.loads. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import nullcontext
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from conftest_data import sample_texts, throwaway_postgres  # noqa: E402

from shardstream.data.blocks import BlockManager  # noqa: E402
from shardstream.data.tracker import open_tracker  # noqa: E402

CLAIMER = """
import sys, time
from shardstream.data.tracker import open_tracker
with open_tracker(sys.argv[1]) as tracker:
    print("ready", flush=True)
    sys.stdin.readline()
    n = 0
    while (claim := tracker.claim("w", 60)) is not None:
        tracker.complete(claim, 1, 1)
        n += 1
print(n, time.time())
"""


def claims_per_second(url: str, chunks: int, processes: int) -> float:
    """All processes start up and connect first; the clock runs from one "go" to the last finish."""
    with open_tracker(url) as tracker:
        tracker.setup("bench", chunks, 1)
        tracker.register_block(0, chunks, is_last=True)
    procs = [subprocess.Popen([sys.executable, "-c", CLAIMER, url], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for _ in range(processes)]
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    start = time.time()
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    results = [p.communicate()[0].split() for p in procs]
    done = sum(int(r[0]) for r in results)
    assert done == chunks, (done, chunks)
    return done / (max(float(r[1]) for r in results) - start)


def loader_rates(corpus: Path, cache: Path, chunk_size: int) -> dict[str, float]:
    import datasets

    rates = {}
    for label in ("shardstream BlockManager, cold (builds blocks)", "shardstream BlockManager, warm cache"):
        blocks = BlockManager(str(corpus), cache, samples_per_block=100_000, chunk_size=chunk_size)
        start, n, b = time.perf_counter(), 0, 0
        while (info := blocks.block(b)) is not None:
            n += sum(len(blocks.chunk(b, c)) for c in range(info.chunk_count(chunk_size)))
            b += 1
        rates[label] = n / (time.perf_counter() - start)
    start = time.perf_counter()
    n = sum(1 for _ in datasets.load_dataset("json", data_files=str(corpus), split="train", streaming=True))
    rates["HF datasets streaming (json)"] = n / (time.perf_counter() - start)
    start = time.perf_counter()
    with corpus.open() as f:
        n = sum(1 for line in f if json.loads(line)["text"])
    rates["plain loop: json.loads per line"] = n / (time.perf_counter() - start)
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=4000)
    parser.add_argument("--samples", type=int, default=200_000)
    parser.add_argument("--postgres", help="server URL without a database; default: start a throwaway one")
    args = parser.parse_args()
    import psycopg

    rows = []
    with tempfile.TemporaryDirectory() as tmp, (nullcontext(args.postgres) if args.postgres else throwaway_postgres()) as server:
        for processes in (2, 8):
            rows.append(("SQLite (WAL)", processes, claims_per_second(f"sqlite:///{tmp}/bench-{processes}.sqlite", args.chunks, processes)))
            db = f"bench_{uuid.uuid4().hex[:8]}"
            with psycopg.connect(f"{server}/postgres", autocommit=True) as conn:
                conn.execute(f"CREATE DATABASE {db}")
            rows.append(("PostgreSQL", processes, claims_per_second(f"{server}/{db}", args.chunks, processes)))
        corpus = Path(tmp) / "corpus.jsonl"
        corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in sample_texts(args.samples)))
        rates = loader_rates(corpus, Path(tmp) / "cache", 4000)
    print(f"| tracker backend | processes | claims/s (claim + complete, {args.chunks} chunks) |")
    print("|---|---|---|")
    for backend, processes, rate in rows:
        print(f"| {backend} | {processes} | {rate:,.0f} |")
    print(f"\n| loader ({args.samples:,} JSON-lines samples, chunks of 4000) | samples/s |")
    print("|---|---|")
    for label, rate in rates.items():
        print(f"| {label} | {rate:,.0f} |")


if __name__ == "__main__":
    main()
