"""The `shardstream` command. Thin: parse options, call the modules, print results.

User mistakes (our ShardstreamError classes) print one red sentence and exit 1, no traceback.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from . import __version__, interrupted
from .cli_style import Command, Group
from .errors import InvalidOption, PartNotFound, ShardstreamError
from .option_groups import Part, with_groups
from .options import ConversionOptions, OldHfToken, size, whole_number
from .sizes import parse_size

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False, cls=Group,
                  context_settings={"help_option_names": ["-h", "--help"]},
                  help="Run and train large language models on hardware too small for them.")
console = Console()
err_console = Console(stderr=True)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"shardstream {__version__}")
        raise typer.Exit()


@app.callback()
def _main_options(
    version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True, help="Print the version and exit.")] = False,
) -> None:
    """Options of `shardstream` itself; commands import torch and transformers only when they run."""


def _logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(name)s: %(message)s", stream=sys.stderr)
    warnings.simplefilter("default")
    warnings.showwarning = _show_warning


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A warning is one line saying what to know, like an error: not Python's file, line and source dump."""
    err_console.print(f"[yellow]warning:[/yellow] {message}", highlight=False, soft_wrap=True)


@app.command(cls=Command)
@with_groups(conversion=Part(ConversionOptions, leave_out=("store_path",)))
def convert(
    source: Annotated[str, typer.Argument(help="Local folder, HTTP(S) base URL, or Hub id (org/name).")],
    out: Annotated[Path, typer.Argument(help="Output store folder.")],
    conversion: ConversionOptions = ConversionOptions(),
    delete_original: Annotated[bool, typer.Option("--delete-original", help="Delete the whole source checkpoint when done.")] = False,
    profile: Annotated[bool, typer.Option("--profile", help="Print per-layer timings.")] = False,
    min_free_space: Annotated[str, typer.Option(help="Warn when less than this would stay free.", callback=size())] = "1GB",
    layer_memory_warning: Annotated[Optional[str], typer.Option(help="With --compression, warn when a layer to quantize (held in memory to do so) exceeds this size, e.g. 2GB.", show_default="no warning")] = None,
    no_progress: Annotated[bool, typer.Option("--no-progress", help="Draw no progress bars.")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log each shard and part.")] = False,
    token: OldHfToken = None,
) -> None:
    """Convert a Hugging Face checkpoint into a per-layer store."""
    from .convert import convert as run_convert

    _logging(verbose)
    with interrupted.rerun_continues():
        report = run_convert(
            source, out,
            conversion=replace(conversion, hf_token=token or conversion.hf_token),
            delete_original=delete_original,
            profiling_mode=profile,
            min_free_space=parse_size(min_free_space, "--min-free-space"),
            layer_memory_warning=parse_size(layer_memory_warning, "--layer-memory-warning") if layer_memory_warning else None,
            progress=not no_progress,
        )
    console.print(report.summary(), soft_wrap=True, highlight=False)


def _print_sharding(opened) -> None:
    """Where `shardstream shard` put experts (by tier) and which TP slice sets exist."""
    from .store.sharding import load_index

    index = load_index(opened)
    by_tier: dict[str, list[int]] = {}
    containers: dict[str, set[str]] = {}
    for record in index.experts.values():
        by_tier.setdefault(record.tier, []).append(record.length)
        containers.setdefault(record.tier, set()).add(record.file)
    for tier, sizes in by_tier.items():
        console.print(f"experts on tier {tier} ({index.tiers[tier]['root']}): {len(sizes)} experts in "
                      f"{len(containers[tier])} files, {sum(sizes):,} bytes")
    for count in sorted({s.count for s in index.slices}):
        console.print(f"tensor-parallel slices: {count} ranks")


@app.command(cls=Command)
def inspect(store: Annotated[Path, typer.Argument(help="Store folder.")]) -> None:
    """List a store's parts: tensors, original dtypes, bytes, quantization; name missing files."""
    from .quant import DTYPES
    from .store import open_store
    from .store.dtypes import SAFETENSORS_DTYPES

    opened = open_store(store, allow_incomplete=True)
    manifest = opened.manifest
    absent = [name for part in opened.parts for name in manifest.parts[part].files
              if not opened.remote and not opened.file_path(name).is_file()]
    state = "incomplete" if not manifest.complete else f"damaged: {len(absent)} missing" if absent else "complete"
    console.print(
        f"[bold]{store}[/bold]  model_type={manifest.config.get('model_type')}  family={manifest.family}  "
        f"compression={manifest.compression or 'none'}  format={manifest.format_version}  "
        f"{state if state == 'complete' else f'[red]{state}[/red]'}"
    )
    table = Table("part", "tensors", "dtypes (original)", "bytes", "quantization", "files")
    for part in opened.parts:
        record = manifest.parts[part]
        tensors = [manifest.tensors[n] for n in record.tensors]
        dtypes = sorted({SAFETENSORS_DTYPES[DTYPES[t.quant["dtype"]]] if t.quant else t.dtype for t in tensors})
        quants = sorted({t.quant["method"] for t in tensors if t.quant})
        tied = [n for n, a in manifest.aliases.items() if a["part"] == part]
        count = f"{len(tensors)}" + (f" (+{len(tied)} tied)" if tied else "")
        gone = sum(name in absent for name in record.files)
        files = f"{len(record.files)}" + (f" [red]({gone} missing)[/red]" if gone else "")
        table.add_row(part, count, ",".join(dtypes), f"{record.nbytes:,}", ",".join(quants) or "-", files)
    console.print(table)
    if manifest.sharding:
        _print_sharding(opened)
    for name in absent:
        console.print(f"[red]{store / name}: missing[/red]; run `shardstream verify {store}`, then re-run the convert command.",
                      highlight=False)
    missing = [p for p in manifest.expected_parts if p not in manifest.parts]
    if missing:
        console.print(f"[red]{len(missing)} parts not written yet[/red] (first: {missing[0]}); re-run the convert command.")


@app.command(cls=Command)
def verify(
    store: Annotated[Path, typer.Argument(help="Store folder.")],
    parts: Annotated[Optional[str], typer.Option(help="Comma-separated parts to check, e.g. mid/3,end or experts.")] = None,
) -> None:
    """Re-hash every file against the manifest (and the sharding index); exit 1 naming any bad file."""
    import time

    from .store import open_store, verify_sharding, verify_store
    from .store.problems import REPAIR, repair

    started = time.perf_counter()
    opened = open_store(store, allow_incomplete=True)   # a file or a folder without a store: one sentence
    wanted = [part.strip() for part in parts.split(",") if part.strip()] if parts is not None else []
    if parts is not None and not wanted:
        raise InvalidOption("--parts names no part; give part names such as mid/3,end, or leave it out to check all.")
    if "experts" in wanted and not opened.manifest.sharding:
        raise PartNotFound(f"the store at {store} has no experts stored apart to check (`shardstream shard --experts` "
                           "places them); leave experts out of --parts.")
    store_parts = [p for p in wanted if p != "experts"]
    hashed, problems = (0, []) if wanted == ["experts"] else verify_store(store, store_parts or None)
    if opened.manifest.sharding and (not wanted or "experts" in wanted):
        sliced, more = verify_sharding(opened)
        hashed, problems = hashed + sliced, problems + more
    seconds = time.perf_counter() - started
    for problem in problems:
        err_console.print(f"[red]{store / problem.file}: {problem.reason}[/red]", highlight=False)
    if problems:
        advice = repair(opened.manifest, [p.file for p in problems])
        err_console.print("Re-run `shardstream convert` (or `shardstream shard`) with the same arguments to repair the store."
                          if advice == REPAIR else f"To repair the store: {advice}.", highlight=False, soft_wrap=True)
        raise typer.Exit(1)
    console.print(f"OK: {hashed / 1e6:.1f} MB verified in {seconds:.2f} s ({hashed / 1e9 / max(seconds, 1e-9):.2f} GB/s)")


@app.command(cls=Command)
def shard(
    store: Annotated[Path, typer.Argument(help="Store folder.")],
    tp: Annotated[Optional[int], typer.Option("--tp", help="Write tensor-parallel slices for this many ranks.",
                                              callback=whole_number(1))] = None,
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
        placed = place_experts(opened, parse_tiers(tiers or "hot=."))
        on_tier = Counter(record.tier for record in placed.values())
        known = load_index(opened).tiers   # fastest first
        where = ", ".join(f"{on_tier[name]} on {name}" for name in sorted(known, key=lambda n: known[n]["hint"])
                          if on_tier[name])
        console.print(f"{len(placed)} experts placed: {where}", soft_wrap=True, highlight=False)
    elif tiers is not None:
        index = load_index(opened, for_update=True)
        define_tiers(opened, index, parse_tiers(tiers))
        index.save(opened)
        listed = ", ".join(f"{name}={tier['root']}" for name, tier in index.tiers.items())
        console.print(f"tiers: {listed}", soft_wrap=True, highlight=False)


@app.command(cls=Command)
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
    from .front.generate_cli import generate_command
    from .front.serve_cli import serve_command

    app.command("generate", cls=Command, help="Generate text from a store, streaming layers; tokens print as they come.")(generate_command)
    app.command("serve", cls=Command, help="Serve a store over an OpenAI-compatible HTTP API.")(serve_command)

    app.command("agent", cls=Command, help="Run a pipeline agent on this device.")(agent_command)
    app.command("coordinator", cls=Command, help="Profile agents, plan, ship stages and generate across them.")(coordinator_command)
    app.command("train", cls=Command, help="Train a causal LM on a dataset streamed in blocks and chunks.")(
        _continues_on_rerun(train_command))
    app.add_typer(data_app, name="data", help="Inspect and move the training-data tracker.")


def _continues_on_rerun(command: Callable) -> Callable:
    """`command`, run inside `interrupted.rerun_continues()` (typer reads the wrapped one's options)."""
    @functools.wraps(command)
    def run(*args, **kwargs):
        with interrupted.rerun_continues():
            return command(*args, **kwargs)

    return run


_mount_subcommands()


def use_huge_pages_for_tensors() -> None:
    """Ask torch's CPU allocator for transparent huge pages on tensors of 2 MiB or more (PyTorch's
    `THP_MEM_ALLOC_ENABLE`, read once when torch first allocates, so set before it is imported; a
    user's own setting wins). Every pass over the blocks makes fresh activations, each of 1 MiB or more
    mapped anew (admission.map_large_allocations) and faulted in page by page; huge pages take fewer faults
    at the same peak memory (docs/BENCHMARKS.md, section "Many tokens per weight read"). The kernel ignores
    the hint where transparent huge pages are off."""
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


def main() -> None:
    """Console entry point: our errors and click's usage errors (a bad option value, a missing
    argument) become one line on stderr; exit code 2 for a usage error (click's), 1 for ours."""
    from typer._click.exceptions import ClickException  # typer's bundled click (typer is pinned)

    use_huge_pages_for_tensors()

    try:
        code = app(prog_name="shardstream", standalone_mode=False)
    except (ShardstreamError, ClickException) as exc:
        message = exc.format_message() if isinstance(exc, ClickException) else str(exc)
        hint = f" (see `{exc.ctx.command_path} -h`)" if getattr(exc, "ctx", None) is not None else ""
        # the message is text, not markup: a path or a library's message may hold brackets ("[/__w/...]")
        err_console.print(f"[red]error:[/red] {escape(message + hint)}", highlight=False, soft_wrap=True, markup=True)
        sys.exit(exc.exit_code if isinstance(exc, ClickException) else 1)
    except KeyboardInterrupt:
        code = 130
    if code == 130:
        err_console.print(interrupted.message())
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
