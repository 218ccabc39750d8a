"""Streaming inference speed against the I/O floor and the alternatives, as a markdown table.

The default setting is the one docs/DESIGN.md ("Measuring larger than memory") describes: a
Llama-shaped ~470 MB fp32 model of 8 blocks (random weights), a 32-token prompt, greedy decode,
every capped run under `memcap 300M --cold PATH` (the page cache is emptied of PATH's files first
and capped together with the process, so every token reads its blocks from disk). `--size 1.5gb`
runs the older ~1.5 GB configuration (hidden 2048, 7 blocks) instead.

Each setting runs in its own process: the prompt (prefill tokens/s), then --new-tokens single-token
steps with the KV cache (decode tokens/s). The I/O floor is the bytes of blocks read per decoded
token divided by the cold read speed of the store's block files, measured after eviction with large
`readinto` calls (single- and multi-threaded; the fastest counts). The share of read time hidden
behind compute comes from the runtime's profiling mode, summed over the decode steps.

Run: `.venv/bin/python benchmarks/stream.py [--size 470mb|1.5gb] [--cap 300M,600M]` (needs root for memcap).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _measure import cpu_model, evict, markdown_table  # noqa: E402

MEMCAP = Path(__file__).resolve().parents[1].parent / "shared" / "tools" / "memcap"
MB = 1e6
MiB = 1 << 20
SIZES = {"470mb": (1024, 8, 8192), "1.5gb": (2048, 7, 8192)}  # hidden, blocks, vocab


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

        return AutoModel.from_pretrained(store, max_resident_memory=0 if mode == "stream" else "auto",
                                         profiling_mode=True)
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
    streaming = mode in ("stream", "resident")
    read = wait = compute = 0.0
    with torch.no_grad():
        started = time.perf_counter()
        out = model(ids, use_cache=True)
        prefill = time.perf_counter() - started
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        started = time.perf_counter()
        for _ in range(args.new_tokens):
            out = model(token, past_key_values=cache, use_cache=True)
            cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            if streaming:  # the profile covers one call; sum it over the decode steps
                total = model.profile.total
                read, wait, compute = read + total.read, wait + total.wait, compute + total.compute
        decode = time.perf_counter() - started
    result = {"prefill": args.prompt / prefill, "decode": args.new_tokens / decode}
    status = Path("/proc/self/status").read_text()
    result["anon_mib"] = int(re.search(r"RssAnon:\s+(\d+)", status).group(1)) // 1024
    if streaming:
        result["resident"] = len(model.resident_blocks)
        result["streamed_bytes"] = sum(s.nbytes for i, s in enumerate(model._slots) if i not in model.resident_blocks)
        result["hidden"] = 1.0 - min(wait, read) / read if read else 1.0
        result["read_ms"] = 1e3 * read / args.new_tokens
        result["wait_ms"] = 1e3 * wait / args.new_tokens
        result["compute_ms"] = 1e3 * compute / args.new_tokens
        model.close()
    return result


def read_files(paths: list[Path], threads: int, chunk: int, direct: bool = False) -> float:
    """Bytes/s reading these files with `threads` readers, each with `chunk`-byte readinto calls
    (O_DIRECT when `direct`: no page cache, so no reclaim under the cap)."""
    pending = list(paths)
    lock = threading.Lock()
    total = [0]

    def reader() -> None:
        view = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT needs
        while True:
            with lock:
                if not pending:
                    return
                path = pending.pop(0)
            fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                got = 0
                while n := os.readv(fd, [view]):
                    got += n
                    if n < chunk:
                        break
            finally:
                os.close(fd)
            with lock:
                total[0] += got

    workers = [threading.Thread(target=reader) for _ in range(threads)]
    started = time.perf_counter()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return total[0] / (time.perf_counter() - started)


def read_speed(paths: list[Path]) -> dict:
    """Cold read speed of the block files (run under memcap): every variant after a fresh eviction."""
    results = {}
    for direct in (False, True):
        for threads, chunk_mib in ((1, 8), (1, 32), (1, 64), (2, 16), (2, 32), (4, 8), (4, 16)):  # <= 64 MiB of buffers
            for path in paths:
                evict(path)
            how = f"{threads} thread(s), {chunk_mib} MiB reads{', O_DIRECT' if direct else ''}"
            results[how] = read_files(paths, threads, chunk_mib * MiB, direct)
    best = max(results, key=results.get)
    return {"speed": results[best], "how": best, "all": results}


# -- the driver ---------------------------------------------------------------------------------

def child(args, *extra: str, cap: str | None = None, cold: Path | None = None, timeout: int = 900) -> dict | str:
    command = [sys.executable, __file__, *extra, "--hidden", str(args.hidden), "--layers", str(args.layers),
               "--vocab", str(args.vocab), "--prompt", str(args.prompt), "--new-tokens", str(args.new_tokens),
               "--workdir", args.workdir]
    if cap:
        command = [str(MEMCAP), cap, *(["--cold", str(cold)] if cold else []), "--", *command]
    try:
        run = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"timeout ({timeout} s)"
    peak = re.search(r"memcap: limit \S+, peak ([^,\s]+)", run.stderr)
    if run.returncode != 0:
        killed = run.returncode in (-9, 137)
        lines = [line for line in run.stderr.strip().splitlines() if not line.startswith("memcap:")] or ["?"]
        return "killed (out of memory)" if killed else f"failed: {lines[-1][:120]}"
    result = json.loads(run.stdout.strip().splitlines()[-1])
    if peak:
        result["peak"] = peak.group(1)
    return result


def airllm_status() -> str:
    try:
        import airllm  # noqa: F401
    except ImportError:
        return "not run: AirLLM/RabbitLLM target CUDA (layer-by-layer GPU inference) and are not installed; this machine is CPU-only"
    return "installed but not run: its runtime requires CUDA and this machine is CPU-only"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="470mb",
                        help="model configuration: 470mb (DESIGN's setting, default) or 1.5gb (hidden 2048, 7 blocks)")
    parser.add_argument("--hidden", type=int, help="override the --size configuration")
    parser.add_argument("--layers", type=int, help="override the --size configuration")
    parser.add_argument("--vocab", type=int, help="override the --size configuration")
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--workdir", default="artifacts/bench-stream")
    parser.add_argument("--cap", default="300M,600M",
                        help="memcap limits, comma-separated, page cache included (default 300M,600M: DESIGN's cap, "
                             "and one where the process's own memory (~270 MiB with torch + transformers), the head and two blocks fit)")
    parser.add_argument("--skip", default="", help="comma-separated settings to leave out, e.g. memory-cold,accelerate-cold")
    parser.add_argument("--run", help=argparse.SUPPRESS)
    parser.add_argument("--read", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    hidden, layers, vocab = SIZES[args.size]
    args.hidden, args.layers, args.vocab = args.hidden or hidden, args.layers or layers, args.vocab or vocab

    if args.run:
        print(json.dumps(run_one(args.run, args)))
        return
    ckpt, store = build(args) if not args.read else (None, Path(args.workdir) / f"llama-h{args.hidden}-l{args.layers}-v{args.vocab}" / "store")
    from shardstream.store import open_store

    opened = open_store(store)
    blocks = [p for p in opened.parts if p.startswith("mid/")]
    block_bytes = [opened.part_nbytes(p) for p in blocks]
    fixed = sum(opened.part_nbytes(p) for p in opened.parts if p not in blocks)
    per_token = sum(block_bytes)
    if args.read:
        files = [store / f for p in blocks for f in opened.manifest.parts[p].files]
        print(json.dumps(read_speed(files)))
        return

    caps = [c for c in args.cap.split(",") if c]
    speed = child(args, "--read", cap=caps[0], cold=store)
    print(f"cold read: {speed}", file=sys.stderr, flush=True)
    floor = speed["speed"] / per_token if isinstance(speed, dict) else float("nan")
    skip = set(args.skip.split(",")) - {""}
    load_before = os.getloadavg()[0]
    names = {"stream": "(a) shardstream, pure streaming (max_resident_memory=0)",
             "resident": "(b) shardstream, resident budget auto",
             "accelerate": "(c) accelerate disk offload (offload folder)",
             "memory": "(e) transformers, fully in memory"}
    settings = [(mode, cap) for cap in caps for mode in names] + [(mode, None) for mode in names]
    results = {}
    for mode, cap in settings:
        key = f"{mode}-{'cold' if cap else 'warm'}"
        cold = store if mode in ("stream", "resident") else ckpt
        result = "skipped" if key in skip else child(args, "--run", mode, cap=cap, cold=cold if cap else None)
        if isinstance(result, dict):
            result["load"] = os.getloadavg()[0]  # other work on the machine skews compute-bound rows
        results[(mode, cap)] = result
        print(f"{mode} {cap}: {result}", file=sys.stderr, flush=True)
    load_after = os.getloadavg()[0]

    print(f"Model: Llama-shaped fp32 (random weights), hidden {args.hidden}, {args.layers} blocks of "
          f"{max(block_bytes) / MB:.1f} MB + {fixed / MB:.0f} MB embeddings/head = {(per_token + fixed) / MB:.0f} MB; "
          f"prompt {args.prompt} tokens, greedy decode of {args.new_tokens} tokens; capped runs under `memcap CAP "
          f"--cold <store or checkpoint>` (page cache included, files evicted first); {os.cpu_count()} CPU cores "
          f"({cpu_model()}), {platform.machine()}; torch {__import__('torch').__version__}, transformers "
          f"{__import__('transformers').__version__}; 1-min load average {load_before:.1f} before, {load_after:.1f} after.\n")
    if isinstance(speed, dict):
        variants = ", ".join(f"{k}: {v / MiB:.0f}" for k, v in speed["all"].items())
        print(f"Cold read of the block files (under memcap {caps[0]}, evicted before each variant): "
              f"**{speed['speed'] / MiB:.0f} MiB/s** ({speed['how']}; all variants in MiB/s: {variants}). "
              f"I/O floor for pure streaming ({per_token / MB:.0f} MB read per decoded token): **{floor:.2f} tok/s**.\n")
    else:
        print(f"cold read: {speed}\n")
    header = ["setting", "cap", "prefill tok/s", "decode tok/s", "decode / I/O floor", "x accelerate (same cap)",
              "read hidden (read / wait / compute ms per token)", "resident blocks", "anon MiB", "cgroup peak", "load avg"]
    rows = []
    for (mode, cap), result in results.items():
        label = [names[mode], cap or "none (warm page cache)"]
        if isinstance(result, str):
            rows.append(label + [result] + [""] * (len(header) - 3))
            continue
        accel = results.get(("accelerate", cap))
        versus = f"{result['decode'] / accel['decode']:.1f}x" if isinstance(accel, dict) else ""
        hidden = (f"{100 * result['hidden']:.0f}% ({result['read_ms']:.0f} / {result['wait_ms']:.0f} / "
                  f"{result['compute_ms']:.0f})" if "hidden" in result else "")
        rows.append(label + [f"{result['prefill']:.1f}", f"{result['decode']:.2f}", f"{result['decode'] / floor:.2f}",
                             versus, hidden, str(result.get("resident", "")), str(result.get("anon_mib", "")),
                             result.get("peak", ""), f"{result['load']:.1f}"])
    rows.append(["(d) AirLLM / RabbitLLM", "", airllm_status()] + [""] * (len(header) - 3))
    print(markdown_table(header, rows))
    for cap in caps:
        stream, accel = results.get(("stream", cap)), results.get(("accelerate", cap))
        if isinstance(stream, dict):
            versus = f", {stream['decode'] / accel['decode']:.1f}x accelerate disk offload" if isinstance(accel, dict) else ""
            print(f"\nPure streaming, cold, cap {cap}: {stream['decode']:.2f} tok/s = {stream['decode'] / floor:.2f}x the "
                  f"I/O floor (floor / decode = {floor / stream['decode']:.2f}){versus}; read hidden "
                  f"{100 * stream['hidden']:.0f}%.")

if __name__ == "__main__":
    main()
