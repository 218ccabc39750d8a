"""The training loop of one worker: claim a chunk, train on it step by step, repeat, saving as it goes.

Two shapes share it. Parallel-independent: every worker process has its own model replica and its
own claims. DDP: rank 0 alone talks to the tracker and broadcasts each claim (or "stop"), so all
ranks train the same chunk in lock step and all stop together when the data or the steps run out.

A trained chunk stays leased to its worker (heartbeats keep it) until a saved checkpoint holds it:
only that save records it done. The trainer saves every --save-every steps, before it waits for
other workers' chunks, and at the end: itself (one process, DDP rank 0), or, with several
independent workers, by leaving its replica in a file that the parent merges and saves.
"""

from __future__ import annotations

import json
import math
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

import torch

from shardstream.atomic import write_with_atomic
from shardstream.data.bundle import model_source, read_bundle, save_checkpoint
from shardstream.data.claiming import Budget, next_claim
from shardstream.data.config import TrainConfig
from shardstream.data.dataset import batches, encode, rank_slice
from shardstream.data.model import load_model, load_tokenizer
from shardstream.data.tracker import ChunkTracker, Claim, open_tracker

Trained = list[tuple[Claim, int]]   # chunks trained, with their sample counts


class MetricsLog:
    """JSON lines, one `os.write` per record on an O_APPEND file, so processes never interleave lines."""

    def __init__(self, path: Path | None) -> None:
        self.fd = None
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, record: dict) -> None:
        if self.fd is not None:
            os.write(self.fd, (json.dumps({"time": time.time(), **record}) + "\n").encode())

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)


def worker_name(index: int) -> str:
    return f"{socket.gethostname()}-w{index}-{os.getpid()}"


class Replica:
    """One model, its optimizer and tokenizer on one device: `step(texts)` is one optimizer step.

    Both resume from the bundle in --output when an earlier run left one there."""

    def __init__(self, cfg: TrainConfig, device: torch.device, wrap=None) -> None:
        self.cfg, self.device = cfg, device
        self.model = load_model(model_source(cfg), cfg.seed).to(device).train()
        self.tokenizer = load_tokenizer(cfg.model, cfg.tokenizer)
        self.trained = wrap(self.model) if wrap else self.model
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr)
        bundle = read_bundle(cfg)
        if bundle and bundle["optimizer"] is not None:
            self.optimizer.load_state_dict(bundle["optimizer"])
            for group in self.optimizer.param_groups:
                group["lr"] = cfg.lr   # this run's --lr, not the saved one

    def state(self) -> dict:
        """What a worker hands back: its weights and its optimizer's state."""
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def step(self, texts: list[str]) -> tuple[float, int]:
        batch = encode(self.tokenizer, texts, self.cfg.seq_len, self.device)
        loss = self.trained(**batch).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item(), int(batch["attention_mask"].sum())


def _log_step(log: MetricsLog, worker: str, step: int, claim: Claim, loss: float, tokens: int, seconds: float) -> None:
    log.write({"event": "step", "worker": worker, "step": step, "epoch": claim.epoch, "block": claim.block,
               "chunk": claim.chunk, "loss": round(loss, 5), "tokens": tokens, "tokens_per_s": round(tokens / max(seconds, 1e-9), 1)})


def log_chunks_done(log: MetricsLog, cfg: TrainConfig, completed: Trained) -> None:
    for claim, samples in completed:
        log.write({"event": "chunk_done", "worker": claim.owner, "epoch": claim.epoch, "block": claim.block,
                   "chunk": claim.chunk, "samples": samples, "samples_per_block": cfg.samples_per_block})


class Ledger:
    """What one trainer holds: the chunk it trains, the chunks it trained that no saved checkpoint
    holds yet (kept leased, so no one else takes them and a crash gives them back), and its steps."""

    def __init__(self, tracker: ChunkTracker, lease_seconds: float) -> None:
        self.tracker, self.lease = tracker, lease_seconds
        self.current: Claim | None = None
        self.trained: Trained = []
        self.steps = self.unreported = self.saved_steps = 0
        self.unsaved_chunks = False
        self.last_beat = time.monotonic()

    def step(self) -> bool:
        """Count a step on the current chunk, heartbeating every quarter lease; False once that chunk was lost."""
        self.steps, self.unreported = self.steps + 1, self.unreported + 1
        return time.monotonic() - self.last_beat <= self.lease / 4 or self.beat()

    def beat(self) -> bool:
        """Extend every lease held and report the steps taken; False if the current chunk's lease was lost."""
        self.trained = [(claim, n) for claim, n in self.trained if self.tracker.heartbeat(claim, self.lease)]
        self.last_beat = time.monotonic()
        if self.current is None:
            return True
        kept = self.tracker.heartbeat(self.current, self.lease, self.unreported)
        self.current = self.current if kept else None
        self.unreported = 0
        return kept

    def finish(self, samples: int) -> bool:
        """The current chunk is trained: hold it until a save. False if its lease was lost meanwhile."""
        kept = self.current is not None and self.tracker.heartbeat(self.current, self.lease, self.unreported)
        if kept:
            self.trained.append((self.current, samples))
            self.unsaved_chunks = True
        self.current, self.unreported = None, 0
        return kept

    def release(self) -> None:
        """Give the current chunk back at once (stopped mid-chunk); its steps are counted, not recorded as done."""
        if self.current is not None:
            self.tracker.release(self.current, self.unreported)
        self.current, self.unreported = None, 0

    def release_all(self) -> None:
        """Stopped by the user: every chunk held goes back to the pool now, not when its lease expires."""
        self.release()
        for claim, _ in self.trained:
            self.tracker.release(claim)
        self.trained = []

    def save_due(self, every: int | None = None) -> bool:
        """Every `every` steps; with None, whenever anything is not saved yet."""
        if every is None:
            return self.steps > self.saved_steps or self.unsaved_chunks
        return self.steps - self.saved_steps >= every

    def saved(self, completed: Trained) -> None:
        self.saved_steps, self.unsaved_chunks = self.steps, False
        self.trained = [held for held in self.trained if held not in completed]


def worker_file(results: Path, index: int) -> Path:
    return results / f"worker-{index}.pt"


def ready_file(results: Path, index: int) -> Path:
    """Exists once worker `index` has loaded its weights; the parent saves nothing over them before."""
    return results / f"worker-{index}.ready"


def _save(cfg: TrainConfig, replica: Replica, ledger: Ledger, log: MetricsLog, results: Path | None, index: int) -> None:
    """Save here (the checkpoint, then the chunks it holds are done), or leave the replica for the parent to merge."""
    if results is None:
        completed = save_checkpoint(cfg, ledger.tracker, replica.model, replica.optimizer.state_dict(), ledger.trained)
        log_chunks_done(log, cfg, completed)
    else:
        snapshot = {**replica.state(), "steps": ledger.steps, "trained": [(claim.token, n) for claim, n in ledger.trained]}
        write_with_atomic(worker_file(results, index), lambda tmp: torch.save(snapshot, tmp))
        completed = []
    ledger.saved(completed)


def _train_chunk(replica: Replica, ledger: Ledger, claim: Claim, texts: list[str], budget: Budget, log: MetricsLog,
                 worker: str, save_when_due: Callable[[], None]) -> bool:
    """Train one chunk; returns whether to go on (False: the budget ended, and the chunk went back to the pool).

    The chunk's steps are reserved from the budget up front, as DDP's rank 0 does, so a --steps that
    is a multiple of a chunk's steps ends on whole chunks with any number of workers."""
    todo = list(batches(texts, replica.cfg.batch_size))
    granted = budget.take(len(todo))
    for done, texts_batch in enumerate(todo):
        save_when_due()
        if done == granted:
            ledger.release()
            return False
        start = time.perf_counter()
        loss, tokens = replica.step(texts_batch)
        budget.count(1)
        kept = ledger.step()
        _log_step(log, worker, ledger.steps, claim, loss, tokens, time.perf_counter() - start)
        if not kept:
            log.write({"event": "lease_lost", "worker": worker, "epoch": claim.epoch, "block": claim.block, "chunk": claim.chunk})
            budget.give_back(granted - done - 1)
            return True
    ledger.finish(len(texts))
    save_when_due()
    return True


def run_independent(cfg: TrainConfig, index: int, budget: Budget, results: Path | None = None) -> None:
    """One parallel-independent worker until the data or the budget ends.

    Saves the checkpoint itself, or with `results` leaves its replica there as `worker-<index>.pt`."""
    worker = worker_name(index)
    replica = Replica(cfg, torch.device(cfg.device(index)))
    if results is not None:
        ready_file(results, index).touch()
    blocks, log = cfg.block_manager(), MetricsLog(cfg.log_file)
    with open_tracker(cfg.tracker_url) as tracker:
        ledger = Ledger(tracker, cfg.lease_seconds)

        def save_when_due(every: int | None = cfg.save_every) -> None:
            if ledger.save_due(every):
                _save(cfg, replica, ledger, log, results, index)

        def idle() -> None:
            save_when_due(None)
            ledger.beat()

        try:
            while (claim := next_claim(tracker, blocks, worker, cfg, budget, idle)) is not None:
                ledger.current = claim
                if not _train_chunk(replica, ledger, claim, blocks.chunk(claim.block, claim.chunk), budget, log, worker,
                                    save_when_due):
                    break
            save_when_due(None)
        except KeyboardInterrupt:
            ledger.release_all()
            raise
    log.close()


def run_ddp_rank(cfg: TrainConfig, rank: int, budget: Budget) -> None:
    """One DDP rank (the process group is already up); rank 0 claims and saves, everyone trains the same chunk."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    world = dist.get_world_size()
    device = torch.device(cfg.device(rank))
    replica = Replica(cfg, device, wrap=lambda m: DistributedDataParallel(m, device_ids=[device.index] if cfg.cuda_ids else None))
    blocks, log = cfg.block_manager(), MetricsLog(cfg.log_file if rank == 0 else None)
    tracker = open_tracker(cfg.tracker_url) if rank == 0 else None
    ledger = Ledger(tracker, cfg.lease_seconds) if rank == 0 else None
    worker = worker_name(rank)

    def save_when_due(every: int | None = cfg.save_every) -> None:
        if ledger.save_due(every):
            _save(cfg, replica, ledger, log, None, rank)

    def idle() -> None:
        save_when_due(None)
        ledger.beat()

    while True:
        message: list = [None]
        if rank == 0:
            claim = next_claim(tracker, blocks, worker, cfg, budget, idle)
            if claim is not None:
                ledger.current = claim
                total = math.ceil(len(blocks.chunk(claim.block, claim.chunk)) / (cfg.batch_size * world))
                message = [(claim, total, budget.take(total))]
        dist.broadcast_object_list(message, src=0)
        if message[0] is None:
            break
        claim, total, granted = message[0]
        texts = blocks.chunk(claim.block, claim.chunk)
        for global_batch in list(batches(texts, cfg.batch_size * world))[:granted]:
            if rank == 0:
                save_when_due()
            start = time.perf_counter()
            loss, tokens = replica.step(rank_slice(global_batch, rank, world))
            if rank == 0:
                budget.count(1)
                ledger.step()
                _log_step(log, worker, ledger.steps, claim, loss, tokens * world, time.perf_counter() - start)
        if rank == 0:
            if granted < total:
                ledger.release()
            else:
                ledger.finish(len(texts))
                save_when_due()
        if granted < total:
            break
    if rank == 0:
        save_when_due(None)
        tracker.close()
    log.close()
