"""The "brain bundle" in --output: checkpoint, optimizer state and step count, saved together.

A run with the same --output resumes from it: the weights and the optimizer continue where the
last run stopped while the tracker (by default OUTPUT/chunk_tracker.sqlite) continues the data
position, so model and data never restart apart. The tracker's own state is saved beside it as
chunk_tracker_state.json. A run that trained no step writes nothing.

A chunk is recorded done only after a saved checkpoint holds it (`save_checkpoint`): until then its
worker keeps it leased, so a run killed between saves gives those chunks back to the pool.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from transformers import PreTrainedModel

from shardstream.atomic import fsync_dir, write_with_atomic
from shardstream.data.config import TrainConfig
from shardstream.data.model import has_weights, load_tokenizer
from shardstream.data.tracker import ChunkTracker, Claim
from shardstream.data.tracker_state import STATE_FILENAME, write_state
from shardstream.errors import InvalidOption

BUNDLE_FILE = "training_state.pt"


def bundle_dir(cfg: TrainConfig) -> Path | None:
    """--output when an earlier run left a bundle there, else None (start from --model)."""
    if not (cfg.output / BUNDLE_FILE).is_file():
        return None
    if not has_weights(cfg.output):
        raise InvalidOption(f"--output {cfg.output} has {BUNDLE_FILE} but no model weights; move it aside or pass a new --output.")
    return cfg.output


def model_source(cfg: TrainConfig) -> str:
    """Where the weights to train come from: the bundle in --output if there is one, else --model."""
    return str(bundle_dir(cfg) or cfg.model)


def read_bundle(cfg: TrainConfig) -> dict | None:
    """{"optimizer": state or None, "total_steps": int} of the bundle in --output, or None."""
    if bundle_dir(cfg) is None:
        return None
    return torch.load(cfg.output / BUNDLE_FILE, weights_only=True)


def warn_if_tracker_ahead(cfg: TrainConfig, tracker_steps: int) -> None:
    """A run stopped between saves left steps in the tracker that are not in the weights: say so."""
    source = Path(model_source(cfg))
    saved = torch.load(source / BUNDLE_FILE, weights_only=True)["total_steps"] if (source / BUNDLE_FILE).is_file() else 0
    if tracker_steps > saved:
        print(f"warning: the tracker counts {tracker_steps} steps but the checkpoint in {source} holds {saved}; "
              "a run stopped before saving them, and the chunks it trained since its last save are trained again.",
              file=sys.stderr)


def _save_quietly(model: PreTrainedModel, folder: Path) -> None:
    """save_pretrained without its own progress bar: saves recur during a run, beside the run's bar."""
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(folder)
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def save_bundle(cfg: TrainConfig, model: PreTrainedModel, optimizer: dict | None, total_steps: int) -> None:
    """save_pretrained (+ tokenizer) into a temp folder, each file moved into --output atomically, then the bundle file."""
    cfg.output.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=cfg.output, prefix=".save-"))
    try:
        _save_quietly(model, tmp)
        load_tokenizer(cfg.model, cfg.tokenizer).save_pretrained(tmp)
        for file in tmp.iterdir():
            with open(file, "rb+") as handle:
                os.fsync(handle.fileno())   # durable before it takes the final name
            os.replace(file, cfg.output / file.name)
        fsync_dir(cfg.output)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    write_with_atomic(cfg.output / BUNDLE_FILE,
                      lambda tmp_path: torch.save({"optimizer": optimizer, "total_steps": total_steps}, tmp_path))


def save_checkpoint(cfg: TrainConfig, tracker: ChunkTracker, model: PreTrainedModel, optimizer: dict | None,
                    trained: list[tuple[Claim, int]]) -> list[tuple[Claim, int]]:
    """Save the weights, then record the chunks they hold (claim, samples) done, then the data position.

    In this order a run killed in between leaves chunks that a checkpoint holds still leased (they
    are trained again), never a chunk recorded done that no checkpoint holds. Returns the chunks
    this call completed (a lease taken over by another worker is not)."""
    save_bundle(cfg, model, optimizer, tracker.get_progress_stats()["total_steps"])
    completed = [(claim, samples) for claim, samples in trained if tracker.complete(claim, 0, samples)]
    write_state(cfg.output / STATE_FILENAME, tracker.export_state())
    return completed
