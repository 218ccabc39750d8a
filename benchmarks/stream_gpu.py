"""Streaming to a CUDA GPU that holds none of the blocks between tokens (a model larger than its VRAM),
against the floors of the bus and the disk and against the peers on the same GPU, as markdown.

Models: benchmarks/stream.py's reference model (`--size`, fp32 Llama, vocab 512), or with `--shape` a real
shape from scripts/real_shapes.py (`llama-3.2-1b`: bf16, vocab 128256, tied). A 4-bit store of the
same checkpoint is made for the `-4bit` settings. Each setting runs in its own process: one untimed
prefill and two decode steps, then a `--prompt`-token prefill and `--new-tokens` greedy decode steps with
the KV cache (`--airllm-tokens` for AirLLM, which reads every layer again on every step), timed; every
setting's first tokens are printed (they must agree, the 4-bit store's among themselves; airllm-4bit
also quantizes the norms, and bnb-nf4 keeps the embeddings and the head in the model's dtype, so these
two may part from them after a few tokens).

Settings (`--modes`):
- stream: shardstream, max_resident_memory=0 (every block copied every token), its host tier keeping the
  blocks page-locked in host RAM after their first read; the computing thread queues the copies ahead
  (prefetch.CopyAhead). stream-readers: the same with the reader threads queueing them
  (SHARDSTREAM_COPY_AHEAD=0), as before.
- stream-reread: max_host_memory=0, every token reads the blocks again through the page cache (which holds
  them: host RAM is plenty here). stream-direct: the same with O_DIRECT, every token from the disk, as
  when the model is larger than host RAM (AirLLM's case).
- stream-4bit, stream-4bit-direct: the same two on the 4-bit store: the codes cross the bus and stay codes
  on the GPU; a decode step multiplies them in with the Triton kernel (stream/quant_triton.py), a prefill
  dequantizes them first. stream-4bit-dequant, stream-4bit-direct-dequant: the same with
  SHARDSTREAM_TRITON=0, the GPU dequantizing every weight on every pass (three kernels a tensor). Where the
  kernel is off (no triton), the 4-bit rows say so.
- resident: every block kept on the GPU (max_resident_memory=None).
- accelerate: transformers with the blocks on "cpu" (accelerate's CPU offload); accelerate-disk: on "disk"
  (its disk offload, an offload folder of .dat files).
- airllm: AirLLM 4.0 (`device="cuda"`), from the checkpoint, run by the interpreter `--airllm` names, or
  this one. airllm-4bit: the same with `compression="4bit"` (bitsandbytes NF4, blocks of 64, dequantized
  on the GPU layer by layer; AirLLM turns its prefetching off then), its split of its own
  (`<workdir>/airllm-4bit-layers`). AirLLM splits the
  checkpoint into per-layer files the first time it opens it and skips that when every layer's file
  and its `.done` marker exist, so each AirLLM setting is opened once, untimed, in a process of its own
  before the timed ones (`--prepare-timeout`). Its model is transformers' own with hooks that load
  each layer before it runs and drop it after, so the KV cache is transformers' and the timed calls
  are the same as every other setting's; every layer is read (from the page cache here) on every step.
- gpu: transformers with the whole model on the GPU (the compute floor). gpu-nocudnn: the same with
  attention kept off cuDNN's kernel, as shardstream runs it (stream/attention.py: cuDNN plans anew for every
  key length, so every decode step of every block waits on the host). bnb-nf4: the same in
  bitsandbytes NF4 (`BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")`, compute in the
  model's dtype): the compute floor of 4-bit weights on the GPU.
  The bitsandbytes and AirLLM settings say "not run" where their package is not installed.
- batch-N: N concurrent greedy requests (--prompt tokens each, --new-tokens new) in the batch engine that
  `serve` runs (serving/batching.py), on the host tier; aggregate generated tokens per second, prefill
  included. The row's ratio is against batch-1 of the same round.

Floors, per store: the copy floor is the blocks' bytes per token over the best page-locked host-to-device
copy of one block; the read floor is the blocks' bytes over the best O_DIRECT read of the block files into
page-locked buffers (1-4 reads in flight; nothing from the page cache). A setting that reads every token
is bound by the slower of the two. The 4-bit settings, bnb-nf4 and airllm-4bit included, are set against
the 4-bit store's floors. After the table, each round's decode speed of shardstream against the peer
of the same kind: stream-4bit / bnb-nf4, stream-4bit-direct / airllm-4bit, stream-direct / airllm,
stream / accelerate (where both ran). AirLLM reads its layers through the page cache, which holds them
here, and the -direct settings from the disk, so those two ratios lean towards AirLLM.

`--budget` bounds the whole run: a setting that would start after it is spent says so in its row, and
the table is printed all the same (scripts/gpu_check.sh gives each of its steps one).

Run on a machine with a GPU: `python benchmarks/stream_gpu.py [--shape llama-3.2-1b] [--rounds 1]`.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _measure import markdown_table  # noqa: E402
from stream import SHAPES, SIZES, with_tokenizer  # noqa: E402
from stream import build as build_store  # noqa: E402

MB = 1e6
DEVICE = "cuda"
MODES = {"stream": "shardstream, host tier (blocks page-locked in host RAM), copies queued by the computing thread",
         "stream-readers": "shardstream, host tier, copies queued by the reader threads",
         "stream-reread": "shardstream, every block read again every token (page cache)",
         "stream-direct": "shardstream, every block read again every token from disk (O_DIRECT)",
         "stream-4bit": "shardstream, 4-bit store, host tier, multiplied from the codes (Triton)",
         "stream-4bit-dequant": "shardstream, 4-bit store, host tier, dequantized on the GPU",
         "stream-4bit-direct": "shardstream, 4-bit store, read from disk every token (O_DIRECT), Triton",
         "stream-4bit-direct-dequant": "shardstream, 4-bit store, read from disk every token (O_DIRECT), dequantized",
         "resident": "shardstream, every block resident on the GPU",
         "accelerate": "accelerate CPU offload (blocks on \"cpu\")",
         "accelerate-disk": "accelerate disk offload (blocks on \"disk\")",
         "airllm": "AirLLM 4.0, device=\"cuda\"",
         "airllm-4bit": "AirLLM 4.0, device=\"cuda\", compression=\"4bit\" (bitsandbytes NF4)",
         "gpu": "transformers, whole model on the GPU",
         "gpu-nocudnn": "transformers, whole model on the GPU, attention without cuDNN's (as shardstream runs it)",
         "bnb-nf4": "transformers, whole model on the GPU in bitsandbytes NF4",
         **{f"batch-{n}": f"shardstream batch engine (as serve), host tier, {n} concurrent requests" for n in (1, 8, 32)}}
REREAD = ("stream-direct", "stream-4bit-direct", "stream-4bit-direct-dequant")
FOUR_BIT = tuple(m for m in MODES if "4bit" in m or "nf4" in m)   # set against the 4-bit store's floors
AIRLLM = ("airllm", "airllm-4bit")                                 # opened once untimed first (its split)
NEEDS = {"airllm": ("airllm",), "airllm-4bit": ("airllm", "bitsandbytes"), "bnb-nf4": ("bitsandbytes",)}
PEERS = (("stream-4bit", "bnb-nf4"), ("stream-4bit-direct", "airllm-4bit"), ("stream-direct", "airllm"),
         ("stream", "accelerate"))


def build(args) -> tuple[Path, Path, Path]:
    """Checkpoint, store and 4-bit store under --workdir, made once and reused."""
    from shardstream.convert import convert

    ckpt, store = build_store(args)
    with_tokenizer(ckpt)   # AirLLM loads one
    store4 = store.parent / "store-4bit"
    if not (store4 / "manifest.json").exists():
        convert(ckpt, store4, compression="4bit", progress=False)
    return ckpt, store, store4


def block_files(store: Path) -> list[Path]:
    from shardstream.store import open_store

    opened = open_store(store)
    return [store / f for p in opened.parts if p.startswith("mid/") for f in opened.manifest.parts[p].files]


def copy_speed(nbytes: int, repeats: int = 5) -> float:
    """Bytes/s of the best page-locked host-to-device copy of `nbytes`."""
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


def read_speed(path: Path) -> tuple[float, int]:
    """(bytes/s, readers) of the best O_DIRECT read of the store's block files whole into page-locked
    buffers, as the loader reads them (direct.read_ranges into a BufferPool(pin=True)), with 1, 2 and 4
    readers."""
    from shardstream.store import open_store
    from shardstream.store.direct_io import aligned
    from shardstream.stream.direct import BufferPool, read_ranges

    store = open_store(path)
    names = [f for p in store.parts if p.startswith("mid/") for f in store.manifest.parts[p].files]
    best = (0.0, 0)
    for readers in (1, 2, 4):
        pool = BufferPool(pin=True)
        buffers = [pool.take(max(store.manifest.files[n].size for n in names)) for _ in range(readers)]
        pending = list(names)
        lock = threading.Lock()

        def reader(buffer) -> None:
            while True:
                with lock:
                    if not pending:
                        return
                    name = pending.pop()
                read_ranges(store, name, [(0, aligned(store.manifest.files[name].size))], buffer, 0, direct=True)

        threads = [threading.Thread(target=reader, args=(b,)) for b in buffers]
        started = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        speed = sum(store.manifest.files[n].size for n in names) / (time.perf_counter() - started)
        pool.give(buffers)
        pool.close()
        best = max(best, (speed, readers))
    return best


def missing(mode: str) -> str | None:
    """Why `mode` cannot run in this interpreter (a package it needs does not import), or None."""
    for module in NEEDS.get(mode, ()):
        if importlib.util.find_spec(module) is None:
            return f"not run: {module} not installed (put its wheel in .whl/{', or give --airllm' if module == 'airllm' else ''})"
    return None


def model_dtype(args):
    import torch

    return torch.bfloat16 if args.shape else torch.float32


def open_backend(mode: str, ckpt: Path, store: Path, store4: Path, dtype):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if mode.startswith("stream") or mode == "resident":
        from shardstream import AutoModel

        if mode == "stream-readers":
            os.environ["SHARDSTREAM_COPY_AHEAD"] = "0"
        os.environ["SHARDSTREAM_DIRECT_IO"] = "on" if mode in REREAD else "off"
        os.environ["SHARDSTREAM_TRITON"] = "0" if mode.endswith("-dequant") else "1"
        return AutoModel.from_pretrained(store4 if "4bit" in mode else store, device=DEVICE,
                                         max_resident_memory=None if mode == "resident" else 0,
                                         max_host_memory=0 if "reread" in mode or mode in REREAD else "auto",
                                         progress=False)   # no profiling_mode: its per-block synchronize serializes the copies
    if mode.startswith("accelerate"):
        layers = AutoConfig.from_pretrained(ckpt).num_hidden_layers
        where = "disk" if mode == "accelerate-disk" else "cpu"
        device_map = {"model.embed_tokens": 0, "model.norm": 0, "model.rotary_emb": 0, "lm_head": 0,
                      **{f"model.layers.{i}": where for i in range(layers)}}
        return AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype, device_map=device_map,
                                                    offload_folder=str(ckpt.parent / "offload")).eval()
    if mode in AIRLLM:
        from airllm import AutoModel as AirLLMModel

        return AirLLMModel.from_pretrained(str(ckpt), device=DEVICE, dtype=dtype,
                                           compression="4bit" if mode == "airllm-4bit" else None,
                                           layer_shards_saving_path=str(ckpt.parent / f"{mode}-layers"))
    if mode in ("gpu", "gpu-nocudnn"):
        return AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype).to(DEVICE).eval()
    if mode == "bnb-nf4":
        from transformers import BitsAndBytesConfig

        nf4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)
        return AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype, quantization_config=nf4,
                                                    device_map=DEVICE).eval()
    raise SystemExit(f"unknown mode {mode}")


def run_batch(model, requests: int, args, vocab: int) -> dict:
    """`requests` concurrent greedy requests through the batch engine, after one untimed request."""
    import torch

    from shardstream.serving.batching import BatchEngine
    from shardstream.serving.protocol import NO_TOKEN, SamplingParams

    prompts = [torch.randint(3, vocab, (args.prompt,), generator=torch.Generator().manual_seed(i)).tolist()
               for i in range(requests)]
    with BatchEngine(model, eos_token_ids=set(), pad_token_id=0, max_batch_size=requests) as engine:
        list(engine.submit(prompts[0][:4], SamplingParams(max_new_tokens=2)))
        started = time.perf_counter()
        sequences = [engine.submit(p, SamplingParams(max_new_tokens=args.new_tokens)) for p in prompts]
        tokens = [[e.token for e in sequence if e.token != NO_TOKEN] for sequence in sequences]
        seconds = time.perf_counter() - started
    return {"decode": sum(map(len, tokens)) / seconds, "prefill": requests * args.prompt / seconds,
            "tokens": tokens[0][:8], "gpu_peak_mib": torch.cuda.max_memory_allocated() // (1 << 20),
            "passes": engine.forward_passes}


def prepare(mode: str, args) -> dict:
    """Open an AirLLM setting once, untimed: the first opening splits the checkpoint into its per-layer
    files (airllm.utils.split_and_save_layers, compressing them for airllm-4bit), which the timed run then
    finds complete and skips."""
    ckpt, store, store4 = build(args)
    started = time.perf_counter()
    open_backend(mode, ckpt, store, store4, model_dtype(args))
    return {"seconds": time.perf_counter() - started}


@contextlib.contextmanager
def profiled(folder: str | None, mode: str):
    """Under --profile, torch.profiler over the timed decode steps, its tables (by GPU time and by host time)
    written to <folder>/profile-<mode>.txt: where a step's time goes, kernels, copies and launches."""
    if not folder:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        yield
    averages = prof.key_averages()
    Path(folder).mkdir(parents=True, exist_ok=True)
    (Path(folder) / f"profile-{mode}.txt").write_text(
        averages.table(sort_by="cuda_time_total", row_limit=30) + "\n\n"
        + averages.table(sort_by="self_cpu_time_total", row_limit=30))


def run_one(mode: str, args) -> dict:
    """Prefill, then --new-tokens greedy decode steps with the KV cache (--airllm-tokens for AirLLM); tokens/s
    of each, and the first tokens."""
    import torch
    from transformers import AutoConfig

    from shardstream.stream.attention import attention_kernels

    ckpt, store, store4 = build(args)
    config = AutoConfig.from_pretrained(ckpt)
    model = open_backend("stream" if mode.startswith("batch") else mode, ckpt, store, store4, model_dtype(args))
    if mode.startswith("batch"):
        return run_batch(model, int(mode.split("-")[1]), args, config.vocab_size)
    new_tokens = args.airllm_tokens if mode in AIRLLM else args.new_tokens
    ids = torch.randint(3, config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    tokens = []
    kernels = attention_kernels(torch.device(DEVICE)) if mode == "gpu-nocudnn" else contextlib.nullcontext()
    with torch.no_grad(), kernels:
        for warm in (True, False):  # the first pass warms CUDA's kernels and allocator
            torch.cuda.synchronize()
            started = time.perf_counter()
            out = model(ids, use_cache=True)
            cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()
            prefill = time.perf_counter() - started
            started = time.perf_counter()
            steps = 2 if warm else new_tokens
            with profiled(args.profile if not warm else None, mode):
                for _ in range(steps):
                    out = model(token, past_key_values=cache, use_cache=True)
                    cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
                    if not warm:
                        tokens.append(token.item())
                torch.cuda.synchronize()
            decode = time.perf_counter() - started
    result = {"prefill": args.prompt / prefill, "decode": new_tokens / decode, "tokens": tokens[:8],
              "gpu_peak_mib": torch.cuda.max_memory_allocated() // (1 << 20)}
    if mode.startswith("stream"):
        report = model.report()
        result["host_kept_mb"] = report.host_kept_bytes / MB
        result["copy_ahead"] = report.read_ahead == "copy ahead"
        result["packed"] = report.packed_weights   # weights multiplied from their codes (4-bit, Triton)
    return result


def child(args, mode: str, action: str = "--run", limit: float | None = None) -> dict | str:
    """Run `mode` in a process of its own (`action`: --run, timed, or --prepare), within `limit` seconds
    (--timeout) and what is left of --budget; its result, or a line saying why there is none."""
    left = args.deadline - time.monotonic()
    if left < 10:
        return f"not run: the --budget of {args.budget} s was spent"
    timeout = int(min(limit or args.timeout, left))
    python = args.airllm if mode in AIRLLM and args.airllm else sys.executable
    command = [python, __file__, action, mode, "--size", args.size, "--prompt", str(args.prompt),
               "--new-tokens", str(args.new_tokens), "--airllm-tokens", str(args.airllm_tokens),
               "--workdir", args.workdir, *(["--shape", args.shape] if args.shape else []),
               *(["--profile", args.profile] if args.profile else [])]
    try:
        run = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"timeout ({timeout} s)"
    if run.returncode != 0:
        return f"failed: {(run.stderr.strip().splitlines() or ['?'])[-1][:160]}"
    result = json.loads(run.stdout.strip().splitlines()[-1])
    return result.get("not_run", result)


def peers_line(results: dict[tuple[int, str], dict | str]) -> str:
    """Each round's decode tok/s of shardstream's settings over their peers', where both ran."""
    ratios = [f"{ours} / {peer} {results[r, ours]['decode'] / results[r, peer]['decode']:.2f}x (round {r})"
              for r in sorted({r for r, _ in results}) for ours, peer in PEERS
              if isinstance(results.get((r, ours)), dict) and isinstance(results.get((r, peer)), dict)]
    return "Decode, shardstream over its peers: " + "; ".join(ratios) + "." if ratios else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), help="a real shape (scripts/real_shapes.py); without it, the reference model (--size)")
    parser.add_argument("--size", choices=sorted(SIZES), default="722mb", help="the reference model's size")
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--airllm-tokens", type=int, default=4,
                        help="decode steps timed for the AirLLM settings (each reads every layer again)")
    parser.add_argument("--workdir", default="artifacts/bench-stream")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--rounds", type=int, default=1, help="rounds of every setting, alternating")
    parser.add_argument("--airllm", help="python of an environment holding airllm==4.0.0 (default: this one)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds one setting may take")
    parser.add_argument("--prepare-timeout", type=int, default=300,
                        help="seconds the untimed first opening of an AirLLM setting (its split) may take")
    parser.add_argument("--budget", type=int, help="seconds the whole run may take (default: no bound)")
    parser.add_argument("--profile", metavar="FOLDER",
                        help="profile each setting's timed decode steps (torch.profiler; its speed is then not the "
                             "setting's own) and write the tables to FOLDER/profile-<setting>.txt")
    parser.add_argument("--run", help=argparse.SUPPRESS)
    parser.add_argument("--prepare", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.hidden, args.layers, args.vocab = SIZES[args.size]
    if args.shape:
        args.layers = SHAPES[args.shape]["num_hidden_layers"]
    if args.run or args.prepare:
        mode = args.run or args.prepare
        reason = missing(mode)
        print(json.dumps({"not_run": reason} if reason else run_one(mode, args) if args.run else prepare(mode, args)))
        return
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"--modes: unknown setting {unknown[0]!r}; choose among {', '.join(MODES)}")
    args.deadline = time.monotonic() + (args.budget or float("inf"))

    import torch

    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/stream_gpu.py needs a CUDA GPU, and torch sees none here "
                         f"(torch {torch.__version__}); run it on a machine with one.")
    ckpt, store, store4 = build(args)
    stores = {"": store, "4bit": store4}
    nbytes = {k: sum(f.stat().st_size for f in block_files(s)) for k, s in stores.items()}
    largest = max(f.stat().st_size for f in block_files(store))
    name = args.shape or f"reference ({args.size})"
    print(f"Command: `python {' '.join(['benchmarks/stream_gpu.py', *sys.argv[1:]])}`; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {torch.cuda.get_device_name(0)}, torch "
          f"{torch.__version__}. Model {name}: {nbytes[''] / MB:.0f} MB of blocks per token, "
          f"{nbytes['4bit'] / MB:.0f} MB in the 4-bit store.\n")
    prepared = {}   # the AirLLM settings whose first opening failed: their rows say why
    for mode in (m for m in AIRLLM if m in modes):
        done = child(args, mode, "--prepare", args.prepare_timeout)
        print(f"prepare {mode} (untimed): {done}", file=sys.stderr, flush=True)
        if isinstance(done, str):
            prepared[mode] = done if done.startswith("not run") else f"not run: its untimed first opening: {done}"
    rows, results = [], {}
    for round_ in range(1, args.rounds + 1):
        copy = copy_speed(largest)
        reads = {k: read_speed(s) for k, s in stores.items()}
        floors = {k: (copy / nbytes[k], reads[k][0] / nbytes[k]) for k in stores}
        for k in stores:
            print(f"round {round_} floors {k or 'store'}: copy {copy / 1e9:.1f} GB/s ({floors[k][0]:.1f} tok/s), "
                  f"O_DIRECT read {reads[k][0] / 1e9:.2f} GB/s with {reads[k][1]} readers ({floors[k][1]:.1f} tok/s)",
                  file=sys.stderr, flush=True)
        single = None
        for mode in modes:
            result = prepared.get(mode) or child(args, mode)
            results[round_, mode] = result
            if mode == "batch-1" and isinstance(result, dict):
                single = result["decode"]
            print(f"round {round_} {mode}: {result}", file=sys.stderr, flush=True)
            if isinstance(result, str):
                rows.append([str(round_), MODES[mode], result, *[""] * 6])
                continue
            copy_floor, read_floor = floors["4bit" if mode in FOUR_BIT else ""]
            floor, which = (min(copy_floor, read_floor), "read") if mode in REREAD else (copy_floor, "copy")
            kept = f"{result['host_kept_mb']:.0f} MB" if "host_kept_mb" in result else ""
            ratio = (f"{result['decode'] / single:.1f}x batch-1" if mode.startswith("batch") and single
                     else f"{result['decode'] / floor:.2f}")
            off = mode.startswith("stream-4bit") and not mode.endswith("-dequant") and not result.get("packed")
            rows.append([str(round_), MODES[mode] + (" [kernel off here: dequantized]" if off else ""),
                         f"{result['decode']:.2f}", f"{floor:.1f} ({which})",
                         ratio, f"{result['prefill']:.0f}", kept,
                         f"{result['gpu_peak_mib']} MiB", " ".join(map(str, result["tokens"]))])
    print(markdown_table(["round", "setting", "decode tok/s", "floor tok/s", "decode / floor", "prefill tok/s",
                          "page-locked host RAM", "GPU peak", "first tokens"], rows))
    print(f"\nFloors: copy {copy / 1e9:.1f} GB/s; O_DIRECT read {reads[''][0] / 1e9:.2f} GB/s "
          f"({reads[''][1]} readers), 4-bit store {reads['4bit'][0] / 1e9:.2f} GB/s.")
    if line := peers_line(results):
        print(f"\n{line}")


if __name__ == "__main__":
    main()
