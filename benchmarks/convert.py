"""Converter throughput, peak disk and peak memory next to `cp -r`, raw disk speed and AirLLM.

Run: `.venv/bin/python benchmarks/convert.py [--size-gb 1.5] [--out artifacts/bench_convert.md]`.
It builds (once, cached under --work) a synthetic bf16 Llama checkpoint in the Hugging Face layout,
then times, each from a cold page cache: `cp -r`, plain and sequential conversion, sequential
conversion from an HTTP server (sampling the output folder's disk use), 8-bit and 4-bit conversion,
and AirLLM's splitter. Every conversion runs in its own process, so its peak RSS is its own.

AirLLM runs from a throwaway venv that reuses this one's torch (--airllm-python); without it, its
row says so. To make one:
    .venv/bin/python -m venv /tmp/airllm-venv
    printf '%s\\n' "$PWD/.venv/lib/python3.11/site-packages" "$PWD/src" \\
        > /tmp/airllm-venv/lib/python3.11/site-packages/shardstream.pth
    /tmp/airllm-venv/bin/pip install airllm
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import _measure
from _measure import MB, evict, markdown_table, memory_of_self, run_timed, tree_bytes

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from real_shapes import SHAPES, checkpoint_bytes, shape_config, write_config_checkpoint  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DTYPE = "bfloat16"
VOCAB = 32000
COMPLETE_MARK = ".complete"


# The synthetic checkpoint.

def llama_config(size_bytes: int, hidden: int) -> dict:
    """A Llama config (GQA, TinyLlama proportions) with as many blocks as reach size_bytes in bf16."""
    heads = hidden // 64
    kv_heads = max(1, heads // 8)
    intermediate = 256 * round(2.75 * hidden / 256)
    kv_dim = kv_heads * 64
    block = 2 * (2 * hidden * hidden + 2 * hidden * kv_dim + 3 * hidden * intermediate + 2 * hidden)
    ends = 2 * (2 * VOCAB * hidden + hidden)
    return dict(model_type="llama", vocab_size=VOCAB, hidden_size=hidden, intermediate_size=intermediate,
                num_hidden_layers=max(1, round((size_bytes - ends) / block)), num_attention_heads=heads,
                num_key_value_heads=kv_heads, tie_word_embeddings=False, hidden_act="silu", rms_norm_eps=1e-5)


def build_checkpoint(work: Path, size_gb: float, hidden: int, shard_mb: int | None, shape: str | None) -> Path:
    """Write (or reuse) the checkpoint (scripts/real_shapes.py: random values written straight to safetensors
    one shard at a time, so memory never holds more than one shard): a real model's config (`shape`, in four
    shards as the Hub publishes 7B models, unless --shard-mb), else a Llama of `size_gb` in five shards."""
    config = shape_config(shape) if shape else llama_config(int(size_gb * 1e9), hidden)
    total = checkpoint_bytes(config)
    shard_bytes = (shard_mb * MB) if shard_mb else -(-total // (4 if shape else 5))
    name = shape or f"llama-h{hidden}-L{config['num_hidden_layers']}"
    folder = work / f"{name}-{DTYPE}-shard{shard_bytes // MB}MB"
    if (folder / COMPLETE_MARK).exists():
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    write_config_checkpoint(config, folder, shard_bytes)
    (folder / COMPLETE_MARK).touch()
    return folder


@dataclass
class Shape:
    """What bounds the converter's peaks: the largest shard and the largest part (one block)."""

    total: int
    shards: int
    largest_shard: int
    largest_part: int
    layers: int


def checkpoint_shape(folder: Path) -> Shape:
    from shardstream.convert import make_plan
    from shardstream.safetensors_header import read_header

    config = json.loads((folder / "config.json").read_text())
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    sizes = {}
    for shard in set(weight_map.values()):
        sizes.update({n: e.nbytes for n, e in read_header(folder / shard).tensors.items()})
    part_bytes: dict[str, int] = {}
    for name, part in make_plan(config, weight_map).part_of.items():
        part_bytes[part] = part_bytes.get(part, 0) + sizes[name]
    shard_sizes = [(folder / s).stat().st_size for s in set(weight_map.values())]
    return Shape(sum(shard_sizes), len(shard_sizes), max(shard_sizes), max(part_bytes.values()),
                 config["num_hidden_layers"])


# Children: one conversion each, in its own process; the last stdout line is its JSON result.

def child(job: dict) -> None:
    """Run one conversion; report its own time (no interpreter start or imports) and start RSS."""
    if job["tool"] == "airllm":
        from airllm.utils import split_and_save_layers as run
    else:
        from shardstream.convert import convert as run
    start_rss, _ = memory_of_self()
    started = time.perf_counter()
    if job["tool"] == "airllm":
        run(job["source"], layer_shards_saving_path=job["out"], splitted_model_dir_name="split")
        profile = None
    else:
        report = run(job["source"], job["out"], sequential_shard_processing=job["sequential"],
                     compression=job["compression"], progress=False)
        keys = ("read_seconds", "quantize_seconds", "write_seconds")
        profile = {k: sum(getattr(p, k) for p in report.profile.values()) for k in keys}
    seconds = time.perf_counter() - started
    _, peak_rss = memory_of_self()
    print(json.dumps({"seconds": seconds, "start_rss": start_rss, "peak_rss": peak_rss, "profile": profile}))


@dataclass
class Run:
    label: str
    seconds: float
    input_bytes: int
    peak_rss: int | None = None
    start_rss: int | None = None
    profile: dict | None = None
    note: str = ""

    @property
    def rate(self) -> float:
        return self.input_bytes / self.seconds / MB


def launch(label: str, source: str, out: Path, shape: Shape, *, python: str = sys.executable,
           tool: str = "shardstream", sequential: bool = False, compression: str | None = None) -> Run:
    """Run one conversion in a child process, from a cold cache into a fresh `out` (left in place)."""
    shutil.rmtree(out, ignore_errors=True)
    if Path(source).exists():
        evict(Path(source))
    job = {"tool": tool, "source": source, "out": str(out), "sequential": sequential,
           "compression": compression}
    result = json.loads(run_timed([python, __file__, "--child", json.dumps(job)], cwd=ROOT).stdout.splitlines()[-1])
    return Run(label, result["seconds"], shape.total, result["peak_rss"], result["start_rss"], result["profile"])


def convert_in_child(label: str, source: str, out: Path, shape: Shape, **options) -> Run:
    """launch(), noting the output's size, then removing it."""
    run = launch(label, source, out, shape, **options)
    run.note = f"output {tree_bytes(out) / MB:.0f} MB"
    shutil.rmtree(out)
    return run


# The benchmark.

def cp_runs(src: Path, scratch: Path, total: int) -> list[Run]:
    """cp -r from a cold cache, and the same followed by fsync of the copy (the converter fsyncs)."""
    copy = scratch / "cp-copy"
    shutil.rmtree(copy, ignore_errors=True)
    evict(src)
    copied = run_timed(["cp", "-r", str(src), str(copy)])
    started = time.perf_counter()
    evict(copy)   # fsyncs every file first
    synced = copied.seconds + time.perf_counter() - started
    shutil.rmtree(copy)
    return [Run("cp -r", copied.seconds, total),
            Run("cp -r, then fsync the copy", synced, total)]


def move_run(src: Path, scratch: Path, total: int) -> Run:
    """The peer of sequential mode, which frees each source shard as it goes: per file, `cp`, fsync
    the copy, delete the source (from a cold cache, on a copy of the checkpoint)."""
    source, moved = scratch / "mv-source", scratch / "mv-copy"
    for folder in (source, moved):
        shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(src, source)
    moved.mkdir()
    evict(source)
    started = time.perf_counter()
    for file in sorted(source.iterdir()):
        run_timed(["cp", str(file), str(moved / file.name)])
        fd = os.open(moved / file.name, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        file.unlink()
    run = Run("cp + fsync + rm, file by file", time.perf_counter() - started, total)
    shutil.rmtree(source)
    shutil.rmtree(moved)
    return run


def http_sequential(src: Path, scratch: Path, shape: Shape) -> tuple[Run, int, int]:
    """Sequential conversion from a local HTTP server; returns the run, peak disk and final disk."""
    sys.path.insert(0, str(ROOT / "tests"))
    from http_server import serve_directory

    out = scratch / "out-http"
    evict(src)
    with serve_directory(src) as (url, _), _measure.DiskSampler(out) as sampler:
        run = launch("shardstream sequential, from HTTP (127.0.0.1)", url, out, shape, sequential=True)
    final = _measure.disk_usage(out)
    shutil.rmtree(out)
    run.note = f"disk sampled {sampler.samples}x"
    return run, sampler.peak, final


def airllm_run(src: Path, scratch: Path, shape: Shape, python: str) -> Run | str:
    """AirLLM's split_and_save_layers, or why it could not run."""
    if not Path(python).exists():
        return f"not run: no AirLLM venv at {python} (see this script's docstring)"
    run = convert_in_child("AirLLM 4.0.0 split_and_save_layers", str(src), scratch / "out-airllm", shape,
                           python=python, tool="airllm")
    run.note += "; no fsync; 4/8-bit need CUDA (bitsandbytes on .cuda())"
    return run


def median_run(runs: list[Run]) -> Run:
    """The run with the median time, noting the spread of all of them."""
    ordered = sorted(runs, key=lambda r: r.seconds)
    middle = ordered[len(ordered) // 2]
    if len(runs) > 1:
        spread = f"median of {len(runs)} ({ordered[-1].rate:,.0f}-{ordered[0].rate:,.0f} MB/s)"
        middle.note = f"{middle.note}; {spread}" if middle.note else spread
    return middle


def mb(value: int | None) -> str:
    return "" if value is None else f"{value / MB:,.0f}"


def table(runs: list[Run], cp: Run, cp_sync: Run, shape: Shape) -> str:
    bound = shape.largest_shard + shape.largest_part
    rows = []
    for r in runs:
        growth = None if r.start_rss is None else r.peak_rss - r.start_rss
        rss = mb(r.peak_rss) + ("" if growth is None else f" (+{mb(growth)}; {growth / bound:.2f}x bound)")
        where = "" if not r.profile else " / ".join(
            f"{r.profile[k]:.1f}" for k in ("read_seconds", "quantize_seconds", "write_seconds"))
        rows.append([r.label, f"{r.seconds:.1f}", f"{r.rate:,.0f}", f"{r.rate / cp.rate:.2f}x",
                     f"{r.rate / cp_sync.rate:.2f}x", rss, where, r.note])
    header = ["run", "s", "MB/s of input", "vs cp -r", "vs cp -r + fsync",
              "peak RSS MB (+ growth during the run)", "read / quant / write s", "notes"]
    return markdown_table(header, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=1.5, help="checkpoint size (bf16)")
    parser.add_argument("--hidden", type=int, default=2048, help="hidden size; blocks are added to reach --size-gb")
    parser.add_argument("--shape", choices=sorted(SHAPES),
                        help="a real model's config instead (scripts/real_shapes.py), e.g. qwen2.5-7b: 15.2 GB")
    parser.add_argument("--shard-mb", type=int, help="max shard size (default: a fifth of the checkpoint)")
    parser.add_argument("--work", type=Path, default=ROOT / "artifacts/bench/convert-src", help="checkpoint cache")
    parser.add_argument("--scratch", type=Path, default=ROOT / "artifacts/bench/convert-scratch",
                        help="copies and outputs, removed as it goes (same disk as --work)")
    parser.add_argument("--disk-probe-gb", type=float, default=1.0)
    parser.add_argument("--airllm-python", default="/tmp/airllm-venv/bin/python")
    parser.add_argument("--out", type=Path, help="also write the markdown here")
    parser.add_argument("--repeat", type=int, default=3, help="rounds of cp / plain / sequential (median reported)")
    parser.add_argument("--main-only", action="store_true",
                        help="only the interleaved cp / plain / sequential rounds (no HTTP, 8/4-bit, AirLLM)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(json.loads(args.child))

    src = build_checkpoint(args.work, args.size_gb, args.hidden, args.shard_mb, args.shape)
    shape = checkpoint_shape(src)
    scratch = args.scratch
    scratch.mkdir(parents=True, exist_ok=True)
    write_speed, read_speed = _measure.disk_speed(scratch, int(args.disk_probe_gb * 1e9))

    # The disk's speed swings between runs (cp -r alone varied 2x here), so cp and the two main
    # modes run interleaved, `--repeat` times, and each row reports its median run.
    # Each conversion is also compared with the `cp -r` + fsync of its own round (the goal: >= 0.8x).
    rounds: dict[str, list[Run]] = {}
    ratios: dict[str, list[float]] = {}
    for _ in range(args.repeat):
        copied, synced = cp_runs(src, scratch, shape.total)
        plain = convert_in_child("shardstream plain", str(src), scratch / "out", shape)
        copy = scratch / "seq-source"   # sequential mode deletes its source shards: convert a copy
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(src, copy)
        sequential = convert_in_child("shardstream sequential", str(copy), scratch / "out", shape, sequential=True)
        shutil.rmtree(copy, ignore_errors=True)
        moved = move_run(src, scratch, shape.total)
        for run in (copied, synced, moved, plain, sequential):
            rounds.setdefault(run.label, []).append(run)
        for run in (plain, sequential):
            ratios.setdefault(f"{run.label} vs `cp -r` + fsync", []).append(synced.seconds / run.seconds)
        ratios.setdefault("shardstream sequential vs cp + fsync + rm file by file (it too frees the source)",
                          []).append(moved.seconds / sequential.seconds)
    runs = [median_run(r) for r in rounds.values()]
    cp, cp_sync = runs[0], runs[1]
    same_round = [f"{label}, same round: median {sorted(r)[len(r) // 2]:.2f}x "
                  f"(range {min(r):.2f}-{max(r):.2f}x over {len(r)} rounds; goal >= 0.8x)."
                  for label, r in ratios.items()]
    if args.main_only:
        print("\n".join([table(runs, cp, cp_sync, shape), "", *same_round]))
        return
    http, peak_disk, final_disk = http_sequential(src, scratch, shape)
    runs.append(http)
    for compression in ("8bit", "4bit"):
        runs.append(convert_in_child(f"shardstream {compression}", str(src), scratch / "out", shape,
                                     compression=compression))
    airllm = airllm_run(src, scratch, shape, args.airllm_python)
    if isinstance(airllm, Run):
        runs.append(airllm)

    import torch

    disk_bound = shape.largest_shard + final_disk
    hidden = json.loads((src / "config.json").read_text())["hidden_size"]
    lines = [
        f"Synthetic {args.shape or 'Llama'} checkpoint, random {DTYPE}: {shape.total / MB:,.0f} MB in {shape.shards} "
        f"shards (largest {mb(shape.largest_shard)} MB), hidden {hidden}, {shape.layers} blocks, largest part "
        f"{mb(shape.largest_part)} MB. Every run starts with its input evicted from the page cache "
        "(fsync + POSIX_FADV_DONTNEED); times exclude interpreter start and imports.",
        f"Machine: {os.cpu_count()} cores ({_measure.cpu_model()}), "
        f"Python {platform.python_version()}, torch {torch.__version__}; raw disk "
        f"{args.disk_probe_gb:g} GB sequential: write + fsync {write_speed:,.0f} MB/s, "
        f"cold read {read_speed:,.0f} MB/s.",
        "",
        table(runs, cp, cp_sync, shape),
        "",
        *same_round,
        f"RSS bound = largest shard + largest part = {mb(shape.largest_shard + shape.largest_part)} MB.",
        f"Peak disk, sequential from HTTP (output folder incl. .staging, st_blocks): {mb(peak_disk)} MB; "
        f"bound = largest shard + final output = {mb(shape.largest_shard)} + {mb(final_disk)} = "
        f"{mb(disk_bound)} MB; ratio {peak_disk / disk_bound:.4f} (goal <= 1.01).",
    ]
    if not isinstance(airllm, Run):
        lines.append(f"AirLLM: {airllm}.")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
