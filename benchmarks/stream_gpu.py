"""Streaming on a CUDA GPU that holds none of the blocks between tokens, as when the model is larger
than VRAM: decode speed against the copy floor and accelerate's CPU offload, as markdown.

The model is benchmarks/stream.py's (`--size`). Its block files sit in the page cache (host RAM is
plenty here), so every token copies every block from host RAM to the GPU. The floor is the bytes of
blocks per token over the best pinned host-to-device copy speed. Each mode runs in its own process:
- stream: shardstream with device="cuda", max_resident_memory=0 (every block copied every token), its
  host tier keeping the blocks page-locked in host RAM after their first read (max_host_memory="auto");
- stream-reread: the same with max_host_memory=0: every token reads the blocks again (from the page
  cache into page-locked buffers), as when they do not fit in RAM;
- resident: shardstream with max_resident_memory=None (every block kept on the GPU: no copies);
- accelerate: transformers with device_map putting the blocks on "cpu" (accelerate's CPU offload,
  which moves each block's weights to the GPU when it runs);
- gpu: transformers with the whole model on the GPU (the compute floor).

Run on a machine with a GPU: `python benchmarks/stream_gpu.py [--size 1.5gb] [--rounds 3]`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _measure import markdown_table  # noqa: E402
from stream import SIZES, build  # noqa: E402

MB = 1e6
MODES = {"stream": "shardstream, every block copied every token from page-locked host RAM",
         "stream-reread": "shardstream, every block read and copied every token", "resident": "shardstream, every block resident",
         "accelerate": "accelerate CPU offload (device_map blocks=\"cpu\")", "gpu": "transformers, whole model on the GPU"}


def copy_speed(nbytes: int, repeats: int = 5) -> float:
    """Bytes/s of the best pinned host-to-device copy of `nbytes`."""
    import torch

    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        started = time.perf_counter()
        device.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    return nbytes / best


def open_backend(mode: str, ckpt: Path, store: Path):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if mode.split("-")[0] in ("stream", "resident"):
        from shardstream.stream import AutoModel

        return AutoModel.from_pretrained(store, device="cuda", max_resident_memory=0 if mode.startswith("stream") else None,
                                         max_host_memory=0 if mode == "stream-reread" else "auto",
                                         progress=False)   # no profiling_mode: its per-block synchronize serializes the copies
    if mode == "accelerate":
        layers = AutoConfig.from_pretrained(ckpt).num_hidden_layers
        device_map = {"model.embed_tokens": 0, "model.norm": 0, "model.rotary_emb": 0, "lm_head": 0,
                      **{f"model.layers.{i}": "cpu" for i in range(layers)}}
        return AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, device_map=device_map).eval()
    if mode == "gpu":
        return AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).cuda().eval()
    raise SystemExit(f"unknown mode {mode}")


def run_one(mode: str, args) -> dict:
    """Prefill, then --new-tokens greedy decode steps with the KV cache; tokens/s of each, and the first
    tokens (every mode must give the same)."""
    import torch

    ckpt, store = build(args)
    model = open_backend(mode, ckpt, store)
    ids = torch.randint(3, args.vocab, (1, args.prompt), generator=torch.Generator().manual_seed(0)).cuda()
    tokens = []
    with torch.no_grad():
        for warm in (True, False):  # the first pass warms CUDA's kernels and allocator
            torch.cuda.synchronize()
            started = time.perf_counter()
            out = model(ids, use_cache=True)
            cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()
            prefill = time.perf_counter() - started
            started = time.perf_counter()
            steps = 2 if warm else args.new_tokens
            for _ in range(steps):
                out = model(token, past_key_values=cache, use_cache=True)
                cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
                if not warm:
                    tokens.append(token.item())
            torch.cuda.synchronize()
            decode = time.perf_counter() - started
    result = {"prefill": args.prompt / prefill, "decode": args.new_tokens / decode, "tokens": tokens[:8],
              "gpu_peak_mib": torch.cuda.max_memory_allocated() // (1 << 20)}
    if mode.startswith("stream"):
        result["host_kept_mb"] = model._loader._kept_bytes / MB
    return result


def child(args, mode: str) -> dict | str:
    command = [sys.executable, __file__, "--run", mode, "--size", args.size, "--prompt", str(args.prompt),
               "--new-tokens", str(args.new_tokens), "--workdir", args.workdir]
    run = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    if run.returncode != 0:
        return f"failed: {(run.stderr.strip().splitlines() or ['?'])[-1][:160]}"
    return json.loads(run.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="722mb")
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--workdir", default="artifacts/bench-stream")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--rounds", type=int, default=1, help="rounds of every mode, alternating")
    parser.add_argument("--timeout", type=int, default=600)
    parser.add_argument("--run", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.hidden, args.layers, args.vocab = SIZES[args.size]
    if args.run:
        print(json.dumps(run_one(args.run, args)))
        return

    import torch

    from shardstream.store import open_store

    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/stream_gpu.py needs a CUDA GPU, and torch sees none here "
                         f"(torch {torch.__version__}); run it on a machine with one.")
    _, store = build(args)
    opened = open_store(store)
    per_token = sum(opened.part_nbytes(p) for p in opened.parts if p.startswith("mid/"))
    print(f"Command: `python {' '.join(['benchmarks/stream_gpu.py', *sys.argv[1:]])}`; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {torch.cuda.get_device_name(0)}, torch "
          f"{torch.__version__}. Blocks: {per_token / MB:.0f} MB per token.\n")
    rows = []
    for round_ in range(1, args.rounds + 1):
        speed = copy_speed(max(opened.part_nbytes(p) for p in opened.parts if p.startswith("mid/")))
        floor = speed / per_token
        for mode in args.modes.split(","):
            result = child(args, mode)
            print(f"round {round_} {mode}: {result}", file=sys.stderr, flush=True)
            if isinstance(result, str):
                rows.append([str(round_), MODES[mode], result, *[""] * 6])
                continue
            kept = f"{result['host_kept_mb']:.0f} MB" if "host_kept_mb" in result else ""
            rows.append([str(round_), MODES[mode], f"{result['decode']:.1f}", f"{floor:.1f} ({speed / 1e9:.1f} GB/s)",
                         f"{result['decode'] / floor:.2f}", f"{result['prefill']:.0f}", kept,
                         f"{result['gpu_peak_mib']} MiB"])
            rows[-1].append(" ".join(map(str, result["tokens"])))
    print(markdown_table(["round", "setting", "decode tok/s", "copy floor tok/s", "decode / floor", "prefill tok/s",
                          "page-locked host RAM", "GPU peak", "first tokens"], rows))


if __name__ == "__main__":
    main()
