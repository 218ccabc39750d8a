"""Re-running `shardstream train` with the same --output resumes model, optimizer and data together.

Real `shardstream` subprocesses on a tiny random-init Llama; the reference is one uninterrupted run.
"""

from __future__ import annotations

import hashlib
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest_data import REPO, postgres_server, postgres_url, read_jsonl, tiny_model, write_txt  # noqa: F401  (fixtures)
import warm_python

from shardstream.data.config import TrainConfig
from shardstream.data.launch import train
from shardstream.data.tracker import open_tracker
from shardstream.data.tracker_state import STATE_FILENAME, read_state

CLI = [sys.executable, "-m", "shardstream.cli"]
# 48 samples in chunks of 8, batch 4: 2 steps a chunk, 12 steps an epoch.
SHAPE = {"samples_per_block": 24, "chunk_size": 8, "batch_size": 4, "seq_len": 16, "lr": 0.01}


def _args(tmp_path: Path, model: Path, output: str, log: str, *extra: str, samples_per_block: int = SHAPE["samples_per_block"]) -> list[str]:
    args = ["train", "--model", model, "--dataset-file", tmp_path / "corpus.txt", "--output", output,
            "--cache-dir", tmp_path / "cache", "--log-file", log, "--samples-per-block", samples_per_block,
            "--dataset-chunk-size", SHAPE["chunk_size"], "--batch-size", SHAPE["batch_size"], "--seq-len", SHAPE["seq_len"],
            "--lr", SHAPE["lr"], *extra]
    return [*CLI, *map(str, args)]


def _shardstream(tmp_path: Path, model: Path, output: str, log: str, *extra: str, **shape: int) -> subprocess.CompletedProcess:
    result = warm_python.run(_args(tmp_path, model, output, log, *extra, **shape), cwd=tmp_path, capture_output=True, text=True,
                             timeout=300)
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


def _kill_after_steps(tmp_path: Path, model: Path, steps: int, *extra: str) -> None:
    """Start `shardstream train` into ck/ (400 samples a block), SIGKILL it once its log shows `steps` steps."""
    log = tmp_path / "killed.jsonl"
    proc = warm_python.popen(_args(tmp_path, model, "ck", log.name, "--lease-seconds", "5", *extra, samples_per_block=400),
                             cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline:
        if log.exists() and len(_losses(log)) >= steps:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.02)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, err


def _done_chunks(state: dict) -> set:
    return {(r["epoch"], r["block"], r["chunk"]) for r in state["chunks"] if r["state"] == "done"}


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_a_run_sigkilled_before_its_first_save_records_nothing_done_and_the_rerun_trains_it_all(tmp_path, tiny_model, backend, request):
    write_txt(tmp_path / "corpus.txt", 400)   # 50 chunks of 2 steps: 100 steps; the default --save-every is far away
    url = request.getfixturevalue("postgres_url") if backend == "postgresql" else str(tmp_path / "ck" / "chunk_tracker.sqlite")
    tracker_option = ["--tracker", url] if backend == "postgresql" else []
    _kill_after_steps(tmp_path, tiny_model, 25, *tracker_option)
    with open_tracker(url) as tracker:
        state = tracker.export_state()
    assert state["total_steps"] > 0 and _done_chunks(state) == set()   # trained, but no checkpoint holds it
    assert not (tmp_path / "ck" / "model.safetensors").exists()
    result = _shardstream(tmp_path, tiny_model, "ck", "rerun.jsonl", *tracker_option, samples_per_block=400)
    assert f"the tracker counts {state['total_steps']} steps but the checkpoint in" in result.stderr
    assert len(_losses(tmp_path / "rerun.jsonl")) == 100 and "50/50 chunks done" in result.stdout


def test_periodic_saves_record_exactly_the_chunks_the_checkpoint_holds(tmp_path, tiny_model):
    write_txt(tmp_path / "corpus.txt", 400)
    _kill_after_steps(tmp_path, tiny_model, 25, "--save-every", "6")
    with open_tracker(str(tmp_path / "ck" / "chunk_tracker.sqlite")) as tracker:
        live = tracker.export_state()
    saved = read_state(tmp_path / "ck" / STATE_FILENAME)
    held = torch.load(tmp_path / "ck" / "training_state.pt", weights_only=True)["total_steps"]
    # saves fall on chunk boundaries (2 steps a chunk, every 6 steps): the checkpoint holds 3 chunks per save
    assert _done_chunks(live) == _done_chunks(saved) and len(_done_chunks(saved)) * 2 == held >= 6
    assert held % 6 == 0 and live["total_steps"] >= held
    result = _shardstream(tmp_path, tiny_model, "ck", "rerun.jsonl", samples_per_block=400)
    assert (f"holds {held};" in result.stderr) == (live["total_steps"] > held)   # the kill may land just after a save
    assert len(_losses(tmp_path / "rerun.jsonl")) == 100 - held and "50/50 chunks done" in result.stdout
