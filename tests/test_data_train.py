"""Training runs in this process (one worker) and DDP across two real gloo ranks."""

from __future__ import annotations

import shutil
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
from conftest_data import read_jsonl, tiny_model, write_txt  # noqa: F401  (fixtures)
from transformers import AutoModelForCausalLM

from shardstream.data.config import TrainConfig
from shardstream.data.launch import train
from shardstream.data.tracker import open_tracker
from shardstream.data.tracker_state import STATE_FILENAME, read_state
from shardstream.errors import TrackerCorrupt


def _config(tmp_path, model, samples: int, **kw) -> TrainConfig:
    source = write_txt(tmp_path / "corpus.txt", samples)
    defaults = dict(model=str(model), dataset=str(source), output=tmp_path / "out", cache_dir=tmp_path / "cache",
                    samples_per_block=64, chunk_size=8, batch_size=4, seq_len=16, log_file=tmp_path / "metrics.jsonl")
    return TrainConfig(**{**defaults, **kw})


def _done(state: dict) -> Counter:
    return Counter((r["epoch"], r["block"], r["chunk"]) for r in state["chunks"] if r["state"] == "done")


def test_resume_100_plus_100_steps_repeats_no_chunk(tmp_path, tiny_model):
    first = _config(tmp_path, tiny_model, 1000, steps=100)  # 2 steps per chunk, 125 chunks
    stats = train(first)
    assert (stats["steps_this_run"], stats["total_steps"], stats["chunks_done"]) == (100, 100, 50)
    state1 = read_state(first.output / STATE_FILENAME)
    # The checkpoint carries the data position: a new output (and so a new tracker) resumes from it.
    second = replace(first, model=str(first.output), output=tmp_path / "out2")
    stats = train(second)
    assert (stats["steps_this_run"], stats["total_steps"], stats["chunks_done"]) == (100, 200, 100)
    done1, done2 = _done(state1), _done(read_state(second.output / STATE_FILENAME))
    assert max(done2.values()) == 1 and set(done1) < set(done2) and len(done2) == 100
    steps = [r["step"] for r in read_jsonl(first.log_file) if r["event"] == "step"]
    assert len(steps) == 200
    assert AutoModelForCausalLM.from_pretrained(second.output).config.hidden_size == 32


def test_stop_after_epoch_then_iterate(tmp_path, tiny_model):
    cfg = _config(tmp_path, tiny_model, 24, samples_per_block=16)  # chunks of 8, 8 | 8: 6 steps an epoch
    stats = train(cfg)
    assert (stats["total_steps"], stats["current_epoch"], stats["epoch_complete"], stats["total_blocks"]) == (6, 0, True, 2)
    assert train(cfg)["steps_this_run"] == 0  # the epoch is done and --iterate was not given
    stats = train(replace(cfg, iterate=True, steps=15))
    assert (stats["steps_this_run"], stats["total_steps"], stats["current_epoch"]) == (15, 21, 3)
    done = _done(read_state(cfg.output / STATE_FILENAME))
    assert max(done.values()) == 1 and [sum(1 for k in done if k[0] == e) for e in range(4)] == [3, 3, 3, 1]
    chunk_events = [r for r in read_jsonl(cfg.log_file) if r["event"] == "chunk_done"]
    assert chunk_events[0]["samples_per_block"] == 16 and len(chunk_events) == 10


def test_corrupt_tracker_fails_before_training(tmp_path, tiny_model):
    cfg = _config(tmp_path, tiny_model, 24, tracker=str(tmp_path / "bad.sqlite"))
    (tmp_path / "bad.sqlite").write_bytes(b"\0garbage" * 100)
    with pytest.raises(TrackerCorrupt, match="not a valid SQLite database"):
        train(cfg)
    assert not (cfg.output / "model.safetensors").exists()


def test_ddp_two_ranks_stay_in_step_and_stop_together(tmp_path, tiny_model):
    # 40 samples in chunks of 8: 5 chunks; 2 ranks x batch 2 = 4 samples a step, so 2 steps a chunk.
    cfg = _config(tmp_path, tiny_model, 40, ddp=True, nproc=2, batch_size=2, steps=3)
    stats = train(cfg)  # the budget ends inside the second chunk: it goes back to the pool
    assert (stats["total_steps"], stats["chunks_done"], stats["chunks_pending"]) == (3, 1, 4)
    stats = train(replace(cfg, model=str(cfg.output), steps=None))  # now the data runs out first
    assert (stats["total_steps"], stats["chunks_done"], stats["epoch_complete"]) == (3 + 8, 5, True)
    ranks = {r["worker"] for r in read_jsonl(cfg.log_file) if r["event"] == "step"}
    assert len(ranks) == 2 and all("-w0-" in w for w in ranks)  # only rank 0 logs, once per launch
    with open_tracker(cfg.tracker_url) as tracker:
        assert max(_done(tracker.export_state()).values()) == 1


def test_workers_take_the_folder_of_the_run_that_starts_them(tmp_path, tiny_model, monkeypatch):
    """The server the workers are forked from outlives a run and started in another folder: relative paths are
    still the run's own."""
    for name in ("a", "b"):
        folder = tmp_path / name
        folder.mkdir()
        monkeypatch.chdir(folder)
        write_txt(folder / "corpus.txt", 32)
        cfg = TrainConfig(model=str(tiny_model), dataset="corpus.txt", output=Path("out"), cache_dir=Path("cache"),
                          samples_per_block=32, chunk_size=8, batch_size=4, seq_len=16, workers=2, steps=4)
        assert train(cfg)["steps_this_run"] == 4
        assert (folder / "out" / STATE_FILENAME).is_file() and any((folder / "cache").iterdir())
        shutil.rmtree(folder)   # so nothing of this run's can be found from the next one's
