"""Tensor parallel: aggregate memory, streaming ranks, the collectives' cost, against the pipeline, and
on paper, as markdown.

The model is benchmarks/stream.py's reference (built by its code): a Llama of 16 fp32 blocks of 45 MB,
vocab 512 (722 MB; `--hidden/--layers/--vocab` for other sizes), a 32-token prompt and greedy decode
with the KV cache. Ranks are started as on two machines: two torchrun agents (`--nnodes 2 --node-rank
0/1 --rdzv-endpoint 127.0.0.1:PORT`), each wrapped in its own `memcap LIMIT --cold STORE` and pinned
to its own core with taskset (one thread each), so each "machine" has one core and its own memory.

Sections (`--sections`):
- memory: 2 ranks, each under `--cap`, against one process under the same cap on one core (it
  streams blocks from disk); decode tok/s, whether the tokens are the same, bytes each rank read,
  each process's anonymous memory and each cap's peak. Goal: 2 ranks >= 3x. The default cap, 800M,
  holds a rank of the 722 MB model (its 361 MB, about 270 MiB of torch, and its torchrun agent: a
  second interpreter, about 150 MiB more in the cap; 4-block smoke runs peaked at 420-430 MiB for
  a 7 MB share, page cache included) but not the whole model; by that estimate 700M may be too small.
- streaming: each rank under `--stream-cap` (default 600M: above a rank's fixed cost, below what
  holding its half takes) with `AutoModel.from_pretrained(store, tensor_parallel=True,
  max_resident_memory=0)`: bytes read per rank per token and tok/s; "not available" when that
  option is refused, or a rank is killed or reads nothing while decoding (it holds all its shares). Beside it the figure on paper for ranks with their own disks:
  the store's cold read speed over the bytes one rank streams per token.
- costs: 2 uncapped ranks; the time per token in each collective (all-reduce after o_proj,
  down_proj and the embedding, all-gather of the logits, the broadcast of rank 0's inputs), timed by
  wrapping torch.distributed's functions (waiting for the slower rank included), the bare latency of
  an all-reduce of one token's activation, and their share of a token's time.
- pipeline: the same model and cap through the pipeline: two agents under `memcap --cap`, a
  coordinator in this process, 1 and 4 requests in flight (aggregate tok/s).
- paper: predicted decode tok/s of Llama-3-8B and -70B shapes (bf16, 4-bit) on 2, 4, 8 machines
  with 1 and 10 Gbit/s links and NVMe disks, from the costs run's measured parts, next to
  distributed-llama's published figures.

Run: `.venv/bin/python benchmarks/tp.py [--sections memory,streaming,costs,pipeline,paper] [--cap 800M]
[--stream-cap 600M]` (root, for memcap and taskset).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import stream as reference  # noqa: E402  (the reference model and memcap)
from _measure import cgroup_peak, cpu_model, evict, markdown_table  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MB = 1e6
MiB = 1 << 20
SECTIONS = ("memory", "streaming", "costs", "pipeline", "paper")
COLLECTIVES = ("all_reduce", "all_gather", "broadcast_object_list")

# github.com/b4rtaz/distributed-llama, README "Benchmark" tables (Q40 weights, Q80 buffer, ms per token):
# (model, devices, link, {machines: tok/s})
DISTRIBUTED_LLAMA = [
    ("Llama 3 8B Q40", "Raspberry Pi 5 8 GB (v0.3.1)", "1 Gbit/s switch", {1: 1.77, 2: 2.25, 4: 3.01}),
    ("Llama 2 7B Q40", "c3d-highcpu-30 VMs (v0.1.0)", "cloud", {1: 1000 / 101.81, 2: 1000 / 69.69, 4: 1000 / 53.69}),
    ("Llama 2 70B Q40", "c3d-highcpu-30 VMs (v0.1.0)", "cloud", {1: 1000 / 909.69, 2: 1000 / 501.38, 4: 1000 / 293.06}),
    ("Llama 2 70B Q40", "Raspberry Pi 4B 8 GB (v0.1.0)", "1 Gbit/s switch", {8: 1000 / 4842.81}),
]
# hidden, intermediate, blocks, vocab, attention heads, KV heads (the real models' configs)
PAPER_SHAPES = {"Llama-3-8B": (4096, 14336, 32, 128256, 32, 8), "Llama-3-70B": (8192, 28672, 80, 128256, 64, 8)}
PAPER_BYTES = {"bf16": 2.0, "4-bit": 0.5 + 4 / 64}   # bytes per weight (NF4 codes + an fp32 scale per 64)


# -- inside one process: a rank, or the single process ---------------------------------------------

class CollectiveClock:
    """Wraps torch.distributed's collectives (the TP hooks call them through the module) to time them."""

    def __init__(self):
        import torch.distributed as dist

        self.seconds = {name: 0.0 for name in COLLECTIVES}
        self.calls = {name: 0 for name in COLLECTIVES}
        for name in COLLECTIVES:
            setattr(dist, name, self._timed(name, getattr(dist, name)))

    def _timed(self, name: str, function):
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - started
                self.calls[name] += 1
        return timed

    def snapshot(self) -> dict:
        return {name: (self.calls[name], self.seconds[name]) for name in COLLECTIVES}


def decode(model, args, clock: CollectiveClock | None = None) -> dict:
    """Prefill the benchmark prompt (benchmarks/stream.py's), then --new-tokens greedy steps with the KV
    cache: the tokens, prefill and decode tok/s, and for the decode steps alone the bytes read from the
    store (a TP rank's) and the collectives (`clock`'s)."""
    import torch

    ids = torch.randint(3, args.vocab, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    tokens = []
    with torch.no_grad():
        started = time.perf_counter()
        out = model(ids, use_cache=True)
        prefill = time.perf_counter() - started
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        read, calls = getattr(model, "bytes_read", 0), clock.snapshot() if clock else {}
        started = time.perf_counter()
        for _ in range(args.new_tokens):
            tokens.append(int(token))
            out = model(token, past_key_values=cache, use_cache=True)
            cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        seconds = time.perf_counter() - started
    after = clock.snapshot() if clock else {}
    return {"tokens": tokens, "prefill": args.prompt / prefill, "decode": args.new_tokens / seconds,
            "bytes_per_token": (getattr(model, "bytes_read", 0) - read) / args.new_tokens,
            "collectives": {n: [after[n][0] - calls[n][0], after[n][1] - calls[n][1]] for n in after}}


def bare_latency(hidden: int, vocab: int, repeat: int = 200) -> dict:
    """Median ms of an all-reduce of one token's activation and an all-gather of one token's logits share."""
    import torch
    import torch.distributed as dist

    size = dist.get_world_size()
    activation, logits = torch.zeros(1, 1, hidden), torch.zeros(1, 1, vocab // size)
    pieces = [torch.empty_like(logits) for _ in range(size)]
    times = {"all_reduce": [], "all_gather": []}
    dist.barrier()
    for _ in range(repeat):
        started = time.perf_counter()
        dist.all_reduce(activation)
        times["all_reduce"].append(time.perf_counter() - started)
        started = time.perf_counter()
        dist.all_gather(pieces, logits)
        times["all_gather"].append(time.perf_counter() - started)
    return {name: statistics.median(values) * 1e3 for name, values in times.items()}


def anon_mib() -> int:
    """This process's anonymous resident memory (its tensors, not the page cache), MiB."""
    status = Path("/proc/self/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("RssAnon:"))) >> 10


def run_rank(args, store: Path) -> dict:
    """One rank (started by torchrun): load, decode, and what the sections need."""
    import torch

    from shardstream.errors import ShardstreamError
    from shardstream import AutoModel

    torch.set_num_threads(1)
    clock = CollectiveClock()
    options = {"max_resident_memory": 0} if args.rank_streams else resident_option(args)
    try:
        model = AutoModel.from_pretrained(store, tensor_parallel=True, progress=False, **options)
    except ShardstreamError as error:
        return {"unavailable": str(error)}
    loaded = model.bytes_read
    result = {"rank": model.rank, "bytes_loaded": loaded, **decode(model, args, clock),
              "bare_ms": bare_latency(model.config.hidden_size, model.config.vocab_size),
              "anon_mib": anon_mib(), "cgroup_peak_mib": (cgroup_peak() or 0) >> 20}
    model.close()
    return result


def run_single(args, store: Path) -> dict:
    """The one process: shardstream's defaults (a resident budget from the cap; the rest streams)."""
    import torch

    from shardstream import AutoModel

    torch.set_num_threads(1)
    model = AutoModel.from_pretrained(store, progress=False, **resident_option(args))
    result = {**decode(model, args), "resident": len(model.resident_blocks), "anon_mib": anon_mib(),
              "cgroup_peak_mib": (cgroup_peak() or 0) >> 20}
    model.close()
    return result


# -- the driver: processes as on separate machines ---------------------------------------------------

def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def child_env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}


def model_options(args) -> list[str]:
    return ["--hidden", str(args.hidden), "--layers", str(args.layers), "--vocab", str(args.vocab),
            "--prompt", str(args.prompt), "--new-tokens", str(args.new_tokens), "--workdir", args.workdir,
            *(["--resident", args.resident] if args.resident else [])]


def resident_option(args) -> dict:
    """--resident as from_pretrained's max_resident_memory (none: its 'auto')."""
    from shardstream.sizes import parse_size

    return {"max_resident_memory": parse_size(args.resident, "--resident")} if args.resident else {}


def capped(command: list[str], cap: str | None, store: Path, core: int) -> list[str]:
    """`command` pinned to `core` (one thread), under its own `memcap cap --cold store` when a cap is given."""
    command = ["taskset", "-c", str(core % (os.cpu_count() or 1)), *command]
    return [str(reference.MEMCAP), cap, "--cold", str(store), "--", *command] if cap else command


def outcome(process: subprocess.Popen, stdout: str, stderr: str) -> dict | str:
    """The JSON a child printed last, or why there is none."""
    if process.returncode in (-9, 137) or "exitcode  : -9" in stderr:
        return "killed (out of memory)"
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if process.returncode or not lines:
        errors = [line for line in stderr.strip().splitlines() if "rror" in line and not line.startswith("memcap:")]
        return f"failed ({process.returncode}): {(errors or stderr.strip().splitlines() or ['?'])[-1][:160]}"
    return json.loads(lines[-1])


def start(command: list[str]) -> subprocess.Popen:
    """A child in its own process group (so that a timeout ends it with everything it started)."""
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(),
                            start_new_session=True)


def finish(process: subprocess.Popen, timeout: int) -> dict | str:
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        return f"timeout ({timeout} s)"
    return outcome(process, stdout, stderr)


def launch_ranks(args, store: Path, cap: str | None, streams: bool = False) -> list[dict | str]:
    """Two torchrun agents, one rank each, as on two machines: each under its own cap, on its own core."""
    port = free_port()
    processes = [start(capped([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
                               "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}", __file__,
                               "--rank-run", str(store), *model_options(args), *(["--rank-streams"] if streams else [])],
                              cap, store, node))
                 for node in (0, 1)]
    return [finish(process, args.timeout) for process in processes]


def launch_single(args, store: Path, cap: str) -> dict | str:
    return finish(start(capped([sys.executable, __file__, "--single-run", str(store), *model_options(args)], cap, store, 0)),
                  args.timeout)


def cell(result: dict | str, key: str, form: str = "{:.2f}") -> str:
    return form.format(result[key]) if isinstance(result, dict) and key in result else str(result)[:80]


# -- sections -------------------------------------------------------------------------------------

def memory_section(args, store: Path, state: dict) -> str:
    single = launch_single(args, store, args.cap)
    ranks = launch_ranks(args, store, args.cap)
    print(f"memory: one process {single}; ranks {ranks}", file=sys.stderr, flush=True)
    state["ranks"] = ranks
    rows = [["one process, 1 core (shardstream defaults: resident budget from the cap, the rest streams)",
             cell(single, "decode"), "1.00x", "-", "-", cell(single, "resident", "{}"), cell(single, "anon_mib", "{}"),
             cell(single, "cgroup_peak_mib", "{}")]]
    first = ranks[0] if isinstance(ranks[0], dict) else None
    speedup = (f"{first['decode'] / single['decode']:.2f}x" if first and isinstance(single, dict) else "-")
    same = ("yes" if first and isinstance(single, dict) and first["tokens"] == single["tokens"] else
            "**no**" if first and isinstance(single, dict) else "-")
    rows.append(["2 ranks, 1 core and 1 cap each", cell(ranks[0], "decode"), speedup, same,
                 " / ".join(cell(r, "bytes_loaded", "{:,}") for r in ranks),
                 " / ".join("all" if isinstance(r, dict) and not r["bytes_per_token"] else
                            cell(r, "bytes_per_token", "streams {:,.0f} B per token") for r in ranks),
                 " / ".join(cell(r, "anon_mib", "{}") for r in ranks), " / ".join(cell(r, "cgroup_peak_mib", "{}") for r in ranks)])
    return (f"Aggregate memory: each process (each torchrun agent with its rank) under its own memcap {args.cap} "
            f"(cold), pinned to its own core, one thread, max_resident_memory {args.resident or 'auto'}; "
            f"{args.prompt}-token prompt, {args.new_tokens} greedy decode steps with the KV cache. Goal: 2 ranks "
            ">= 3x one process.\n\n"
            + markdown_table(["setting", "decode tok/s", "x one process", "same tokens", "bytes read per rank",
                              "resident blocks", "anonymous RSS MiB", "cgroup peak MiB (agent included)"], rows))


def disk_read_speed(store: Path) -> float:
    """Bytes/s of one cold sequential read of the block files (2 readers, 16 MiB reads, O_DIRECT)."""
    from shardstream.store import open_store

    opened = open_store(store)
    files = [store / f for p in opened.parts if p.startswith("mid/") for f in opened.manifest.parts[p].files]
    for path in files:
        evict(path)
    return reference.read_files(files, 2, 16 * MiB, direct=True)


def streaming_section(args, store: Path, layout: dict) -> str:
    ranks = launch_ranks(args, store, args.stream_cap, streams=True)
    print(f"streaming: {ranks}", file=sys.stderr, flush=True)
    speed = disk_read_speed(store)
    if any(isinstance(r, str) for r in ranks):
        measured = "Not available: " + "; ".join(f"rank {i}: {r}" for i, r in enumerate(ranks) if isinstance(r, str))
    elif any("unavailable" in r for r in ranks):
        measured = f"Not available: the ranks refused `max_resident_memory=0`: {next(r['unavailable'] for r in ranks if 'unavailable' in r)}"
    elif all(r["bytes_per_token"] == 0 for r in ranks):
        measured = ("Not available: the ranks accepted `max_resident_memory=0` but read nothing while decoding "
                    "(they hold all their shares in memory).")
    else:
        rows = [[str(i), cell(r, "bytes_per_token", "{:,.0f}"), cell(r, "decode"), cell(r, "cgroup_peak_mib", "{}")]
                for i, r in enumerate(ranks)]
        measured = markdown_table(["rank", "bytes read per token", "decode tok/s", "cgroup peak MiB"], rows)
    whole, share = layout["blocks"], layout["rank_blocks"]
    paper = markdown_table(["setting", "bytes read per token", "tok/s at the disk's speed"],
                           [["one process streaming every block", f"{whole:,}", f"{speed / whole:.2f}"],
                            ["2 ranks, each streaming its share from its own disk", f"{share:,}", f"{speed / share:.2f}"]])
    return (f"Streaming ranks: each rank under memcap {args.stream_cap} (less than holding its half takes), "
            "`AutoModel.from_pretrained(store, tensor_parallel=True, max_resident_memory=0)`.\n\n" + measured +
            f"\n\nOn paper, ranks with their own disks: this store's cold read speed ({speed / MB:.0f} MB/s, O_DIRECT) over "
            "the bytes of blocks each reads per token (a rank: its share of every block, norms whole); the disk "
            "floor, compute not counted.\n\n" + paper)


def costs_section(args, store: Path, state: dict) -> str:
    ranks = launch_ranks(args, store, None)
    print(f"costs: {ranks}", file=sys.stderr, flush=True)
    if not all(isinstance(r, dict) for r in ranks):
        return f"Collective costs: not measured: {ranks}"
    state["costs"] = ranks
    steps = args.new_tokens
    rows = []
    for r in ranks:
        token_ms = 1e3 / r["decode"]
        spent = {n: (calls / steps, seconds * 1e3 / steps) for n, (calls, seconds) in r["collectives"].items()}
        total = sum(ms for _, ms in spent.values())
        bare = spent["all_reduce"][0] * r["bare_ms"]["all_reduce"] + spent["all_gather"][0] * r["bare_ms"]["all_gather"]
        rows.append([str(r["rank"]), f"{token_ms:.2f}",
                     *[f"{calls:.0f} / {ms:.2f}" for calls, ms in spent.values()],
                     f"{total:.2f} ({total / token_ms:.0%})", f"{r['bare_ms']['all_reduce']:.3f} / {r['bare_ms']['all_gather']:.3f}",
                     f"{bare:.2f} ({bare / token_ms:.0%})"])
    return ("Collective costs per decoded token, 2 uncapped ranks (each on its own core, gloo over loopback). "
            "Wrapped: the calls' wall time, which includes waiting for the slower rank; bare: the median of 200 "
            "back-to-back calls of the same sizes after a barrier (one token's activation, one token's logits share), "
            "times the calls per token.\n\n"
            + markdown_table(["rank", "ms per token", "all-reduce calls / ms", "all-gather calls / ms",
                              "broadcast of inputs calls / ms", "all collectives ms (share)",
                              "bare all-reduce / all-gather ms", "bare collectives ms (share)"], rows))


def pipeline_section(args, store: Path, state: dict) -> str:
    import tempfile

    import torch

    import pipeline as pipeline_bench   # benchmarks/pipeline.py: agents, coordinator, stage server
    from shardstream.pipeline.coordinator import CoordinatorOptions
    from shardstream.serving.protocol import SamplingParams

    ids = torch.randint(3, args.vocab, (1, args.prompt), generator=torch.Generator().manual_seed(0))[0].tolist()
    rows = []
    with tempfile.TemporaryDirectory(dir=args.workdir) as temp:
        folder = Path(temp)
        options = CoordinatorOptions(folder / "work", context_length=args.prompt + args.new_tokens + 16,
                                     pipeline_order=["s0", "s1"])
        with pipeline_bench.running_pipeline(folder, store, ["s0", "s1"], options,
                                             wrapper=[str(reference.MEMCAP), args.cap, "--cold", str(store), "--"]
                                             ) as (agents, coordinator, model):
            coordinator.profile()
            # a memory fraction at which an agent holds just half of the blocks: two stages (capped at 0.95:
            # under a cap too small for that, the plan streams)
            coordinator.options.mem_fraction = min(0.95, pipeline_bench.fraction_for(coordinator, 2))
            route = coordinator.deploy()
            plan = route.plan.table()
            engine = model.engine
            list(engine.submit(ids, SamplingParams(max_new_tokens=2)))   # the stages' first pass, untimed
            for count in (1, 4):
                started = time.perf_counter()
                sequences = [engine.submit(ids, SamplingParams(max_new_tokens=args.new_tokens)) for _ in range(count)]
                outputs = [[event.token for event in sequence] for sequence in sequences]
                wall = time.perf_counter() - started
                tokens = sum(len(o) for o in outputs)
                ranks = state.get("ranks") or state.get("costs")
                same = ("yes" if ranks and isinstance(ranks[0], dict) and all(o == ranks[0]["tokens"][:len(o)] for o in outputs)
                        else "-" if not ranks or not isinstance(ranks[0], dict) else "**no**")
                rows.append([str(count), f"{tokens / wall:.2f}", f"{wall:.2f}", same])
                print(f"pipeline {count}: {rows[-1]}", file=sys.stderr, flush=True)
    tp = state.get("ranks")
    tp_rate = f"; 2 TP ranks under the same caps (memory section): {tp[0]['decode']:.2f} tok/s" if tp and isinstance(tp[0], dict) else ""
    return (f"Against the pipeline: two agents each under memcap {args.cap} (cold; not pinned: the agents split the "
            f"cores), a coordinator in this process, memory fraction set so that an agent holds half of the blocks "
            f"({coordinator.options.mem_fraction:.2f}); greedy, {args.new_tokens} new tokens per request, requests "
            f"submitted together after one untimed request{tp_rate}.\n\n{plan}\n\n"
            + markdown_table(["requests in flight", "aggregate tok/s", "wall s", "tokens = TP ranks'"], rows))


def paper_section(args, state: dict, layout: dict) -> str:
    """Decode tok/s on paper: compute at the measured per-byte rate, the collectives by a ring model."""
    ranks = state.get("costs")
    if not ranks:
        return "On paper: needs the costs section's measurements (run it too)."
    r = ranks[0]
    token = 1 / r["decode"]
    calls = {n: c / args.new_tokens for n, (c, _) in r["collectives"].items()}
    bare = (calls["all_reduce"] * r["bare_ms"]["all_reduce"] + calls["all_gather"] * r["bare_ms"]["all_gather"]) / 1e3
    rate = layout["rank_compute"] / (token - bare)   # weight bytes a core multiplies per second
    alpha = r["bare_ms"]["all_reduce"] / 1e3 / 2   # per step of a ring (2 ranks: 2 steps) on loopback

    def ring(steps: int, nbytes: float, gbit: int) -> float:
        """Seconds of a ring collective: its steps' latency, and the bytes each machine sends over its link."""
        return steps * (alpha + args.paper_hop_ms / 1e3) + nbytes * 8 / (gbit * 1e9)

    rows = []
    for name, (hidden, inter, blocks, vocab, heads, kv) in PAPER_SHAPES.items():
        params = blocks * (2 * hidden * hidden + 2 * hidden * hidden * kv // heads + 3 * hidden * inter) + 2 * vocab * hidden
        for dtype, per in PAPER_BYTES.items():
            for machines in (2, 4, 8):
                share = params * per / machines
                compute = share / (rate * args.paper_cores)
                spill = max(0.0, share - args.paper_ram * 2**30) / (args.paper_disk * MB)
                cells = []
                for gbit in (1, 10):
                    comm = ((2 * blocks + 1) * ring(2 * (machines - 1), 2 * (machines - 1) / machines * hidden * 4, gbit)
                            + ring(machines - 1, (machines - 1) / machines * vocab * 4, gbit))
                    cells.append(f"{1 / (compute + spill + comm):.2f} ({comm * 1e3:.0f} ms links)")
                rows.append([name, dtype, str(machines), f"{share / 1e9:.1f}", f"{(compute + spill) * 1e3:.0f}", *cells])
    published = [[model, devices, link, ", ".join(f"{n}: {v:.2f}" for n, v in figures.items())]
                 for model, devices, link, figures in DISTRIBUTED_LLAMA]
    return (f"On paper: decode tok/s = 1 / (compute + spill + links). Compute: a machine's weight share at the "
            f"measured rate of one rank ({rate / 1e9:.2f} GB of fp32 weights per second per core, from the costs run: "
            f"token time less its bare collectives) times --paper-cores {args.paper_cores}; bf16 and 4-bit taken at the "
            f"same rate per byte (memory-bound decode; for 4-bit an assumption, not a measurement: the kernel's rate per "
            f"byte of codes differs, docs/STREAMING.md). Spill: a share beyond --paper-ram {args.paper_ram} GiB read per token from an NVMe disk at "
            f"{args.paper_disk:.0f} MB/s. Links: 2 all-reduces per block plus the embedding's of one token's fp32 "
            f"activation (rings of 2(N-1) steps) and the logits' all-gather (N-1 steps), each step costing the measured "
            f"loopback step ({alpha * 1e3:.3f} ms: half a 2-rank all-reduce) plus --paper-hop-ms {args.paper_hop_ms}, "
            f"and the bytes a machine sends at the link's speed.\n\n"
            + markdown_table(["shape", "weights", "machines", "GB per machine", "compute + spill ms",
                              "tok/s at 1 Gbit/s", "tok/s at 10 Gbit/s"], rows)
            + "\n\ndistributed-llama's published figures (tok/s by machine count; Q40 weights, Q80 buffers; "
              "source: README of github.com/b4rtaz/distributed-llama, its benchmark tables):\n\n"
            + markdown_table(["model", "devices", "link", "tok/s by machines"], published))


def layout_bytes(store: Path) -> dict:
    """Bytes of the blocks, and of rank 0 of 2's shares (norms whole, every split tensor half): of the
    blocks, of everything, of what a token multiplies (all but the embedding)."""
    from shardstream.store import open_store

    tensors = open_store(store).manifest.tensors
    blocks = [r for r in tensors.values() if r.part.startswith("mid/")]

    def share(records) -> int:
        return sum(r.length if len(r.shape) == 1 else r.length // 2 for r in records)

    computed = [r for r in tensors.values() if not r.part.startswith("start")]   # the embedding is looked up, not multiplied
    return {"blocks": sum(r.length for r in blocks), "rank_blocks": share(blocks), "rank_bytes": share(tensors.values()),
            "rank_compute": share(computed)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    hidden, layers, vocab = reference.SIZES["722mb"]
    parser.add_argument("--hidden", type=int, default=hidden)
    parser.add_argument("--layers", type=int, default=layers)
    parser.add_argument("--vocab", type=int, default=vocab)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--workdir", default="artifacts/bench-tp")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, from {', '.join(SECTIONS)}")
    parser.add_argument("--cap", default="800M", help="memcap limit of each rank's agent and of the one process")
    parser.add_argument("--resident", help="memory: max_resident_memory of the one process and of each rank "
                                           "(a size; default 'auto', 3/4 of the memory the cap leaves)")
    parser.add_argument("--stream-cap", default="600M", help="streaming: each rank's memcap limit, less than holding its half takes")
    parser.add_argument("--paper-cores", type=int, default=8, help="paper: cores per machine")
    parser.add_argument("--paper-ram", type=float, default=32, help="paper: GiB of weights a machine holds")
    parser.add_argument("--paper-disk", type=float, default=3000, help="paper: NVMe read MB/s")
    parser.add_argument("--paper-hop-ms", type=float, default=0.1, help="paper: a link's latency per ring step, ms")
    parser.add_argument("--timeout", type=int, default=900, help="seconds for one child run")
    parser.add_argument("--rank-run", help=argparse.SUPPRESS)
    parser.add_argument("--rank-streams", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--single-run", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_run or args.single_run:
        run = run_rank(args, Path(args.rank_run)) if args.rank_run else run_single(args, Path(args.single_run))
        print(json.dumps(run))
        return
    sections = [s for s in args.sections.split(",") if s]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        raise SystemExit(f"--sections: unknown {', '.join(sorted(unknown))}; choose from {', '.join(SECTIONS)}.")
    _, store = reference.build(argparse.Namespace(shape=None, hidden=args.hidden, layers=args.layers, vocab=args.vocab,
                                                  workdir=args.workdir))
    layout = layout_bytes(store)
    load_before = os.getloadavg()[0]
    print(f"Command: `{' '.join(['.venv/bin/python', 'benchmarks/tp.py', *sys.argv[1:]])}`; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.\n")
    state: dict = {}
    if "paper" in sections and "costs" not in sections:
        sections.insert(sections.index("paper"), "costs")   # the paper's measured parts
    for name in sections:
        if name == "memory":
            print(memory_section(args, store, state) + "\n")
        elif name == "streaming":
            print(streaming_section(args, store, layout) + "\n")
        elif name == "costs":
            print(costs_section(args, store, state) + "\n")
        elif name == "pipeline":
            print(pipeline_section(args, store, state) + "\n")
        else:
            print(paper_section(args, state, layout) + "\n")
    import torch
    import transformers

    print(f"Model: Llama-shaped fp32 (random weights, benchmarks/stream.py's), hidden {args.hidden}, vocab {args.vocab}, "
          f"{args.layers} blocks = {layout['blocks'] / MB:.0f} MB of blocks; a rank of 2 holds {layout['rank_bytes'] / MB:.0f} MB. "
          f"{os.cpu_count()} CPU cores ({cpu_model()}), {platform.machine()}; torch {torch.__version__}, transformers "
          f"{transformers.__version__}; 1-min load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after.")


if __name__ == "__main__":
    main()
