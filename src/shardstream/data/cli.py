"""`shardstream train` and `shardstream data ...`: thin wrappers that parse options and call the modules.

The main CLI mounts them (`app.command("train")(train_command)`, `app.add_typer(data_app, name="data")`)
and prints our errors' messages without a traceback.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from shardstream.cli_style import Command, Group
from shardstream.data.blocks import DEFAULT_CHUNK_SIZE, DEFAULT_SAMPLES_PER_BLOCK
from shardstream.data.tracker import open_tracker
from shardstream.data.tracker_state import read_state, write_state
from shardstream.data.config import DEFAULT_SAVE_EVERY, TrainConfig, default_cache_dir
from shardstream.data.workers import start_fork_server
from shardstream.errors import InvalidOption
from shardstream.options import real_number, whole_number

data_app = typer.Typer(help="Inspect and move the training data tracker.", no_args_is_help=True, cls=Group)


def _cuda_ids(value: str | None) -> tuple[int, ...]:
    if not value:
        return ()
    try:
        return tuple(int(i) for i in value.split(","))
    except ValueError:
        raise InvalidOption(f"--cuda-ids {value!r} is not a comma-separated list of GPU numbers; write it like 0,1.") from None


def train_command(
    model: Annotated[str, typer.Option(help="Folder with config.json (random init) or a full checkpoint.")],
    dataset_file: Annotated[str, typer.Option(help="A .txt/.jsonl/.parquet/.csv file, a folder of them, or hf://name:config:split.")],
    output: Annotated[Path, typer.Option(help="Where the checkpoint, optimizer state and chunk_tracker_state.json go; a rerun resumes from them.")],
    tokenizer: Annotated[Optional[str], typer.Option(help="Tokenizer folder or name; default: the --model folder.")] = None,
    tracker: Annotated[Optional[str], typer.Option(help="Path, sqlite:///relative/path, sqlite:////absolute/path or postgresql://...", show_default="OUTPUT/chunk_tracker.sqlite")] = None,
    cache_dir: Annotated[Path, typer.Option(help="Where data blocks are cached.")] = default_cache_dir(),
    text_field: Annotated[str, typer.Option(help="Column or JSON field with the text.")] = "text",
    dataset_chunk_size: Annotated[int, typer.Option(help="Samples per chunk, the unit of claiming.", callback=whole_number(1))] = DEFAULT_CHUNK_SIZE,
    samples_per_block: Annotated[int, typer.Option(help="Samples per cached block.", callback=whole_number(1))] = DEFAULT_SAMPLES_PER_BLOCK,
    steps: Annotated[Optional[int], typer.Option(help="Optimizer steps for this run (all workers together).", callback=whole_number(1))] = None,
    stop_after_epoch: Annotated[bool, typer.Option("--stop-after-epoch", help="Stop when the current epoch is done; what happens anyway without --iterate, spelled out.")] = False,
    iterate: Annotated[bool, typer.Option("--iterate", help="Roll into the next epoch when one ends, until --steps.")] = False,
    batch_size: Annotated[int, typer.Option(help="Samples per step and worker (per rank with --ddp).", callback=whole_number(1))] = 4,
    seq_len: Annotated[int, typer.Option(help="Tokens per sample; longer samples are truncated.", callback=whole_number(1))] = 128,
    lr: Annotated[float, typer.Option(help="AdamW learning rate.", callback=real_number(0, above=True))] = 3e-4,
    parallel_independent: Annotated[bool, typer.Option("--parallel-independent", help="Each worker trains its own replica on its own chunks; what happens anyway without --ddp, spelled out.")] = False,
    workers: Annotated[Optional[int], typer.Option(help="Worker processes; default: one per --cuda-ids entry, else 1.", callback=whole_number(1))] = None,
    cuda_ids: Annotated[Optional[str], typer.Option(help="GPUs to use, e.g. 0,1.")] = None,
    ddp: Annotated[bool, typer.Option("--ddp", help="torch.distributed data parallel (gloo on CPU) instead of independent replicas.")] = False,
    nproc: Annotated[int, typer.Option(help="Ranks for --ddp.", callback=whole_number(1))] = 2,
    lease_seconds: Annotated[float, typer.Option(help="A claimed chunk returns to the pool this long after its last heartbeat.", callback=real_number(0, above=True))] = 60.0,
    save_every: Annotated[int, typer.Option(help="Save the checkpoint every N steps (per worker); a chunk counts as done once a checkpoint holds it.", callback=whole_number(1))] = DEFAULT_SAVE_EVERY,
    log_file: Annotated[Optional[Path], typer.Option(help="Metrics as JSON lines.")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the random init from config.json.")] = 0,
) -> None:
    """Train a causal LM on chunks of a dataset handed out by the chunk tracker."""
    if ddp and parallel_independent:
        raise InvalidOption("--ddp and --parallel-independent exclude each other; pick one.")
    if iterate and stop_after_epoch:
        raise InvalidOption("--iterate and --stop-after-epoch exclude each other; pick one.")
    ids = _cuda_ids(cuda_ids)
    cfg = TrainConfig(model=model, dataset=dataset_file, output=output, tokenizer=tokenizer, tracker=tracker, cache_dir=cache_dir,
                      text_field=text_field, samples_per_block=samples_per_block, chunk_size=dataset_chunk_size, steps=steps,
                      iterate=iterate, batch_size=batch_size, seq_len=seq_len, lr=lr, workers=workers or max(1, len(ids)),
                      cuda_ids=ids, ddp=ddp, nproc=nproc, lease_seconds=lease_seconds, save_every=save_every, log_file=log_file,
                      seed=seed)
    if cfg.processes > 1:
        start_fork_server()   # the workers' imports, beside this process's own
    from shardstream.data.launch import train

    stats = train(cfg)
    progress = (f"epoch {stats['current_epoch']}: {stats['chunks_done']}/{stats['chunks_total']} chunks done "
                f"(tracker total {stats['total_steps']} steps)")
    if stats["steps_this_run"] == 0:
        typer.echo(f"trained 0 steps, {output} left as it was; {progress}. Pass --iterate to train the next epoch.")
        return
    typer.echo(f"trained {stats['steps_this_run']} steps; {progress}; checkpoint in {output} (a rerun with it resumes there)")


TrackerOption = Annotated[str, typer.Option(help="Path, sqlite:///relative/path, sqlite:////absolute/path or postgresql://...")]


@data_app.command("status", cls=Command)
def status_command(tracker: TrackerOption, as_json: Annotated[bool, typer.Option("--json", help="Print raw JSON.")] = False) -> None:
    """Progress of the current epoch, overall and per worker."""
    with open_tracker(tracker, must_exist=True) as t:
        stats = t.get_progress_stats()
    if as_json:
        typer.echo(json.dumps(stats, indent=1))
        return
    total = stats["total_blocks"] if stats["total_blocks"] is not None else "?"
    console = Console()
    console.print(f"[bold]{stats['source']}[/]  epoch {stats['current_epoch']}  blocks {stats['blocks_this_epoch']}/{total} done  "
                  f"chunks {stats['chunks_done']}/{stats['chunks_total']} done, {stats['chunks_leased']} leased "
                  f"({stats['chunks_expired']} expired), {stats['chunks_pending']} pending  total steps {stats['total_steps']}")
    table = Table("worker", "chunks done", "samples", "last step", "leased (block, chunk)")
    for name, w in stats["workers"].items():
        table.add_row(name, str(w["chunks_done"]), str(w["samples"]), str(w["last_step"] or "-"),
                      " ".join(f"({b}, {c})" for b, c in w["leased"]) or "-")
    console.print(table)


@data_app.command("export", cls=Command)
def export_command(tracker: TrackerOption, output: Annotated[Path, typer.Option(help="The JSON file to write.")]) -> None:
    """Write the whole tracker to a chunk_tracker_state.json file."""
    if output.is_dir():
        raise InvalidOption(f"--output {output} is a folder; give the JSON file to write, such as "
                            f"{output / 'chunk_tracker_state.json'}.")
    with open_tracker(tracker, must_exist=True) as t:
        state = t.export_state()
    try:
        write_state(output, state)
    except OSError as error:
        raise InvalidOption(f"cannot write --output {output} ({error.strerror}); give a file in a folder you can "
                            "write to.") from None
    typer.echo(f"wrote {output}")


@data_app.command("import", cls=Command)
def import_command(tracker: TrackerOption, state: Annotated[Path, typer.Option(help="A chunk_tracker_state.json file.")]) -> None:
    """Load a chunk_tracker_state.json file into a new, empty tracker."""
    loaded = read_state(state)   # a state file that cannot be read leaves no tracker behind
    with open_tracker(tracker) as t:
        t.import_state(loaded)
    typer.echo(f"imported {state} into {tracker}")
