"""Run a training job: prepare the tracker, start the worker processes, show progress, save the result.

The parent never trains when there are several processes; it only watches. Workers hand their
weights back as files; a worker killed by a signal is tolerated (its lease expires and another
worker trains its chunk), a worker that failed with one of our errors makes the run fail with it.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import tempfile
import threading
from pathlib import Path

import torch

from shardstream import errors
from shardstream.atomic import write_with_atomic
from shardstream.data.bundle import model_source, save_bundle, warn_if_tracker_ahead
from shardstream.data.model import average_state_dicts, check_model_folder, load_tokenizer
from shardstream.data.readers import local_files, parse_hub
from shardstream.data.tracker import open_tracker
from shardstream.data.tracker_state import STATE_FILENAME, read_state, write_state
from shardstream.data.config import TrainConfig
from shardstream.data.train import Budget, run_ddp_rank, run_independent
from shardstream.errors import InvalidOption, ShardstreamError, WorkerFailed


def check_config(cfg: TrainConfig) -> None:
    if cfg.steps is not None and cfg.steps < 1:
        raise InvalidOption("--steps must be at least 1; leave it out to train until the data ends.")
    if cfg.processes < 1 or cfg.batch_size < 1 or cfg.lease_seconds <= 0:
        raise InvalidOption("--workers, --nproc and --batch-size must be at least 1 and --lease-seconds positive; fix the value.")
    if cfg.cuda_ids and not torch.cuda.is_available():
        raise InvalidOption("--cuda-ids was given but CUDA is not available here; leave it out to train on CPU.")


def prepare_tracker(cfg: TrainConfig) -> None:
    """Create or check the tracker; a fresh one picks up the data position saved with the checkpoint it resumes."""
    with open_tracker(cfg.tracker_url) as tracker:
        saved = Path(model_source(cfg)) / STATE_FILENAME
        if tracker.is_empty() and saved.is_file():
            tracker.import_state(read_state(saved))
        tracker.setup(cfg.dataset, cfg.samples_per_block, cfg.chunk_size)
        warn_if_tracker_ahead(cfg, tracker.get_progress_stats()["total_steps"])


def _process_main(cfg: TrainConfig, index: int, budget: Budget, results: Path) -> None:
    """Entry point of a spawned worker: train, then leave weights or the error as a file."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // cfg.processes))
    try:
        if cfg.ddp:
            import torch.distributed as dist

            # rendezvous through a file in the run's fresh folder: no port to pick (and race for) in advance
            dist.init_process_group("nccl" if cfg.cuda_ids else "gloo", init_method=f"file://{results / 'rendezvous'}",
                                    rank=index, world_size=cfg.nproc)
            state = run_ddp_rank(cfg, index, budget)
            dist.destroy_process_group()
            if index != 0:
                return
        else:
            state = run_independent(cfg, index, budget)
        write_with_atomic(results / f"worker-{index}.pt", lambda tmp: torch.save(state, tmp))
    except ShardstreamError as e:
        (results / f"worker-{index}.error.json").write_text(json.dumps({"class": type(e).__name__, "message": str(e)}))
        sys.exit(1)


def _run_processes(cfg: TrainConfig, budget: Budget, results: Path) -> list[dict]:
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_process_main, args=(cfg, i, budget, results), daemon=False) for i in range(cfg.processes)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    for i, p in enumerate(procs):
        error = results / f"worker-{i}.error.json"
        if error.exists():
            info = json.loads(error.read_text())
            raise getattr(errors, info["class"], WorkerFailed)(info["message"])
        if p.exitcode:
            print(f"warning: worker {i} (pid {p.pid}) exited with code {p.exitcode}; its chunk went back to the pool "
                  "when its lease expired.", file=sys.stderr)
    found = sorted(results.glob("worker-*.pt"))
    if not found:
        raise WorkerFailed(f"every worker process failed (exit codes {[p.exitcode for p in procs]}); see the messages above.")
    return [torch.load(path, weights_only=True) for path in found]


def _progress(cfg: TrainConfig, budget: Budget, stop: threading.Event) -> None:
    """Console progress bar, fed by the shared step counter and the tracker's epoch numbers."""
    from tqdm import tqdm

    with open_tracker(cfg.tracker_url) as tracker, tqdm(total=cfg.steps, unit="step", desc="train", disable=None) as bar:
        while not stop.wait(0.5):
            bar.update(budget.done.value - bar.n)
            stats = tracker.get_progress_stats()
            bar.set_postfix(epoch=stats["current_epoch"], chunks=f"{stats['chunks_done']}/{stats['chunks_total']}")
        bar.update(budget.done.value - bar.n)


def check_inputs(cfg: TrainConfig) -> None:
    """Everything a user can get wrong, checked before anything is created: options, model folder, dataset, tokenizer."""
    check_config(cfg)
    check_model_folder(cfg.model)
    if cfg.dataset.startswith("hf://"):
        parse_hub(cfg.dataset)
    else:
        local_files(cfg.dataset)
    load_tokenizer(cfg.model, cfg.tokenizer)


def train(cfg: TrainConfig) -> dict:
    """Train until --steps, the end of the epoch, or (with --iterate) forever; returns progress stats.

    Validates first and creates last; a run that trains no step leaves --output as it was."""
    check_inputs(cfg)
    prepare_tracker(cfg)
    budget = Budget(cfg.steps)
    stop = threading.Event()
    bar = threading.Thread(target=_progress, args=(cfg, budget, stop), daemon=True)
    bar.start()
    try:
        if cfg.processes == 1 and not cfg.ddp:
            states = [run_independent(cfg, 0, budget)]
        else:
            cfg.output.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=cfg.output, prefix=".workers-") as results:
                states = _run_processes(cfg, budget, Path(results))
    finally:
        stop.set()
        bar.join()
    with open_tracker(cfg.tracker_url) as tracker:
        stats = tracker.get_progress_stats()
        if budget.done.value:
            # one optimizer state only when every replica shares it (one worker, or DDP's rank 0)
            optimizer = states[0]["optimizer"] if len(states) == 1 else None
            save_bundle(cfg, average_state_dicts([s["model"] for s in states]), optimizer, stats["total_steps"])
            write_state(cfg.output / STATE_FILENAME, tracker.export_state())
    return {**stats, "steps_this_run": budget.done.value}
