"""Run a training job: prepare the tracker, start the worker processes, show progress, save the result.

The parent never trains when there are several processes; it watches, and with independent
workers it merges the replicas they leave as files into the checkpoint. A worker killed by a
signal is tolerated (its leases expire and another worker trains its chunks), a worker that failed
with one of our errors makes the run fail with it. Ctrl-C or SIGTERM stops every worker.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import wait
from pathlib import Path

import torch

from shardstream import errors
from shardstream.data.bundle import BUNDLE_FILE, model_source, save_checkpoint, warn_if_tracker_ahead
from shardstream.data.config import TrainConfig
from shardstream.data.model import average_state_dicts, check_model_folder, load_model, load_tokenizer
from shardstream.data.readers import iter_samples
from shardstream.data.tracker import ChunkTracker, Claim, open_tracker
from shardstream.data.tracker_state import STATE_FILENAME, read_state
from shardstream.data.workers import CONTEXT, sigint_ignored
from shardstream.data.train import Budget, MetricsLog, log_chunks_done, ready_file, run_ddp_rank, run_independent
from shardstream.errors import DatasetError, InvalidOption, ShardstreamError, WorkerFailed

MERGE_POLL_S = 0.5   # how often the parent looks for replicas to merge
STOP_GRACE_S = 5.0   # a stopped worker that has not exited by then is killed


def check_config(cfg: TrainConfig) -> None:
    if cfg.steps is not None and cfg.steps < 1:
        raise InvalidOption("--steps must be at least 1; leave it out to train until the data ends.")
    if cfg.processes < 1 or cfg.batch_size < 1 or cfg.save_every < 1 or cfg.lease_seconds <= 0:
        raise InvalidOption("--workers, --nproc, --batch-size and --save-every must be at least 1 and --lease-seconds positive; "
                            "fix the value.")
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


def _process_main(cfg: TrainConfig, index: int, budget: Budget, results: Path, environ: dict[str, str]) -> None:
    """Entry point of a worker: train (leaving its replica in `results`, or saving as DDP rank 0), or leave the error as a file.

    It takes the parent's environment as it is now (multiprocessing gives it the parent's folder): the
    fork server it comes from may have started for an earlier run, in another environment."""
    os.environ.clear()
    os.environ.update(environ)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // cfg.processes))
    try:
        if cfg.ddp:
            import torch.distributed as dist

            # rendezvous through a file in the run's fresh folder: no port to pick (and race for) in advance;
            # a FileStore takes the path as it is, where a file:// URL would read a relative one as a host name
            store = dist.FileStore(str((results / "rendezvous").resolve()), cfg.nproc)
            dist.init_process_group("nccl" if cfg.cuda_ids else "gloo", store=store, rank=index, world_size=cfg.nproc)
            run_ddp_rank(cfg, index, budget)
            dist.destroy_process_group()
        else:
            run_independent(cfg, index, budget, results)
    except ShardstreamError as e:
        (results / f"worker-{index}.error.json").write_text(json.dumps({"class": type(e).__name__, "message": str(e)}))
        sys.exit(1)


def _merge(cfg: TrainConfig, results: Path, tracker: ChunkTracker, log: MetricsLog) -> None:
    """Save the workers' latest replicas as one checkpoint, then record the chunks they hold done.

    The average is weighted by the steps each replica took in this run (all start from the same
    weights), so a worker that trained nothing changes nothing; a single trained replica is saved
    as it is, with its optimizer state."""
    snapshots = [torch.load(path, weights_only=True) for path in sorted(results.glob("worker-*.pt"))]
    snapshots = [s for s in snapshots if s["steps"] > 0]
    if not snapshots:
        return
    model = load_model(cfg.model, cfg.seed)
    model.load_state_dict(average_state_dicts([s["model"] for s in snapshots], [s["steps"] for s in snapshots]))
    optimizer = snapshots[0]["optimizer"] if len(snapshots) == 1 else None
    trained = [(Claim(*token), samples) for s in snapshots for token, samples in s["trained"]]
    log_chunks_done(log, cfg, save_checkpoint(cfg, tracker, model, optimizer, trained))


def _start(procs: list[mp.Process]) -> None:
    """Start the workers, and the fork server if the command line has not: with SIGINT ignored, which they keep."""
    with sigint_ignored():
        for p in procs:
            p.start()


def _stop(procs: list[mp.Process]) -> None:
    """SIGTERM to every worker still running, SIGKILL to any that outlives the grace period."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(STOP_GRACE_S)
        if p.is_alive():
            p.kill()
            p.join()


def _run_processes(cfg: TrainConfig, budget: Budget, results: Path) -> None:
    """Run the workers to the end, merging and saving their replicas whenever one leaves a new one."""
    procs = [CONTEXT.Process(target=_process_main, args=(cfg, i, budget, results, dict(os.environ)), daemon=False)
             for i in range(cfg.processes)]
    seen: dict[Path, int] = {}

    def merge_if_new(tracker: ChunkTracker, log: MetricsLog) -> None:
        # not before every live worker has loaded its weights: they must all start from the same ones
        if any(p.is_alive() and not ready_file(results, i).exists() for i, p in enumerate(procs)):
            return
        current = {path: path.stat().st_mtime_ns for path in results.glob("worker-*.pt")}
        if current != seen:
            seen.update(current)
            _merge(cfg, results, tracker, log)

    try:
        _start(procs)
        with open_tracker(cfg.tracker_url) as tracker:
            log = MetricsLog(cfg.log_file)
            while any(p.is_alive() for p in procs):
                wait([p.sentinel for p in procs], timeout=MERGE_POLL_S)
                if not cfg.ddp:
                    merge_if_new(tracker, log)
            for i, p in enumerate(procs):
                error = results / f"worker-{i}.error.json"
                if error.exists():
                    info = json.loads(error.read_text())
                    raise getattr(errors, info["class"], WorkerFailed)(info["message"])
                if p.exitcode:
                    print(f"warning: worker {i} (pid {p.pid}) exited with code {p.exitcode}; its chunks went back to the pool "
                          "when their leases expired.", file=sys.stderr)
            if all(p.exitcode for p in procs):
                raise WorkerFailed(f"every worker process failed (exit codes {[p.exitcode for p in procs]}); see the messages above.")
            if not cfg.ddp:
                merge_if_new(tracker, log)
            log.close()
    finally:
        _stop(procs)


def _progress(cfg: TrainConfig, budget: Budget, stop: threading.Event) -> None:
    """Console progress bar, fed by the shared step counter and the tracker's epoch numbers."""
    from tqdm import tqdm

    with open_tracker(cfg.tracker_url) as tracker, tqdm(total=cfg.steps, unit="step", desc="train", disable=None) as bar:
        while not stop.wait(0.5):
            bar.update(budget.steps_done - bar.n)
            stats = tracker.get_progress_stats()
            bar.set_postfix(epoch=stats["current_epoch"], chunks=f"{stats['chunks_done']}/{stats['chunks_total']}")
        bar.update(budget.steps_done - bar.n)


def check_inputs(cfg: TrainConfig) -> None:
    """Everything a user can get wrong, checked before anything is created: options, model folder,
    dataset (its first sample), tokenizer."""
    check_config(cfg)
    check_model_folder(cfg.model)
    if next(iter_samples(cfg.dataset, cfg.text_field), None) is None:   # the path, the format and --text-field
        raise DatasetError(f"dataset {cfg.dataset} has no non-empty samples; check the file contents or --text-field.")
    load_tokenizer(cfg.model, cfg.tokenizer)


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


@contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """SIGTERM stops a run as Ctrl-C does: a KeyboardInterrupt that stops the workers on its way out."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def _removed_unless_saved(cfg: TrainConfig) -> Iterator[None]:
    """A run that fails or is stopped before its first save removes the default tracker and the
    --output folder it created: no checkpoint holds anything they record."""
    tracker = Path(cfg.tracker_url)
    files = [tracker, *(tracker.with_name(tracker.name + suffix) for suffix in ("-wal", "-shm", ".lock"))]
    created = [path for path in files if not path.exists()] if cfg.tracker is None else []
    output_created = not cfg.output.exists()
    try:
        yield
    except BaseException:
        if not (cfg.output / BUNDLE_FILE).exists():
            for path in created:
                path.unlink(missing_ok=True)
            if output_created and cfg.output.is_dir() and not any(cfg.output.iterdir()):
                cfg.output.rmdir()
        raise


def train(cfg: TrainConfig) -> dict:
    """Train until --steps, the end of the epoch, or (with --iterate) forever; returns progress stats.

    Validates first and creates last; a run that trains no step leaves --output as it was. Ctrl-C
    or SIGTERM stops every worker (KeyboardInterrupt); what the last save holds is kept."""
    check_inputs(cfg)
    budget = Budget(cfg.steps)
    with _sigterm_interrupts(), _removed_unless_saved(cfg):
        prepare_tracker(cfg)
        stop = threading.Event()
        bar = threading.Thread(target=_progress, args=(cfg, budget, stop), daemon=True)
        bar.start()
        try:
            if cfg.processes == 1 and not cfg.ddp:
                run_independent(cfg, 0, budget)
            else:
                cfg.output.mkdir(parents=True, exist_ok=True)
                with tempfile.TemporaryDirectory(dir=cfg.output, prefix=".workers-") as results:
                    _run_processes(cfg, budget, Path(results))
        finally:
            stop.set()
            bar.join()
    with open_tracker(cfg.tracker_url) as tracker:
        stats = tracker.get_progress_stats()
    return {**stats, "steps_this_run": budget.steps_done}
