"""Streaming inference speed against the I/O floor and the alternatives, as a markdown table.

A synthetic Llama-shaped fp32 model (random weights; size set by --hidden/--layers/--vocab) is
saved as a checkpoint and converted to a store. Each setting runs in its own process: a prompt of
--prompt tokens (prefill tokens/s), then --new-tokens single-token steps with the KV cache (decode
tokens/s). "cold" runs go through `memcap LIMIT --cold PATH` (see docs/DESIGN.md, "Measuring larger
than memory"): the page cache is emptied of the files first and capped with the process, so every
token reads its blocks from disk. The I/O floor is the bytes streamed per token divided by the
measured cold sequential read speed of those files.

Run: `.venv/bin/python benchmarks/stream.py [--hidden 2048 --layers 7]` (needs root for memcap).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

MEMCAP = Path(__file__).resolve().parents[1].parent / "shared" / "tools" / "memcap"
MB = 1e6


def build(args) -> tuple[Path, Path]:
    """Checkpoint and store under --workdir, made once and reused."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardstream.convert import convert

    work = Path(args.workdir) / f"llama-h{args.hidden}-l{args.layers}-v{args.vocab}"
    ckpt, store = work / "ckpt", work / "store"
    if not (ckpt / "config.json").exists():
        config = AutoConfig.for_model(
            "llama", hidden_size=args.hidden, intermediate_size=int(args.hidden * 2.75) // 64 * 64,
            num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
            num_key_value_heads=args.hidden // 64, vocab_size=args.vocab, max_position_embeddings=2048,
            tie_word_embeddings=False,
        )
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(ckpt, max_shard_size="500MB")
    if not (store / "manifest.json").exists():
        convert(ckpt, store, progress=False)
    return ckpt, store


# -- one setting, in its own process -------------------------------------------------------------

def open_backend(mode: str, ckpt: Path, store: Path, work: Path):
    import torch
    from transformers import AutoModelForCausalLM

    if mode in ("stream", "resident"):
        from shardstream.stream import AutoModel

        return AutoModel.from_pretrained(store, max_resident_memory=0 if mode == "stream" else "auto")
    if mode == "memory":
        return AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    if mode == "accelerate":
        from transformers import AutoConfig

        layers = AutoConfig.from_pretrained(ckpt).num_hidden_layers
        device_map = {"model.embed_tokens": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu",
                      **{f"model.layers.{i}": "disk" for i in range(layers)}}
        return AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, device_map=device_map,
                                                    offload_folder=str(work / "offload")).eval()
    raise SystemExit(f"unknown mode {mode}")


def run_one(mode: str, args) -> dict:
    import torch

    ckpt, store = build(args)
    model = open_backend(mode, ckpt, store, ckpt.parent)
    ids = torch.randint(3, args.vocab, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        started = time.perf_counter()
        out = model(ids, use_cache=True)
        prefill = time.perf_counter() - started
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        started = time.perf_counter()
        for _ in range(args.new_tokens):
            out = model(token, past_key_values=cache, use_cache=True)
            cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        decode = time.perf_counter() - started
    result = {"prefill": args.prompt / prefill, "decode": args.new_tokens / decode}
    if mode in ("stream", "resident"):
        result["hidden"] = model.profile.hidden_share
        result["resident"] = len(model.resident_blocks)
        times = model.profile.total
        result["read_vs_compute"] = times.read / times.compute if times.compute else 0.0
    return result


def read_speed(paths: list[Path]) -> float:
    """Sequential read speed in bytes/s (run cold under memcap)."""
    started, total = time.perf_counter(), 0
    for path in paths:
        with open(path, "rb", buffering=0) as handle:
            while chunk := handle.read(16 << 20):
                total += len(chunk)
    return total / (time.perf_counter() - started)


# -- the driver ---------------------------------------------------------------------------------

def child(args, *extra: str, cap: int | None = None, cold: Path | None = None, timeout: int = 900) -> dict | str:
    command = [sys.executable, __file__, *extra, "--hidden", str(args.hidden), "--layers", str(args.layers),
               "--vocab", str(args.vocab), "--prompt", str(args.prompt), "--new-tokens", str(args.new_tokens),
               "--workdir", args.workdir]
    if cap:
        command = [str(MEMCAP), str(cap), *(["--cold", str(cold)] if cold else []), "--", *command]
    try:
        run = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"timeout ({timeout} s)"
    if run.returncode != 0:
        killed = run.returncode in (-9, 137)
        return "killed (out of memory)" if killed else f"failed: {run.stderr.strip().splitlines()[-1][:120]}"
    return json.loads(run.stdout.strip().splitlines()[-1])


def airllm_status() -> str:
    try:
        import airllm  # noqa: F401
    except ImportError:
        return "not installed (AirLLM targets CUDA and pins old transformers versions; it does not run on this CPU-only setup)"
    return "installed but not benchmarked: AirLLM's runtime requires CUDA"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=7)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--workdir", default="artifacts/bench-stream")
    parser.add_argument("--cap", type=int, default=None, help="memcap limit in bytes (default: torch overhead + resident parts + 2.5 blocks)")
    parser.add_argument("--skip", default="", help="comma-separated settings to leave out, e.g. memory-cold")
    parser.add_argument("--run", help=argparse.SUPPRESS)
    parser.add_argument("--read", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.run:
        print(json.dumps(run_one(args.run, args)))
        return
    ckpt, store = build(args)
    from shardstream.store import open_store

    opened = open_store(store)
    blocks = [p for p in opened.parts if p.startswith("mid/")]
    block_bytes = [opened.part_nbytes(p) for p in blocks]
    fixed = sum(opened.part_nbytes(p) for p in opened.parts if p not in blocks)
    per_token = sum(block_bytes)
    cap = args.cap or int(450 * MB + fixed + 2.5 * max(block_bytes))
    if args.read:
        files = [store / f for p in blocks for f in opened.manifest.parts[p].files]
        print(json.dumps({"speed": read_speed(files)}))
        return

    speed = child(args, "--read", cap=cap, cold=store)
    skip = set(args.skip.split(",")) - {""}
    settings = [
        ("shardstream, pure streaming, cold (capped)", "stream", cap, store),
        ("shardstream, pure streaming, warm page cache", "stream", None, None),
        ("shardstream, resident budget auto, capped", "resident", cap, store),
        ("shardstream, resident budget auto, no cap", "resident", None, None),
        ("accelerate disk offload, capped", "accelerate", cap, ckpt),
        ("accelerate disk offload, warm page cache", "accelerate", None, None),
        ("transformers in memory, capped", "memory", cap, ckpt),
        ("transformers in memory, no cap", "memory", None, None),
    ]
    rows = []
    for label, mode, limit, cold in settings:
        key = f"{mode}-{'cold' if limit else 'warm'}"
        result = "skipped" if key in skip else child(args, "--run", mode, cap=limit, cold=cold)
        rows.append((label, result))
        print(f"{label}: {result}", file=sys.stderr, flush=True)

    floor = speed["speed"] / per_token if isinstance(speed, dict) else float("nan")
    print(f"Model: Llama-shaped fp32, hidden {args.hidden}, {args.layers} blocks of {max(block_bytes) / MB:.0f} MB, "
          f"{(per_token + fixed) / MB:.0f} MB in all; prompt {args.prompt} tokens, {args.new_tokens} decode steps; "
          f"cap {cap / MB:.0f} MB; {os.cpu_count()} CPU cores, {platform.machine()}.\n")
    print(f"Cold sequential read: {speed['speed'] / MB:.0f} MB/s -> I/O floor for pure streaming "
          f"({per_token / MB:.0f} MB per token): **{floor:.2f} tok/s**.\n" if isinstance(speed, dict) else f"read: {speed}\n")
    print("| setting | prefill tok/s | decode tok/s | decode / I/O floor | read hidden | resident blocks |")
    print("|---|---|---|---|---|---|")
    for label, result in rows:
        if isinstance(result, str):
            print(f"| {label} | {result} | | | | |")
            continue
        hidden = f"{100 * result['hidden']:.0f}% (read/compute {result['read_vs_compute']:.2f})" if "hidden" in result else ""
        print(f"| {label} | {result['prefill']:.1f} | {result['decode']:.2f} | {result['decode'] / floor:.2f} | "
              f"{hidden} | {result.get('resident', '')} |")
    print(f"| AirLLM | {airllm_status()} | | | | |")


if __name__ == "__main__":
    main()
