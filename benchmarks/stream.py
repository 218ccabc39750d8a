"""Streaming inference against the I/O floor and its peers, and tokens per weight read, as markdown.

The reference scenario is DESIGN.md's real-shape one (`--shape llama-3.2-1b`): a random checkpoint
with the exact config of Llama-3.2-1B (bf16, vocab 128256, tied embeddings: 2.5 GB), written shard
by shard by scripts/real_shapes.py, under `memcap 1200M`; `--shape qwen2.5-7b` (15.2 GB) under
4000M. Without --shape, `--size` picks the older toy scenario: a Llama of 16 fp32 blocks of 45 MB
(vocab 512, random weights) under `memcap 600M`. Either way a 32-token prompt, greedy decode, every
run under `memcap CAP --cold PATH` (the page cache is emptied of PATH's files first and capped
together with the process, so every token reads its streamed blocks from disk).

Sections (`--sections`, so that a subset fits in the time at hand):
- single: per round (`--repeat`), the cold read speed of the block files (the I/O floor: bytes
  of blocks per token / the best of several sequential readers, with and without O_DIRECT), then
  each `--modes` setting in its own process: prefill, then --new-tokens decode steps with the KV
  cache. Shardstream reading past the page cache (its choice under the cap: read and dropped on a CPU) and mapped (kept), on the
  4-bit store of the same checkpoint (resident-4bit), an MoE model's experts read on demand from a store
  with its experts placed apart (resident-experts; `--shape mixtral-8x7b --layers 2` under 2000M),
  accelerate disk offload, and AirLLM 4.0 when `--airllm` names the python of its own venv. The cgroup's
  peak is each run's, loading included.
- serve: N concurrent greedy requests (`--batches`) to one capped `shardstream serve
  --max-batch-size`, aggregate completion tokens / wall time, after one untimed request.
- offline: `shardstream generate --prompts-file` with N prompts and `--batch-size N`.
  Both run every size once per round (`--rounds`), the sizes alternating, and report each size's
  median round: on a machine whose speed drifts, ratios of sizes measured minutes apart mislead.
  Each cell also gives the CPU time the hypervisor gave to other guests during each round
  (`steal` in /proc/stat, when 0.5% or more): a compute-bound batch slows by about that much.
- quant4, quant8: serve and offline on a 4-bit (8-bit) store of the same checkpoint.
- prefill: a `--prefill-tokens` prompt (2048), `generate(max_new_tokens=1)`: transformers fully in memory
  without a cap against `--prefill-modes` under the cap, alternating per round (`--repeat`).
- speculative: `generate --prompt` plain and with `--draft`, on the demo pair with its target widened to
  the reference scale (tokens per target pass, speed-up, identical text; the ceiling with a draft that
  computes the target's own function).

The output starts with the CPU's bf16 flags as /proc/cpuinfo lists them and as the runs see them; each
run's row says the dtype it computed in and how its weights were multiplied (bf16 math, bf16 weights in
float32 math, 4-bit codes). `--mask-bf16` runs every child as on a CPU without bf16 instructions:
SHARDSTREAM_CPU_FLAGS masks avx512_bf16 and amx_bf16 (shardstream's own decision), and
ONEDNN_MAX_CPU_ISA=AVX512_CORE keeps torch's bf16 products off those instructions, for the peers too.

Run: `.venv/bin/python benchmarks/stream.py [--shape llama-3.2-1b] [--sections single,serve,offline,quant4,quant8] [--repeat 3] [--rounds 3]` (root, for memcap).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from _measure import (cgroup_peak, cpu_model, cpu_times, evict, markdown_table, openmp, our_env, our_openmp, peer_env,  # noqa: E402
                      stolen_share)
from real_shapes import SHAPES, shape_config, write_checkpoint  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# ../shared/tools/memcap beside the checkout (or beside the folder of checkouts it sits in)
MEMCAP = next((p / "shared" / "tools" / "memcap" for p in ROOT.parents[:2] if (p / "shared" / "tools" / "memcap").exists()),
              ROOT.parent / "shared" / "tools" / "memcap")
MB = 1e6
MiB = 1 << 20
# The cold read speed's buffers, all readers together: larger than a CPU's last-level cache (read_files).
READ_SPAN = 128 * MiB
PEER_MODES = {"memory", "accelerate", "airllm"}   # the runs of transformers, accelerate and AirLLM, not ours
# the environment of every child with --mask-bf16: the path of a CPU without bf16 instructions
MASKED_BF16 = {"SHARDSTREAM_CPU_FLAGS": "-avx512_bf16,-amx_bf16", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}
SIZES = {"722mb": (1024, 16, 512), "470mb": (1024, 8, 8192), "1.5gb": (2048, 7, 8192)}  # hidden, blocks, vocab
CAPS = {"llama-3.2-1b": "1200M", "qwen2.5-7b": "4000M", "qwen2.5-0.5b": "600M",   # the real shapes' scenarios
        "mixtral-8x7b": "2000M"}


def build(args) -> tuple[Path, Path]:
    """Checkpoint and store under --workdir, made once and reused."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardstream.convert import convert

    work = work_dir(args)
    ckpt, store = work / "ckpt", work / "store"
    if args.shape:
        write_checkpoint(args.shape, ckpt, args.layers)
    elif not (ckpt / "config.json").exists():
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


def work_dir(args) -> Path:
    if args.shape:
        return Path(args.workdir) / (args.shape + (f"-l{args.layers}" if args.layers != SHAPES[args.shape]["num_hidden_layers"] else ""))
    return Path(args.workdir) / f"llama-h{args.hidden}-l{args.layers}-v{args.vocab}"


# -- one setting, in its own process -------------------------------------------------------------

def open_backend(mode: str, ckpt: Path, store: Path, work: Path, dtype):
    from transformers import AutoModelForCausalLM

    if mode.split("-")[0] in ("stream", "resident"):  # "-mapped": through the page cache kept; "-direct": O_DIRECT;
        # "-dropped": ordinary reads dropped from the page cache
        from shardstream import AutoModel

        if mode.endswith("-mapped"):
            os.environ["SHARDSTREAM_DIRECT_IO"] = "off"
        if mode.endswith("-direct"):
            os.environ["SHARDSTREAM_DIRECT_IO"] = "on"
        if mode.endswith("-dropped"):
            os.environ["SHARDSTREAM_DIRECT_IO"] = "dropped"
        if mode.endswith("-4bit"):
            store = quantized_store(ckpt, "4bit")
        experts = "on_demand" if mode.endswith("-experts") else "with_block"
        return AutoModel.from_pretrained(placed_store(ckpt) if experts == "on_demand" else store, experts=experts,
                                         max_resident_memory=0 if mode.startswith("stream") else "auto",
                                         profiling_mode=True)
    if mode == "memory":
        return AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype).eval()
    if mode == "accelerate":
        from transformers import AutoConfig

        layers = AutoConfig.from_pretrained(ckpt).num_hidden_layers
        device_map = {"model.embed_tokens": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu",
                      **{f"model.layers.{i}": "disk" for i in range(layers)}}
        return AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype, device_map=device_map,
                                                    offload_folder=str(work / "offload")).eval()
    if mode == "airllm":  # run by the interpreter of a venv holding airllm==4.0.0 (--airllm)
        from airllm import AutoModel as AirLLMModel

        return AirLLMModel.from_pretrained(str(ckpt), device="cpu", layer_shards_saving_path=str(work / "airllm-layers"))
    raise SystemExit(f"unknown mode {mode}")


def weights_path(model, streaming: bool) -> str:
    """How a run multiplied its weights: the dtype it computed in, and for shardstream what its Linears held."""
    dtype = str(model.model.dtype if streaming else model.dtype).removeprefix("torch.")
    if not streaming:
        return f"{dtype} math"
    if model.packed_weights:
        return f"{dtype} math from 4-bit codes (quant_linear)"
    if model.report().half_precision_weights:
        return f"{dtype} math on bf16 weights (half_linear)"
    return f"{dtype} math"


def run_one(mode: str, args) -> dict:
    import torch

    ckpt, store = build(args)
    model = open_backend(mode, ckpt, store, ckpt.parent, torch.bfloat16 if args.shape else torch.float32)
    loading = cgroup_peak(reset=True)
    ids = torch.randint(3, args.vocab, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    streaming = mode.split("-")[0] in ("stream", "resident")
    read = wait = compute = 0.0
    with torch.no_grad():
        started = time.perf_counter()
        out = model(ids, use_cache=True)
        prefill = time.perf_counter() - started
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        bytes_after_prefill = model.experts.bytes_read if streaming and model.experts else 0
        started = time.perf_counter()
        for _ in range(args.new_tokens):
            out = model(token, past_key_values=cache, use_cache=True)
            cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            if streaming:  # the profile covers one call; sum it over the decode steps
                total = model.profile.total
                read, wait, compute = read + total.read, wait + total.wait, compute + total.compute
        decode = time.perf_counter() - started
    result = {"prefill": args.prompt / prefill, "decode": args.new_tokens / decode,
              "weights": weights_path(model, streaming) if mode != "airllm" else "its own"}
    decoding = cgroup_peak()
    if loading and decoding:
        result["load_peak_mib"], result["decode_peak_mib"] = loading >> 20, decoding >> 20
    status = Path("/proc/self/status").read_text()
    result["anon_mib"] = int(re.search(r"RssAnon:\s+(\d+)", status).group(1)) // 1024
    if streaming:
        report = model.report()
        # the streamed blocks as held in memory: packed weights at their packed size
        streamed_bytes = sum(b for i, b in enumerate(report.block_bytes) if i not in report.resident_blocks)
        if model.experts:   # bytes read a decode step: the blocks without experts, and the experts read
            fused = sum(p.nbytes for name, p in model.model.named_parameters()   # the experts' stacks, on meta
                        if name.endswith(("experts.gate_up_proj", "experts.down_proj")))
            result["expert_loads"] = model.experts.loads
            stats = model.experts.cache.stats
            result["expert_hit_rate"] = round(stats.hit_rate, 3)
            experts_read = model.experts.bytes_read - bytes_after_prefill
            result["expert_mb_per_token"] = round(experts_read / args.new_tokens / 1e6)
            result["per_token_bytes"] = streamed_bytes - fused + experts_read // args.new_tokens
        result["resident"] = len(report.resident_blocks)
        result["reading"] = report.reading
        result["streamed_bytes"] = streamed_bytes
        result["hidden"] = 1.0 - min(wait, read) / read if read else 1.0
        result["read_ms"] = 1e3 * read / args.new_tokens
        result["wait_ms"] = 1e3 * wait / args.new_tokens
        result["compute_ms"] = 1e3 * compute / args.new_tokens
        model.close()
    return result


def run_prefill(mode: str, args) -> dict:
    """Seconds of `generate(max_new_tokens=1)` on a --prefill-tokens prompt: the prefill, in as many passes
    as the runtime chooses (shardstream chunks it when one pass would not fit the memory left)."""
    import resource

    import torch

    ckpt, store = build(args)
    model = open_backend(mode, ckpt, store, ckpt.parent, torch.bfloat16 if args.shape else torch.float32)
    ids = torch.randint(3, args.vocab, (1, args.prefill_tokens), generator=torch.Generator().manual_seed(0))
    streaming = mode.split("-")[0] in ("stream", "resident")
    chunk = model.prefill_chunk(1, args.prefill_tokens, 1) if streaming else None   # what generate chooses now
    with torch.no_grad():
        started = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False)
        seconds = time.perf_counter() - started
    result = {"seconds": seconds, "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10,
              "weights": weights_path(model, streaming)}
    if streaming:
        result["chunk"], result["resident"] = chunk, len(model.resident_blocks)
        model.close()
    return result


def long_prompt(args, store: Path, cap: str) -> None:
    """Prefill of a --prefill-tokens prompt, each round alternating: transformers fully in memory without a
    cap (the goal's yardstick), then each streaming setting of --prefill-modes under `cap`, cold."""
    modes = [m for m in args.prefill_modes.split(",") if m]
    rows, ratios = [], collections.defaultdict(list)
    for round_ in range(1, args.repeat + 1):
        base = child(args, "--prefill", "memory", "--prefill-tokens", str(args.prefill_tokens))
        print(f"round {round_} memory: {base}", file=sys.stderr, flush=True)
        rows.append([str(round_), NAMES["memory"] + ", no cap", *(
            [f"{base['seconds']:.1f}", "1.00x", "", "", f"{base['rss_mib']} (RSS)", base["weights"]]
            if isinstance(base, dict) else [base, "", "", "", "", ""])])
        for mode in modes:
            result = child(args, "--prefill", mode, "--prefill-tokens", str(args.prefill_tokens), cap=cap, cold=store)
            print(f"round {round_} {mode}: {result}", file=sys.stderr, flush=True)
            if not isinstance(result, dict):
                rows.append([str(round_), f"{NAMES[mode]}, memcap {cap}", result, "", "", "", "", ""])
                continue
            ratio = result["seconds"] / base["seconds"] if isinstance(base, dict) else float("nan")
            ratios[mode].append(ratio)
            rows.append([str(round_), f"{NAMES[mode]}, memcap {cap}", f"{result['seconds']:.1f}", f"{ratio:.2f}x",
                         str(result["chunk"]), str(result["resident"]), result.get("peak", ""), result["weights"]])
    print(f"\nPrefill of a {args.prefill_tokens}-token prompt (`generate(max_new_tokens=1)`), seconds; streaming "
          f"settings under memcap {cap} (cold), transformers in memory without a cap, alternating.\n")
    print(markdown_table(["round", "setting", "prefill s", "/ transformers in memory", "tokens per pass",
                          "resident blocks", "peak", "weights"], rows))
    for mode, values in ratios.items():
        print(f"\n{NAMES[mode]}: prefill / transformers in memory over {len(values)} round(s): "
              f"{min(values):.2f}x-{max(values):.2f}x")


def read_files(paths: list[Path], threads: int, chunk: int, direct: bool = False) -> float:
    """Bytes/s reading these files with `threads` readers, each with `chunk`-byte readinto calls
    (O_DIRECT when `direct`: no page cache, so no reclaim under the cap) into consecutive places of its buffer,
    the readers' buffers READ_SPAN bytes in all: the bytes land in memory, as a block or an expert the runtime
    reads does. One small buffer read into again and again stays in the CPU's cache, and a virtual disk whose
    host copies into the guest's memory then reads faster than any read of a model can (docs/BENCHMARKS.md,
    "Machines")."""
    from shardstream.stream.direct import read_buffer

    pending = list(paths)
    lock = threading.Lock()
    total = [0]
    span = max(chunk, READ_SPAN // threads // chunk * chunk)

    def reader() -> None:
        buffer = memoryview(read_buffer(span))  # page-aligned, as O_DIRECT needs; huge pages, as the runtime's
        place = 0
        while True:
            with lock:
                if not pending:
                    return
                path = pending.pop(0)
            fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                got = 0
                while n := os.readv(fd, [buffer[place:place + chunk]]):
                    got += n
                    place = (place + chunk) % span
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
        for threads, chunk_mib in ((1, 8), (1, 32), (1, 64), (2, 16), (2, 32), (4, 8), (4, 16)):
            for path in paths:
                evict(path)
            how = f"{threads} thread(s), {chunk_mib} MiB reads{', O_DIRECT' if direct else ''}"
            results[how] = read_files(paths, threads, chunk_mib * MiB, direct)
    best = max(results, key=results.get)
    return {"speed": results[best], "how": best, "all": results}


# -- the driver ---------------------------------------------------------------------------------

def child(args, *extra: str, cap: str | None = None, cold: Path | None = None, python: str | None = None) -> dict | str:
    timeout = args.timeout
    command = [python or sys.executable, __file__, *extra, "--hidden", str(args.hidden), "--layers", str(args.layers),
               "--vocab", str(args.vocab), "--prompt", str(args.prompt), "--new-tokens", str(args.new_tokens),
               "--workdir", args.workdir, *(["--shape", args.shape] if args.shape else [])]
    if cap:
        command = [str(MEMCAP), cap, *(["--cold", str(cold)] if cold else []), "--", *command]
    # each side with its own OpenMP default: a peer's run (transformers, accelerate, AirLLM) or ours
    env = peer_env() if PEER_MODES.intersection(extra) else our_env()
    if python:   # another venv's interpreter (AirLLM's) finds this checkout's package on the path, as this one does
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))
    for _ in range(3):   # memcap names its cgroup after its pid: one left by a memcap killed earlier is in the way
        try:
            run = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            return f"timeout ({timeout} s)"
        if not re.search(r"cannot create directory \S*memcap-\d+\W+ File exists", run.stderr):
            break
    peak = re.search(r"memcap: limit \S+, peak ([^,\s]+)", run.stderr)
    if run.returncode != 0:
        killed = run.returncode in (-9, 137)
        lines = [line for line in run.stderr.strip().splitlines() if not line.startswith("memcap:")] or ["?"]
        return "killed (out of memory)" if killed else f"failed: {lines[-1][:120]}"
    result = json.loads(run.stdout.strip().splitlines()[-1])
    if peak:
        result["peak"] = peak.group(1)
    return result


# -- many tokens per weight read: serve, offline batches ------------------------------------------

def with_tokenizer(store: Path) -> None:
    """serve, generate (and AirLLM, from the checkpoint) need a tokenizer: one token per printable character (ids < 128 < vocab)."""
    if (store / "tokenizer.json").exists():
        return
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from tiny_models import char_tokenizer

    char_tokenizer().save_pretrained(store)


def prompts(count: int, length: int) -> list[str]:
    return [(f"Request {i}: " + "to be or not to be " * length)[:length] for i in range(count)]


def post(url: str, body: dict, timeout: float) -> dict:
    import urllib.request

    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as reply:
        return json.loads(reply.read())


def serve_throughput(args, store: Path, cap: str, sizes: list[int]) -> dict[int, dict | str]:
    """Aggregate decode tok/s of N concurrent greedy requests against one capped `shardstream serve`, each
    size measured once per round (`--rounds`), the sizes alternating within a round. One untimed request
    goes first: the first after start was sometimes the slowest (3.0-3.4 s against 2.5-2.6 s for the
    next ones, 16 tokens on the 4-bit store, in one probe), and a ratio against it flatters the batch."""
    import socket
    import urllib.request

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [str(MEMCAP), cap, "--cold", str(store), "--", str(Path(sys.executable).parent / "shardstream"), "serve",
               str(store), "--port", str(port), "--max-batch-size", str(max(sizes)), "--quiet", "--no-progress"]
    log = Path(args.workdir) / f"serve-{store.parent.name}-{store.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log.open("w"), text=True)
    base, seen = f"http://127.0.0.1:{port}", 0
    runs: dict[int, list[dict | str]] = {n: [] for n in sizes}

    def measure(n: int) -> dict | str:
        nonlocal seen
        replies: list = [None] * n

        def ask(i: int, text: str) -> None:
            try:
                replies[i] = post(base + "/v1/completions", {"prompt": text, "max_tokens": args.new_tokens,
                                                             "temperature": 0}, timeout=args.timeout)
            except Exception as error:  # reported in the table
                replies[i] = str(error)

        threads = [threading.Thread(target=ask, args=(i, t)) for i, t in enumerate(prompts(n, args.prompt))]
        started, cpu = time.perf_counter(), cpu_times()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        elapsed = time.perf_counter() - started
        failed = [r for r in replies if not isinstance(r, dict)]
        tokens = sum(r["usage"]["completion_tokens"] for r in replies if isinstance(r, dict))
        result = f"{len(failed)} failed: {failed[0][:100]}" if failed else {
            "tokens": tokens, "seconds": elapsed, "tok_s": tokens / elapsed, "steal": stolen_share(cpu, cpu_times())}
        lines = log.read_text().splitlines()
        bound, seen = batch_bound(lines[seen:]), len(lines)
        if isinstance(result, dict):
            result["bound"] = bound
        elif server.poll() is not None:
            result = "server killed (out of memory)" if server.returncode in (-9, 137) else result
        print(f"serve {n}: {result}", file=sys.stderr, flush=True)
        return result

    try:
        deadline = time.time() + 300
        while True:
            try:
                urllib.request.urlopen(base + "/health", timeout=5).read()
                break
            except OSError:
                if server.poll() is not None or time.time() > deadline:
                    return {n: f"server did not start: {log.read_text()[-200:]}" for n in sizes}
                time.sleep(1)
        print("serve warm-up:", file=sys.stderr, flush=True)
        measure(1)
        for _ in range(args.rounds):
            for n in sizes:
                runs[n].append(measure(n))
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
    return {n: median_round(measured) for n, measured in runs.items()}


def median_round(measured: list[dict | str]) -> dict | str:
    """The round of median tok/s, with every round's tok/s beside it; the first failure if any round failed."""
    failed = [m for m in measured if not isinstance(m, dict)]
    if failed or not measured:
        return failed[0] if failed else "not run"
    ordered = sorted(measured, key=lambda m: m["tok_s"])
    return {**ordered[(len(ordered) - 1) // 2], "rounds": [m["tok_s"] for m in measured],
            "steals": [m["steal"] for m in measured]}


def batch_bound(lines: list[str]) -> str:
    """Which bound limited the batch, from serve's "batch limited by ...: R running, A admitted" lines:
    "memory at B" (B = the largest batch it allowed), "max_batch_size", or "none" (every request joined)."""
    found = [re.search(r"batch limited by (memory|max_batch_size)\S*.*?: (\d+) running, (\d+) admitted", line)
             for line in lines]
    found = [m for m in found if m]
    memory = [int(m[2]) + int(m[3]) for m in found if m[1] == "memory"]
    return f"memory at {max(memory)}" if memory else "max_batch_size" if found else "none"


def offline_throughput(args, store: Path, cap: str, sizes: list[int]) -> dict[int, dict | str]:
    """tok/s of `shardstream generate --prompts-file` with --batch-size N and N prompts (load time included),
    each size run once per round (`--rounds`), the sizes alternating within a round; the median round."""
    runs: dict[int, list[dict | str]] = {n: [] for n in sizes}
    for _ in range(args.rounds):
        for n in sizes:
            runs[n].append(offline_run(args, store, cap, n))
    return {n: median_round(measured) for n, measured in runs.items()}


def offline_run(args, store: Path, cap: str, n: int) -> dict | str:
    work = Path(args.workdir) / f"offline-{store.name}-{n}"
    work.mkdir(parents=True, exist_ok=True)
    (work / "prompts.txt").write_text("\n".join(prompts(n, args.prompt)) + "\n")
    (work / "answers.jsonl").unlink(missing_ok=True)
    command = [str(MEMCAP), cap, "--cold", str(store), "--", str(Path(sys.executable).parent / "shardstream"),
               "generate", str(store), "--prompts-file", str(work / "prompts.txt"), "--output",
               str(work / "answers.jsonl"), "--batch-size", str(n), "--max-new-tokens", str(args.new_tokens),
               "--no-progress"]
    started, cpu = time.perf_counter(), cpu_times()
    try:
        run = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return f"timeout ({args.timeout} s)"
    steal = stolen_share(cpu, cpu_times())
    elapsed = time.perf_counter() - started
    if run.returncode:
        return f"failed: {run.stderr.strip().splitlines()[-1][:120] if run.stderr.strip() else run.returncode}"
    answers = [json.loads(line) for line in (work / "answers.jsonl").read_text().splitlines() if line.strip()]
    tokens = sum(next((a[k] for k in ("completion_tokens", "new_tokens", "generated_tokens") if k in a), 0)
                 for a in answers)
    result = {"tokens": tokens, "seconds": elapsed, "tok_s": tokens / elapsed, "steal": steal}
    print(f"offline {n}: {result}", file=sys.stderr, flush=True)
    return result


def throughput_table(title: str, results: dict[str, dict[int, dict | str]], sizes: list[int]) -> str:
    header = ["sequences", *[f"{name} tok/s (x one)" for name in results]]
    rows = []
    for n in sizes:
        row = [str(n)]
        for per_size in results.values():
            result, one = per_size.get(n), per_size.get(sizes[0])
            if isinstance(result, dict):
                ratio = f" ({result['tok_s'] / one['tok_s']:.1f}x)" if isinstance(one, dict) and one["tok_s"] else ""
                bound = f", batch bound: {result['bound']}" if result.get("bound", "none") != "none" else ""
                spread = f"; rounds {'/'.join(f'{r:.1f}' for r in result['rounds'])}" if len(result["rounds"]) > 1 else ""
                steals = result["steals"]
                spread += f"; steal {'/'.join(f'{s:.0%}' for s in steals)}" if max(steals) >= 0.005 else ""
                row.append(f"{result['tok_s']:.2f}{ratio}{bound}{spread}")
            else:
                row.append(result or "not run")
        rows.append(row)
    return f"{title}\n\n{markdown_table(header, rows)}"


def speculative(args, cap: str) -> str:
    """The demo pair at the reference scale, under `cap`: plain decoding, then with the shipped draft
    (adaptive and each fixed `--draft-tokens`), then the ceiling (a draft that computes the target's
    own function: the demo model itself). Wall time (load included), tokens per target pass, and
    whether each greedy text equals the plain one."""
    work = Path(args.workdir)
    target = convert_once(demo_at_scale(work / "demo-1152-l16" / "ckpt"), work / "demo-1152-l16" / "store")
    draft = convert_once(ROOT / "assets" / "demo-draft", work / "demo-draft-store")
    ceiling = convert_once(ROOT / "assets" / "demo-model", work / "demo-store")
    fixed = [int(k) for k in args.draft_tokens.split(",") if k]
    settings = [("plain", [])] + [(f"shipped draft, {f'{k} tokens' if k else 'default --draft-tokens'}", ["--draft", str(draft)] +
                                   (["--draft-tokens", str(k)] if k else [])) for k in [0, *fixed]]
    settings += [(f"ceiling (the demo model as draft), {fixed[-1]} tokens",
                  ["--draft", str(ceiling), "--draft-tokens", str(fixed[-1])])] if fixed else []
    rows, plain = [], None
    for name, extra in settings:
        command = [str(MEMCAP), cap, "--cold", str(target), "--", str(Path(sys.executable).parent / "shardstream"),
                   "generate", str(target), "--prompt", "ROMEO:\n", "--max-new-tokens", str(args.spec_tokens),
                   "--profile", "--no-progress", *extra]
        started = time.perf_counter()
        try:
            run = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            rows.append([name, f"timeout ({args.timeout} s)", "", "", ""])
            continue
        seconds = time.perf_counter() - started
        if run.returncode:
            rows.append([name, f"failed: {(run.stderr.strip().splitlines() or ['?'])[-1][:120]}", "", "", ""])
            continue
        passes = re.search(r"([\d.]+) tokens per pass", run.stderr)
        plain = plain or (run.stdout, seconds)
        rows.append([name, passes.group(1) if passes else "1.00", f"{seconds:.1f}", f"{plain[1] / seconds:.2f}x",
                     "yes" if run.stdout == plain[0] else "**no**"])
    return (f"Speculative decoding under memcap {cap} (cold), greedy, {args.spec_tokens} new tokens after \"ROMEO:\\n\". "
            "Target: the demo model at the reference scale (hidden 1152, 16 fp32 blocks of 46 MB: the demo's 6 "
            "blocks with zero-padded widths, 10 more blocks whose output projections are zero, so it computes "
            "the demo model's function and the shipped draft keeps its real acceptance rate). Draft: "
            "assets/demo-draft (3.7 MB), held in memory.\n\n"
            + markdown_table(["setting", "tokens per target pass", "wall s", "speed-up", "text = plain"], rows))


def demo_at_scale(ckpt: Path) -> Path:
    """The demo model widened to the benchmark's block size without changing what it computes: its
    widths are zero-padded (norm weights and eps rescaled so RMSNorm over the wider, zero-padded
    vector gives the same values) and the extra blocks add nothing (zero o_proj and down_proj)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if (ckpt / "config.json").exists():
        return ckpt
    demo = AutoModelForCausalLM.from_pretrained(ROOT / "assets" / "demo-model", dtype=torch.float32)
    small = demo.config
    config = small.__class__.from_dict(small.to_dict())
    config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.layer_types = 1152, 3200, 16, None
    config.rms_norm_eps = small.rms_norm_eps * small.hidden_size / config.hidden_size  # rsqrt(c m + c eps) = rsqrt(c) rsqrt(m + eps)
    torch.manual_seed(0)
    wide = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    weights, h = demo.state_dict(), small.hidden_size
    with torch.no_grad():
        for name, p in wide.named_parameters():
            parts = name.split(".")
            if parts[1] == "layers" and int(parts[2]) >= small.num_hidden_layers:
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    p.zero_()
                continue
            s = weights[name]
            if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight")):
                p[:, h:] = 0
                p[: s.shape[0], :h] = s
                continue
            p.zero_()
            if name.endswith("norm.weight"):
                p[:h] = s * (h / config.hidden_size) ** 0.5
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                p[:h, : s.shape[1]] = s
            else:   # embed_tokens, lm_head
                p[:, :h] = s
    wide.save_pretrained(ckpt, max_shard_size="500MB")
    AutoTokenizer.from_pretrained(ROOT / "assets" / "demo-model").save_pretrained(ckpt)
    demo.generation_config.save_pretrained(ckpt)
    return ckpt


def convert_once(source: Path, store: Path) -> Path:
    from shardstream.convert import convert

    if not (store / "manifest.json").exists():
        convert(source, store, progress=False)
    return store


def placed_store(ckpt: Path) -> Path:
    """A store of the checkpoint with its MoE experts placed apart (`shard --experts`), for experts on demand."""
    from shardstream.shard import place_experts
    from shardstream.store import open_store

    store = convert_once(ckpt, ckpt.parent / "store-experts")
    if not (store / "sharding.json").exists():
        place_experts(open_store(store), {"hot": "."})
    return store


def quantized_store(ckpt: Path, method: str) -> Path:
    from shardstream.convert import convert

    store = ckpt.parent / f"store-{method}"
    if not (store / "manifest.json").exists():
        convert(ckpt, store, compression=method, progress=False)
    return store


# -- the driver ---------------------------------------------------------------------------------

NAMES = {"stream": "(a) shardstream, pure streaming (max_resident_memory=0)",
         "resident": "(b) shardstream defaults (resident budget auto)",
         "resident-mapped": "(b') shardstream defaults, blocks through the page cache (SHARDSTREAM_DIRECT_IO=off)",
         "resident-direct": "(b'') shardstream defaults, blocks with O_DIRECT (SHARDSTREAM_DIRECT_IO=on)",
         "resident-dropped": "(b''') shardstream defaults, blocks read and dropped (SHARDSTREAM_DIRECT_IO=dropped)",
         "resident-4bit": "(f) shardstream defaults, the 4-bit store of the same checkpoint",
         "stream-mapped": "(a') pure streaming through the page cache (SHARDSTREAM_DIRECT_IO=off)",
         "resident-experts": "(g) shardstream defaults, MoE experts read on demand (experts=\"on_demand\")",
         "accelerate": "(c) accelerate disk offload (offload folder)",
         "airllm": "(d) AirLLM 4.0 (PyPI, device=\"cpu\", its own venv)",
         "memory": "(e) transformers, fully in memory"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES),
                        help="a real model's config, random bf16 weights (scripts/real_shapes.py): llama-3.2-1b is "
                             "DESIGN's reference (cap 1200M), qwen2.5-7b (4000M); --layers for fewer blocks")
    parser.add_argument("--size", choices=sorted(SIZES), default="722mb",
                        help="without --shape, the older toy model: 722mb (16 fp32 blocks of 45 MB, vocab 512; "
                             "default), 470mb, 1.5gb")
    parser.add_argument("--hidden", type=int, help="override the --size configuration")
    parser.add_argument("--layers", type=int, help="override the --size configuration")
    parser.add_argument("--vocab", type=int, help="override the --size configuration")
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--workdir", default="artifacts/bench-stream")
    parser.add_argument("--cap", help="memcap limit, page cache included (default: the scenario's, 1200M for "
                                      "llama-3.2-1b, 4000M for qwen2.5-7b, 600M for --size)")
    parser.add_argument("--sections", default="single",
                        help="comma-separated: single (one stream vs floor and peers), serve, offline, quant4, quant8 "
                             "(serve and offline on a 4-bit or 8-bit store), speculative, prefill (a long prompt); default single")
    parser.add_argument("--modes", default="stream,resident,resident-mapped,accelerate",
                        help=f"single-stream settings, comma-separated, from {', '.join(NAMES)}")
    parser.add_argument("--repeat", type=int, default=1, help="single-stream rounds (floor re-measured each round)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="serve/offline: rounds of every batch size, alternating; each size's median round is reported")
    parser.add_argument("--batches", default="1,2,4,8,16,32", help="concurrent requests / batch sizes")
    parser.add_argument("--timeout", type=int, default=900, help="seconds for one child run or one batch")
    parser.add_argument("--draft-tokens", default="8", help="speculative: fixed draft lengths to run besides the default")
    parser.add_argument("--spec-tokens", type=int, default=100, help="speculative: new tokens per run")
    parser.add_argument("--airllm", help="python of a venv holding airllm==4.0.0 (row (d)); left out when not given")
    parser.add_argument("--run", help=argparse.SUPPRESS)
    parser.add_argument("--read", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--prefill", help=argparse.SUPPRESS)
    parser.add_argument("--prefill-tokens", type=int, default=2048, help="prefill: prompt length")
    parser.add_argument("--prefill-modes", default="resident,stream",
                        help="prefill: streaming settings run under the cap, beside transformers in memory")
    parser.add_argument("--mask-bf16", action="store_true",
                        help="run every child as on a CPU without bf16 instructions (SHARDSTREAM_CPU_FLAGS masks them, "
                             "ONEDNN_MAX_CPU_ISA=AVX512_CORE keeps torch's own bf16 products off them, peers included)")
    args = parser.parse_args()
    if args.mask_bf16:
        os.environ.update(MASKED_BF16)   # inherited by every child (a child is run with --mask-bf16 left out)
    if args.prefill_tokens < 1:
        parser.error("--prefill-tokens must be at least 1")
    unknown = [m for m in args.prefill_modes.split(",") if m and m not in NAMES]
    if unknown:
        parser.error(f"--prefill-modes: unknown setting(s) {', '.join(unknown)}; choose from {', '.join(NAMES)}")
    if args.shape:
        config = shape_config(args.shape, args.layers)
        hidden, layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    else:
        hidden, layers, vocab = SIZES[args.size]
    args.hidden, args.layers, args.vocab = args.hidden or hidden, args.layers or layers, args.vocab or vocab
    args.cap = args.cap or CAPS.get(args.shape, "600M")

    if args.run:
        print(json.dumps(run_one(args.run, args)))
        return
    if args.prefill:
        print(json.dumps(run_prefill(args.prefill, args)))
        return
    ckpt, store = build(args) if not args.read else (None, work_dir(args) / "store")
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

    cap, sections = args.cap, set(args.sections.split(","))
    load_before = os.getloadavg()[0]
    print(f"Command: `{' '.join(['.venv/bin/python', 'benchmarks/stream.py', *sys.argv[1:]])}`; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.\n")
    print(bf16_flags() + "\n")
    if "single" in sections:
        with_tokenizer(ckpt)  # AirLLM loads one
        single_stream(args, ckpt, store, cap, per_token)
    sizes = [int(n) for n in args.batches.split(",")]
    quantized = {f"{bits}-bit": quantized_store(ckpt, f"{bits}bit") for bits in (4, 8) if f"quant{bits}" in sections}
    stores = {"fp32": store} | quantized
    if sections & {"serve", "offline", "quant4", "quant8"}:
        table: dict[str, dict] = {}
        for name, path in stores.items():
            with_tokenizer(path)
            if "serve" in sections or name in quantized:
                table[f"serve {name}"] = serve_throughput(args, path, cap, sizes)
            if "offline" in sections or name in quantized:
                table[f"offline {name}"] = offline_throughput(args, path, cap, sizes)
        print(throughput_table(f"Aggregate decode throughput, greedy, {args.new_tokens} new tokens per request, "
                               f"{args.prompt}-character prompts, under memcap {cap} (cold): serve = N concurrent "
                               "HTTP requests, wall time of the slowest; offline = `generate --prompts-file` with N "
                               "prompts and --batch-size N, process wall time (load included).", table, sizes))
    if "speculative" in sections:
        print("\n" + speculative(args, cap))
    if "prefill" in sections:
        long_prompt(args, store, cap)
    kind = f"{args.shape}-shaped bf16" if args.shape else "Llama-shaped fp32"
    model = (f"Model: {kind} (random weights), hidden {args.hidden}, vocab {args.vocab}, {args.layers} blocks of "
             f"{max(block_bytes) / MB:.1f} MB + {fixed / MB:.0f} MB embeddings/head = {(per_token + fixed) / MB:.0f} MB; "
             if sections - {"speculative"} else "")
    print(f"\n{model}{os.cpu_count()} CPU cores ({cpu_model()}), {platform.machine()}; torch "
          f"{__import__('torch').__version__}, transformers {__import__('transformers').__version__}; 1-min load "
          f"average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after. OpenMP: transformers, accelerate and "
          f"AirLLM with {openmp(peer_env())}, shardstream with {our_openmp(our_env())}.")


def bf16_flags() -> str:
    """The CPU's bf16 and fp16 flags as /proc/cpuinfo lists them and as the runs see them."""
    from shardstream.stream.compute_dtype import FAST_CPU_FLAGS, cpu_flags
    from shardstream.switches import CPU_FLAGS

    names = [flag for flags in FAST_CPU_FLAGS.values() for flag in flags]
    masked = os.environ.pop(CPU_FLAGS.name, None)
    listed = sorted(set(names) & cpu_flags())
    if masked is not None:
        os.environ[CPU_FLAGS.name] = masked
    seen = sorted(set(names) & cpu_flags())
    onednn = os.environ.get("ONEDNN_MAX_CPU_ISA")
    return (f"CPU bf16/fp16 flags: listed {', '.join(listed) or 'none'}; as the runs see them "
            f"({CPU_FLAGS.name}={masked or 'unset'}): {', '.join(seen) or 'none'}; ONEDNN_MAX_CPU_ISA={onednn or 'unset'}.")


def single_stream(args, ckpt: Path, store: Path, cap: str, per_token: int) -> None:
    """Each round: the cold read speed of the block files (the floor), then every mode, all under `cap`."""
    modes = [m for m in args.modes.split(",") if m] + (["airllm"] if args.airllm else [])
    if any(m.endswith("-4bit") for m in modes):
        quantized_store(ckpt, "4bit")   # converted here, not under the cap
    if any(m.endswith("-experts") for m in modes):
        placed_store(ckpt)
    header = ["round", "setting", "decode tok/s", "I/O floor tok/s", "decode / floor", "runtime read MB/s / floor MB/s",
              "read / wait / compute ms per token", "resident blocks", "block reads", "cgroup peak",
              "peak loading / decoding MiB", "weights", "load avg"]
    rows, ratios = [], collections.defaultdict(list)
    for round_ in range(1, args.repeat + 1):
        speed = child(args, "--read", cap=cap, cold=store)
        floor = speed["speed"] / per_token if isinstance(speed, dict) else float("nan")
        print(f"round {round_} cold read: {speed}", file=sys.stderr, flush=True)
        for mode in modes:
            cold = (ckpt.parent / "store-4bit" if mode.endswith("-4bit") else ckpt.parent / "store-experts"
                    if mode.endswith("-experts") else store if mode.split("-")[0] in ("stream", "resident")
                    else ckpt.parent if mode == "airllm" else ckpt)
            result = child(args, "--run", mode, cap=cap, cold=cold, python=args.airllm if mode == "airllm" else None)
            print(f"round {round_} {mode}: {result}", file=sys.stderr, flush=True)
            if isinstance(result, str):
                rows.append([str(round_), NAMES[mode], result] + [""] * (len(header) - 3))
                continue
            # experts on demand read only the routed experts: their floor is the bytes they read a token
            own = speed["speed"] / result["per_token_bytes"] if "per_token_bytes" in result and isinstance(speed, dict) else floor
            ratios[mode].append(result["decode"] / own)
            read = (f"{result['streamed_bytes'] / result['read_ms'] / 1e3:.0f} / {speed['speed'] / MB:.0f}"
                    if result.get("read_ms") and isinstance(speed, dict) and "per_token_bytes" not in result else "")
            times = (f"{result['read_ms']:.0f} / {result['wait_ms']:.0f} / {result['compute_ms']:.0f}"
                     if "read_ms" in result else "")
            rows.append([str(round_), NAMES[mode], f"{result['decode']:.2f}", f"{own:.2f}",
                         f"{result['decode'] / own:.2f}x", read, times, str(result.get("resident", "")),
                         str(result.get("reading", "")), result.get("peak", ""),
                         f"{result['load_peak_mib']} / {result['decode_peak_mib']}" if "load_peak_mib" in result else "",
                         result["weights"], f"{os.getloadavg()[0]:.1f}"])
    if not args.airllm:
        rows.append(["", NAMES["airllm"], "not run (give --airllm PYTHON: a venv under artifacts/ with "
                     "`pip install --no-deps airllm==4.0.0`)"] + [""] * (len(header) - 3))
    print(f"Single stream under memcap {cap} (cold), prompt {args.prompt} tokens, {args.new_tokens} greedy decode "
          "steps with the KV cache; the I/O floor is the best cold sequential read of the block files "
          "(see `read_speed`) taken in the same round, one block read per token (with experts on demand, the "
          "blocks without their experts and the experts read per decode step).\n")
    print(markdown_table(header, rows))
    for mode, values in ratios.items():
        print(f"\n{NAMES[mode]}: decode / floor over {len(values)} round(s): {min(values):.2f}x-{max(values):.2f}x")


if __name__ == "__main__":
    main()
