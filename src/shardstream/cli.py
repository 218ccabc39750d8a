"""The `shardstream` command. Thin: parse options, call the modules, print results.

User mistakes (our ShardstreamError classes) print one red sentence and exit 1, no traceback.
"""

from __future__ import annotations

import logging
import sys
import warnings
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from .errors import InvalidOption, ShardstreamError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Run and train large language models on hardware too small for them.")
console = Console()
err_console = Console(stderr=True)

SIZE_UNITS = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9,
              "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "T": 10**12, "TB": 10**12}


def parse_size(text: str, option: str) -> int:
    """'1GB', '500M', '2GiB' or a plain byte count."""
    cleaned = text.strip().upper().replace(" ", "")
    number = cleaned.rstrip("KMGTIB")
    unit = cleaned[len(number):]
    try:
        return int(float(number) * SIZE_UNITS[unit])
    except (ValueError, KeyError):
        raise InvalidOption(f"{option} takes a size such as 1GB, 500MB or 2GiB, not {text!r}.") from None


def _logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(name)s: %(message)s", stream=sys.stderr)
    warnings.simplefilter("default")
    logging.captureWarnings(True)


@app.command()
def convert(
    source: Annotated[str, typer.Argument(help="Local folder, HTTP(S) base URL, or Hub id (org/name).")],
    out: Annotated[Path, typer.Argument(help="Output store folder.")],
    sequential: Annotated[bool, typer.Option("--sequential/--no-sequential", help="One shard at a time; deletes each source shard after use.")] = False,
    compression: Annotated[str, typer.Option(help="none, 4bit (NF4) or 8bit.")] = "none",
    delete_original: Annotated[bool, typer.Option("--delete-original", help="Delete the whole source checkpoint when done.")] = False,
    profile: Annotated[bool, typer.Option("--profile", help="Print per-layer timings.")] = False,
    min_free_space: Annotated[str, typer.Option(help="Warn when less than this would stay free.")] = "1GB",
    layer_memory_warning: Annotated[Optional[str], typer.Option(help="Warn when one buffered layer exceeds this size.")] = None,
    token: Annotated[Optional[str], typer.Option(help="Hub token.", envvar="HF_TOKEN")] = None,
    revision: Annotated[Optional[str], typer.Option(help="Hub revision.")] = None,
    progress: Annotated[bool, typer.Option(help="Show progress bars.")] = True,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log each shard and part.")] = False,
) -> None:
    """Convert a Hugging Face checkpoint into a per-layer store."""
    from .convert import convert as run_convert

    _logging(verbose)
    report = run_convert(
        source, out,
        sequential_shard_processing=sequential,
        compression=None if compression.lower() == "none" else compression.lower(),
        delete_original=delete_original,
        profiling_mode=profile,
        min_free_space=parse_size(min_free_space, "--min-free-space"),
        layer_memory_warning=parse_size(layer_memory_warning, "--layer-memory-warning") if layer_memory_warning else None,
        token=token, revision=revision, progress=progress,
    )
    console.print(report.summary(), soft_wrap=True, highlight=False)


def _print_sharding(opened) -> None:
    """Where `shardstream shard` put experts (by tier) and which TP slice sets exist."""
    from .store.sharding import load_index

    index = load_index(opened)
    by_tier: dict[str, list[int]] = {}
    for record in index.experts.values():
        by_tier.setdefault(record.tier, []).append(index.files[record.file].size)
    for tier, sizes in by_tier.items():
        console.print(f"experts on tier {tier} ({index.tiers[tier]['root']}): {len(sizes)} files, {sum(sizes):,} bytes")
    for count in sorted({s.count for s in index.slices}):
        console.print(f"tensor-parallel slices: {count} ranks")


@app.command()
def inspect(store: Annotated[Path, typer.Argument(help="Store folder.")]) -> None:
    """List a store's parts: tensors, dtypes, bytes, quantization."""
    from .store import open_store

    opened = open_store(store, allow_incomplete=True)
    manifest = opened.manifest
    console.print(
        f"[bold]{store}[/bold]  model_type={manifest.config.get('model_type')}  family={manifest.family}  "
        f"compression={manifest.compression or 'none'}  format={manifest.format_version}  "
        f"{'complete' if manifest.complete else '[red]incomplete[/red]'}"
    )
    table = Table("part", "tensors", "dtypes", "bytes", "quantization", "files")
    for part in opened.parts:
        record = manifest.parts[part]
        tensors = [manifest.tensors[n] for n in record.tensors]
        dtypes = sorted({(t.quant or {}).get("dtype") or t.dtype for t in tensors})
        quants = sorted({t.quant["method"] for t in tensors if t.quant})
        tied = [n for n, a in manifest.aliases.items() if a["part"] == part]
        count = f"{len(tensors)}" + (f" (+{len(tied)} tied)" if tied else "")
        table.add_row(part, count, ",".join(dtypes), f"{record.nbytes:,}", ",".join(quants) or "-", str(len(record.files)))
    console.print(table)
    if manifest.sharding:
        _print_sharding(opened)
    missing = [p for p in manifest.expected_parts if p not in manifest.parts]
    if missing:
        console.print(f"[red]{len(missing)} parts not written yet[/red] (first: {missing[0]}); re-run the convert command.")


@app.command()
def verify(
    store: Annotated[Path, typer.Argument(help="Store folder.")],
    parts: Annotated[Optional[str], typer.Option(help="Comma-separated parts to check, e.g. mid/3,end or experts.")] = None,
) -> None:
    """Re-hash every file against the manifest (and the sharding index); exit 1 naming any bad file."""
    import time

    from .shard import verify_experts_and_slices
    from .store import open_store, verify_store

    started = time.perf_counter()
    wanted = parts.split(",") if parts else []
    store_parts = [p for p in wanted if p != "experts"]
    hashed, problems = (0, []) if wanted == ["experts"] else verify_store(store, store_parts or None)
    opened = open_store(store, allow_incomplete=True)
    if opened.manifest.sharding and (not wanted or "experts" in wanted):
        problems += verify_experts_and_slices(opened)
    seconds = time.perf_counter() - started
    for problem in problems:
        err_console.print(f"[red]{store / problem.file}: {problem.reason}[/red]", highlight=False)
    if problems:
        err_console.print("Re-run `shardstream convert` (or `shardstream shard`) with the same arguments to repair the store.")
        raise typer.Exit(1)
    console.print(f"OK: {hashed / 1e6:.1f} MB verified in {seconds:.2f} s ({hashed / 1e9 / max(seconds, 1e-9):.2f} GB/s)")


@app.command()
def shard(
    store: Annotated[Path, typer.Argument(help="Store folder.")],
    tp: Annotated[Optional[int], typer.Option("--tp", help="Write tensor-parallel slices for this many ranks.")] = None,
    experts: Annotated[bool, typer.Option("--experts", help="Store MoE experts as files on tiers.")] = False,
    tiers: Annotated[Optional[str], typer.Option(help="name=folder pairs, fastest first; relative = inside the store (default with --experts: hot=.).")] = None,
) -> None:
    """Export tensor-parallel slices, define storage tiers, and/or place MoE experts on them."""
    from .shard import define_tiers, export_tp, load_index, parse_tiers, place_experts
    from .store import open_store

    if tp is None and not experts and tiers is None:
        raise InvalidOption("shard needs --tp N, --experts and/or --tiers; pass at least one.")
    opened = open_store(store)
    if tp is not None:
        console.print(f"{len(export_tp(opened, tp))} slices written for {tp} ranks")
    if experts:
        console.print(f"{len(place_experts(opened, parse_tiers(tiers or 'hot=.')))} experts placed")
    elif tiers is not None:
        index = load_index(opened, for_update=True)
        define_tiers(opened, index, parse_tiers(tiers))
        index.save(opened)
        listed = ", ".join(f"{name}={tier['root']}" for name, tier in index.tiers.items())
        console.print(f"tiers: {listed}", soft_wrap=True, highlight=False)


@app.command()
def relocate(
    store: Annotated[Path, typer.Argument(help="Store folder.")],
    tier: Annotated[str, typer.Option(help="Target tier name.")],
    expert: Annotated[Optional[str], typer.Option(help="<layer>:<expert>, e.g. 12:7.")] = None,
    part: Annotated[Optional[str], typer.Option(help="A whole part: start, mid/<i> or end.")] = None,
) -> None:
    """Move one expert or part to another tier (copy, verify, switch the index, remove the old copy)."""
    from .shard import parse_expert_key, relocate_part
    from .shard import relocate as run_relocate
    from .store import open_store

    if (expert is None) == (part is None):
        raise InvalidOption("relocate needs exactly one of --expert <layer>:<expert> and --part <part>.")
    opened, progress = open_store(store), (lambda step: console.print(f"  {step}"))
    if part is not None:
        console.print(f"part {part} is on tier {relocate_part(opened, part, tier, on_step=progress)}")
        return
    layer, index = parse_expert_key(expert)
    record = run_relocate(opened, layer, index, tier, on_step=progress)
    console.print(f"expert {expert} is on tier {record.tier}")


def _mount_subcommands() -> None:
    """Commands whose code lives with their capability."""
    from .data.cli import data_app, train_command
    from .pipeline.cli import agent_command, coordinator_command
    from .stream.generate_cli import generate_command
    from .stream.serve_cli import serve_command

    app.command("generate", help="Generate text from a store, streaming layers; tokens print as they come.")(generate_command)
    app.command("serve", help="Serve a store over an OpenAI-compatible HTTP API.")(serve_command)

    app.command("agent", help="Run a pipeline agent on this device.")(agent_command)
    app.command("coordinator", help="Profile agents, plan, ship stages and generate across them.")(coordinator_command)
    app.command("train", help="Train a causal LM on a dataset streamed in blocks and chunks.")(train_command)
    app.add_typer(data_app, name="data", help="Inspect and move the training-data tracker.")


_mount_subcommands()


def main() -> None:
    """Console entry point: our errors become one line on stderr and exit code 1."""
    try:
        app()
    except ShardstreamError as exc:
        err_console.print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
        sys.exit(1)
    except KeyboardInterrupt:
        err_console.print("interrupted; re-run the same command to continue where it stopped.")
        sys.exit(130)


if __name__ == "__main__":
    main()
