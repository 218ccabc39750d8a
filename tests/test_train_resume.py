"""Re-running `shardstream train` with the same --output resumes model, optimizer and data together.

Real `shardstream` subprocesses on a tiny random-init Llama; the reference is one uninterrupted run.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

from conftest_data import REPO, read_jsonl, tiny_model, write_txt  # noqa: F401  (fixtures)

from shardstream.data.config import TrainConfig
from shardstream.data.launch import train

CLI = [sys.executable, "-m", "shardstream.cli"]
# 48 samples in chunks of 8, batch 4: 2 steps a chunk, 12 steps an epoch.
SHAPE = {"samples_per_block": 24, "chunk_size": 8, "batch_size": 4, "seq_len": 16, "lr": 0.01}


def _shardstream(tmp_path: Path, model: Path, output: str, log: str, *extra: str) -> subprocess.CompletedProcess:
    args = ["train", "--model", model, "--dataset-file", tmp_path / "corpus.txt", "--output", output,
            "--cache-dir", tmp_path / "cache", "--log-file", log, "--samples-per-block", SHAPE["samples_per_block"],
            "--dataset-chunk-size", SHAPE["chunk_size"], "--batch-size", SHAPE["batch_size"], "--seq-len", SHAPE["seq_len"],
            "--lr", SHAPE["lr"], *extra]
    result = subprocess.run([*CLI, *map(str, args)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return result


def _losses(path: Path) -> list[float]:
    return [r["loss"] for r in read_jsonl(path) if r["event"] == "step"]


def _bundle(output: Path) -> dict[str, str]:
    """Digest of every file in --output but the live tracker database."""
    digests = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in output.iterdir()
               if p.is_file() and not p.name.startswith("chunk_tracker.sqlite")}
    assert {"model.safetensors", "training_state.pt", "chunk_tracker_state.json"} <= set(digests)
    return digests


def test_rerun_continues_the_training_and_an_exhausted_epoch_changes_nothing(tmp_path, tiny_model):
    write_txt(tmp_path / "corpus.txt", 48)
    _shardstream(tmp_path, tiny_model, "ck", "run1.jsonl", "--steps", "6")
    second = _shardstream(tmp_path, tiny_model, "ck", "run2.jsonl")  # no --steps: until the epoch ends
    assert "trained 6 steps" in second.stdout
    # The same 12 steps in one uninterrupted run (same seed, same chunk order): a resumed run must match it
    # step for step, so the weights and the optimizer state both continued, and the data did not repeat.
    reference = TrainConfig(model=str(tiny_model), dataset=str(tmp_path / "corpus.txt"), output=tmp_path / "ref",
                            cache_dir=tmp_path / "cache", log_file=tmp_path / "ref.jsonl", **SHAPE)
    assert train(reference)["steps_this_run"] == 12
    resumed, whole = _losses(tmp_path / "run1.jsonl") + _losses(tmp_path / "run2.jsonl"), _losses(tmp_path / "ref.jsonl")
    assert len(resumed) == len(whole) == 12
    assert all(abs(a - b) < 1e-3 for a, b in zip(resumed, whole)), (resumed, whole)
    assert whole[6] < whole[0] - 0.1, "the reference did not learn: the comparison would prove nothing"

    before = _bundle(tmp_path / "ck")
    third = _shardstream(tmp_path, tiny_model, "ck", "run3.jsonl")  # the epoch is done and --iterate was not given
    assert "trained 0 steps" in third.stdout and "left as it was" in third.stdout
    assert not (tmp_path / "run3.jsonl").exists() or _losses(tmp_path / "run3.jsonl") == []
    assert _bundle(tmp_path / "ck") == before
