"""Mixture-of-experts from disk: experts on demand against the floor of the bytes they read, and what the
expert cache saves.

A random checkpoint with a real MoE config (`--shape qwen3-30b-a3b`: 128 experts, 8 routed, expert width 768,
vocab 151936; at `--layers` depth), written shard by shard by scripts/real_shapes.py, converted to a bf16
store and a 4-bit one (`--stores`), each with its experts placed apart (`shardstream shard --experts`).
Per round (`--repeat`): the cold read speed of the store's files (best of several sequential readers, as
benchmarks/stream.py measures it), then each store and each cache setting (`--caches`) in its own process
under `memcap CAP --cold STORE`:
- frequency: the default cache (experts kept by decayed routing counts, expert_cache.py),
- lru: the same budget kept by recency alone (half-life 0),
- none: `max_expert_memory=0`, every routed expert read on every pass;
and each with the reads ahead of the router on and off (`--guesses on,off`: the next block's likely experts
read while this one runs, stream/experts.py; off, every read waits for its router).
The cache's budget is one eighth of the store's experts' bytes (`max_expert_memory`), the cap holds it and
everything else. A `--prompt`-token random prompt repeated 4 times, then `--new-tokens` greedy decode steps
with the KV cache. Reported per decode step: bytes read (the streamed blocks without their experts, the
experts read, and the head when streamed), the hit rate of routings served from memory, decode tok/s and its
ratio to the floor (those bytes at the cold read speed of the same round), and the path the products took
(`--mask-bf16`: as on a CPU without bf16 instructions, bf16 weights multiplied in float32).
Run: `.venv/bin/python benchmarks/moe.py [--shape qwen3-30b-a3b] [--layers 4] [--repeat 2]` (root, for memcap).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from _measure import cpu_model, markdown_table  # noqa: E402
from real_shapes import SHAPES, write_checkpoint  # noqa: E402
from stream import MASKED_BF16, MEMCAP, bf16_flags  # noqa: E402

CACHES = {"frequency": "decayed routing counts (default)", "lru": "least recently used", "none": "no cache"}


def build(args) -> dict[str, Path]:
    """The checkpoint and a store of it per `--stores` kind, each with its experts placed apart; made once."""
    from shardstream.convert import convert
    from shardstream.shard import place_experts
    from shardstream.store import open_store

    scaled = f"-r{args.residual_scale:g}" if args.residual_scale != 1 else ""
    work = Path(args.workdir) / f"{args.shape}-l{args.layers}{scaled}"
    ckpt = work / "ckpt"
    if not (ckpt / "config.json").exists():
        write_checkpoint(args.shape, ckpt, args.layers, residual_scale=args.residual_scale)
    stores = {}
    for kind in filter(None, args.stores.split(",")):
        store = work / f"store-{kind}"
        if not (store / "manifest.json").exists():
            convert(ckpt, store, compression=None if kind == "bf16" else kind, progress=False)
        if not (store / "sharding.json").exists():
            place_experts(open_store(store), {"hot": "."})
        stores[kind] = store
    return stores


def run_one(store_path: Path, cache: str, guesses: str, args) -> dict:
    """One setting, in this (capped) process: prefill, then greedy decode steps; JSON on stdout."""
    import torch

    import shardstream.stream.experts as experts
    from shardstream.store import open_store
    from shardstream.stream import StreamingModel

    if cache == "lru":
        experts.HALF_LIFE = 0
    store = open_store(store_path)
    expert_bytes = experts_bytes(store_path)
    budget = 0 if cache == "none" else expert_bytes // 8
    started = time.perf_counter()
    model = StreamingModel(store, experts="on_demand", max_expert_memory=budget)
    model.experts.guessing = guesses == "on"
    load = time.perf_counter() - started
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, store.config["vocab_size"], (1, args.prompt), generator=generator).repeat(1, 4)
    with torch.no_grad():
        started = time.perf_counter()
        out = model(ids, use_cache=True)
        prefill = time.perf_counter() - started
        past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        blocks, experts_read, stats = model.bytes_read, model.experts.bytes_read, model.experts.cache.stats
        hits, misses = stats.hits, stats.misses
        guessed = model.experts.guesses
        made, right, wasted = guessed.made, guessed.right, guessed.wasted_bytes
        started = time.perf_counter()
        for _ in range(args.new_tokens):
            out = model(token, past_key_values=past, use_cache=True)
            past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        decode = time.perf_counter() - started
    head = model.report().streamed_head_bytes
    steps = args.new_tokens
    routings = stats.hits - hits + stats.misses - misses
    return {"load_s": load, "prefill": ids.shape[1] / prefill, "decode": steps / decode,
            "block_bytes": (model.bytes_read - blocks) // steps, "expert_bytes": (model.experts.bytes_read - experts_read) // steps,
            "head_bytes": head, "hit_rate": (stats.hits - hits) / routings if routings else 0.0,
            "budget": model.experts.budget, "experts_total": expert_bytes, "resident": len(model.resident_blocks),
            "guesses": guessed.made - made, "guessed_right": guessed.right - right,
            "wasted_bytes": (guessed.wasted_bytes - wasted) // steps,
            "compute": str(model.model.dtype).removeprefix("torch.")}


def experts_bytes(store_path: Path) -> int:
    """The bytes of the store's placed experts (each its own, not its container's): an eighth of them is the
    cache's budget here."""
    from shardstream.shard import load_index
    from shardstream.store import open_store

    return sum(record.length for record in load_index(open_store(store_path)).experts.values())


def child(args, store: Path, cache: str, guesses: str) -> dict | str:
    command = [str(MEMCAP), args.cap, "--cold", str(store), "--", sys.executable, __file__, "--run", str(store), cache, guesses,
               "--shape", args.shape, "--layers", str(args.layers), "--prompt", str(args.prompt),
               "--new-tokens", str(args.new_tokens)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    if run.returncode != 0:
        lines = [line for line in run.stderr.strip().splitlines() if not line.startswith("memcap:")] or ["?"]
        return "killed (out of memory)" if run.returncode in (-9, 137) else f"failed: {lines[-1][:160]}"
    result = json.loads(run.stdout.strip().splitlines()[-1])
    peak = [line for line in run.stderr.splitlines() if line.startswith("memcap:")]
    result["peak"] = peak[-1].split("peak ")[1].split(",")[0] if peak else "?"
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--stores", default="bf16,4bit", help="store kinds: bf16, 4bit, 8bit, int4")
    parser.add_argument("--caches", default="frequency,lru,none", help=f"cache settings: {', '.join(CACHES)}")
    parser.add_argument("--guesses", default="on,off", help="reads ahead of the router: on, off or both")
    parser.add_argument("--residual-scale", type=float, default=1.0,
                        help="scale of the projections writing to the residual stream (scripts/real_shapes.py): "
                             "below 1 each block changes the hidden state little, as in a trained model, so the next "
                             "block's router, run on this block's hidden state, picks what it will pick")
    parser.add_argument("--cap", default="2000M", help="memcap limit, page cache included")
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens, repeated 4 times")
    parser.add_argument("--new-tokens", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--timeout", type=int, default=1800)
    parser.add_argument("--workdir", default="artifacts/bench-moe")
    parser.add_argument("--mask-bf16", action="store_true",
                        help="run every child as on a CPU without bf16 instructions (benchmarks/stream.py's switch)")
    parser.add_argument("--run", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mask_bf16:
        os.environ.update(MASKED_BF16)   # inherited by every child
    if args.run:
        print(json.dumps(run_one(Path(args.run[0]), args.run[1], args.run[2], args)))
        return
    stores = build(args)
    print(f"Command: `{' '.join(['.venv/bin/python', 'benchmarks/moe.py', *sys.argv[1:]])}`; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.\n\n{bf16_flags()}\n")
    rows = []
    for round_ in range(1, args.repeat + 1):
        for kind, store in stores.items():
            speed = child_speed(store, args)
            for cache, guesses in [(c, g) for c in args.caches.split(",") for g in args.guesses.split(",")]:
                result = child(args, store, cache, guesses)
                print(f"round {round_} {kind} {cache} guesses {guesses}: {result}", file=sys.stderr, flush=True)
                if isinstance(result, str):
                    rows.append([str(round_), kind, CACHES[cache], guesses, result] + [""] * 10)
                    continue
                per_token = result["block_bytes"] + result["expert_bytes"] + result["head_bytes"]
                floor = speed / per_token
                rows.append([str(round_), kind, CACHES[cache], guesses, f"{result['decode']:.2f}", f"{floor:.2f}",
                             f"{result['decode'] / floor:.2f}x", f"{per_token / 1e6:.0f} ({result['expert_bytes'] / 1e6:.0f})",
                             f"{result['hit_rate']:.1%}", f"{result['guessed_right']} / {result['guesses']}",
                             f"{result['wasted_bytes'] / 1e6:.0f}",
                             f"{result['budget'] >> 20} / {result['experts_total'] >> 20}",
                             f"{speed / 1e9:.2f}", result["peak"], result["compute"]])
    scale = f" (the residual stream's writers scaled by {args.residual_scale:g})" if args.residual_scale != 1 else ""
    print(f"{args.shape} shape, {args.layers} blocks, random weights{scale}, under memcap {args.cap} (cold); a {args.prompt}-token "
          f"prompt repeated 4 times, {args.new_tokens} greedy decode steps; {cpu_model()}.\n")
    print(markdown_table(["round", "store", "expert cache", "reads ahead of the router", "decode tok/s", "floor tok/s",
                          "/ floor", "MB read a step (of which experts)", "routings served from memory",
                          "guesses right / made (decode)", "MB read a step for wrong guesses",
                          "cache budget / experts MiB", "cold read GB/s", "cgroup peak", "computes in"], rows))


def child_speed(store: Path, args) -> float:
    """The best cold sequential read of the store's files (its parts and its expert containers, which hold most of
    what a decode step reads), measured under the same cap."""
    files = sorted([*store.rglob("*.safetensors"), *(p for p in (store / "experts").rglob("*") if p.is_file())])
    script = ("import json, sys; sys.path.insert(0, %r); from stream import read_speed; from pathlib import Path; "
              "print(json.dumps(read_speed([Path(p) for p in sys.argv[1:]])['speed']))" % str(Path(__file__).parent))
    run = subprocess.run([str(MEMCAP), args.cap, "--", sys.executable, "-c", script, *map(str, files)],
                         capture_output=True, text=True, timeout=args.timeout, check=True)
    return float(run.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
