"""The training loop of one worker: claim a chunk, train on it step by step, complete it, repeat.

Two shapes share it. Parallel-independent: every worker process has its own model replica and its
own claims. DDP: rank 0 alone talks to the tracker and broadcasts each claim (or "stop"), so all
ranks train the same chunk in lock step and all stop together when the data or the steps run out.
"""

from __future__ import annotations

import json
import math
import os
import socket
import time
from pathlib import Path

import torch

from shardstream.data.bundle import model_source, read_bundle
from shardstream.data.claiming import Budget, next_claim
from shardstream.data.config import TrainConfig
from shardstream.data.dataset import batches, encode, rank_slice
from shardstream.data.model import load_model, load_tokenizer
from shardstream.data.tracker import ChunkTracker, Claim, open_tracker


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


def _train_chunk(replica: Replica, tracker: ChunkTracker, claim: Claim, texts: list[str], budget: Budget,
                 log: MetricsLog, worker: str, steps_so_far: int) -> tuple[int, bool]:
    """Train one chunk; returns (steps taken, go on?). Stops early if the lease is lost or the budget ends."""
    lease = replica.cfg.lease_seconds
    taken = unreported = 0
    last_beat = time.monotonic()
    for texts_batch in batches(texts, replica.cfg.batch_size):
        if budget.take(1) == 0:
            tracker.release(claim, unreported)
            return taken, False
        start = time.perf_counter()
        loss, tokens = replica.step(texts_batch)
        taken, unreported = taken + 1, unreported + 1
        budget.count(1)
        _log_step(log, worker, steps_so_far + taken, claim, loss, tokens, time.perf_counter() - start)
        if time.monotonic() - last_beat > lease / 4:
            if not tracker.heartbeat(claim, lease, unreported):
                log.write({"event": "lease_lost", "worker": worker, "epoch": claim.epoch, "block": claim.block, "chunk": claim.chunk})
                return taken, True
            unreported, last_beat = 0, time.monotonic()
    if tracker.complete(claim, unreported, len(texts)):
        log.write({"event": "chunk_done", "worker": worker, "epoch": claim.epoch, "block": claim.block, "chunk": claim.chunk,
                   "samples": len(texts), "samples_per_block": replica.cfg.samples_per_block})
    return taken, True


def run_independent(cfg: TrainConfig, index: int, budget: Budget) -> dict:
    """One parallel-independent worker until the data or the budget ends; returns `Replica.state()`."""
    worker = worker_name(index)
    replica = Replica(cfg, torch.device(cfg.device(index)))
    blocks, log = cfg.block_manager(), MetricsLog(cfg.log_file)
    with open_tracker(cfg.tracker_url) as tracker:
        steps = 0
        while (claim := next_claim(tracker, blocks, worker, cfg, budget)) is not None:
            taken, go_on = _train_chunk(replica, tracker, claim, blocks.chunk(claim.block, claim.chunk), budget, log, worker, steps)
            steps += taken
            if not go_on:
                break
    log.close()
    return replica.state()


def run_ddp_rank(cfg: TrainConfig, rank: int, budget: Budget) -> dict:
    """One DDP rank (the process group is already up); rank 0 claims, everyone trains the same chunk."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    world = dist.get_world_size()
    device = torch.device(cfg.device(rank))
    replica = Replica(cfg, device, wrap=lambda m: DistributedDataParallel(m, device_ids=[device.index] if cfg.cuda_ids else None))
    blocks, log = cfg.block_manager(), MetricsLog(cfg.log_file if rank == 0 else None)
    tracker = open_tracker(cfg.tracker_url) if rank == 0 else None
    worker, steps = worker_name(rank), 0
    while True:
        message: list = [None]
        if rank == 0:
            claim = next_claim(tracker, blocks, worker, cfg, budget)
            if claim is not None:
                total = math.ceil(len(blocks.chunk(claim.block, claim.chunk)) / (cfg.batch_size * world))
                message = [(claim, total, budget.take(total))]
        dist.broadcast_object_list(message, src=0)
        if message[0] is None:
            break
        claim, total, granted = message[0]
        texts = blocks.chunk(claim.block, claim.chunk)
        global_batches = list(batches(texts, cfg.batch_size * world))[:granted]
        last_beat = time.monotonic()
        for i, global_batch in enumerate(global_batches, 1):
            start = time.perf_counter()
            loss, tokens = replica.step(rank_slice(global_batch, rank, world))
            steps += 1
            if rank == 0:
                budget.count(1)
                _log_step(log, worker, steps, claim, loss, tokens * world, time.perf_counter() - start)
                if time.monotonic() - last_beat > cfg.lease_seconds / 4:
                    tracker.heartbeat(claim, cfg.lease_seconds, 0)
                    last_beat = time.monotonic()
        if rank == 0:
            if granted < total:
                tracker.release(claim, granted)
            elif tracker.complete(claim, granted, len(texts)):
                log.write({"event": "chunk_done", "worker": worker, "epoch": claim.epoch, "block": claim.block,
                           "chunk": claim.chunk, "samples": len(texts), "samples_per_block": cfg.samples_per_block})
        if granted < total:
            break
    if tracker is not None:
        tracker.close()
    log.close()
    return replica.state()
