"""The chunk tracker on real SQLite and a real PostgreSQL server, with real competing processes."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections import Counter

import pytest
from conftest_data import postgres_server, postgres_url, write_txt  # noqa: F401  (fixtures)

from shardstream.data.blocks import BlockManager
from shardstream.data.claiming import Budget, next_claim
from shardstream.data.config import TrainConfig
from shardstream.data.tracker import open_tracker
from shardstream.data.tracker_state import read_state, write_state
from shardstream.errors import InvalidOption, TrackerCorrupt, TrackerUnavailable

# A worker without a model: claims through the real claim loop, completes, prints what it completed.
CLAIMER = """
import sys, time
from pathlib import Path
from shardstream.data.claiming import Budget, next_claim
from shardstream.data.config import TrainConfig
from shardstream.data.tracker import open_tracker
source, url, cache, start = sys.argv[1], sys.argv[2], Path(sys.argv[3]), float(sys.argv[4])
cfg = TrainConfig(model="", dataset=source, output=cache, tracker=url, cache_dir=cache, samples_per_block=100, chunk_size=4)
blocks = cfg.block_manager()
with open_tracker(url) as tracker:
    time.sleep(max(0.0, start - time.time()))
    while (claim := next_claim(tracker, blocks, sys.argv[5], cfg, Budget(None))) is not None:
        texts = blocks.chunk(claim.block, claim.chunk)
        assert tracker.complete(claim, 1, len(texts)), claim
        print(claim.epoch, claim.block, claim.chunk, flush=True)
"""


@pytest.fixture(params=["sqlite", "postgres"])
def tracker_url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'tracker.sqlite'}"
    return request.getfixturevalue("postgres_url")


def _setup(url: str, spb: int = 100, chunk: int = 4):
    tracker = open_tracker(url)
    tracker.setup("corpus", spb, chunk)
    return tracker


@pytest.mark.parametrize("processes", [2, 4])
def test_no_chunk_completes_twice_across_processes(tmp_path, tracker_url, processes):
    source = write_txt(tmp_path / "a.txt", 1000)  # 10 blocks of 100, 25 chunks each
    _setup(tracker_url).close()
    start = time.time() + 1.5  # all workers begin claiming at once
    procs = [subprocess.Popen([sys.executable, "-c", CLAIMER, str(source), tracker_url, str(tmp_path / "cache"), str(start), f"w{i}"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(processes)]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0] * processes, [err for _, err in outputs]
    completed = [tuple(map(int, line.split())) for out, _ in outputs for line in out.splitlines()]
    counts = Counter(completed)
    assert len(completed) == 250 and max(counts.values()) == 1
    assert sum(1 for out, _ in outputs if out.strip()) >= 2, "the workers did not actually compete"
    with open_tracker(tracker_url) as tracker:
        stats = tracker.get_progress_stats()
    assert (stats["epoch_complete"], stats["chunks_done"], stats["samples_this_epoch"], stats["total_blocks"]) == (True, 250, 1000, 10)
    assert stats["total_steps"] == 250 and sum(w["chunks_done"] for w in stats["workers"].values()) == 250


def test_expired_lease_goes_back_to_the_pool_and_the_old_owner_cannot_finish(tracker_url):
    with _setup(tracker_url) as tracker:
        tracker.register_block(0, 2, is_last=True)
        first = tracker.claim("a", lease_seconds=0.3)
        assert tracker.claim("b", 60).chunk == 1
        assert tracker.claim("c", 60) is None  # chunk 0 still leased
        time.sleep(0.5)
        again = tracker.claim("c", 60)
        assert (again.block, again.chunk, again.attempts) == (first.block, first.chunk, 2)
        assert not tracker.heartbeat(first, 60) and not tracker.complete(first, 1, 4)
        assert tracker.complete(again, 1, 4) and not tracker.complete(again, 1, 4)
        row = next(r for r in tracker.export_state()["chunks"] if r["chunk"] == 0)
        assert (row["state"], row["worker"], row["attempts"]) == ("done", "c", 2)


def test_epochs_roll_over_only_when_complete(tracker_url):
    with _setup(tracker_url) as tracker:
        tracker.register_block(0, 2, is_last=False)
        tracker.register_block(1, 1, is_last=True)
        claims = [tracker.claim("w", 60) for _ in range(3)]
        for c in claims[:2]:
            tracker.complete(c, 1, 4)
        tracker.advance_epoch(0)
        assert tracker.epoch_status().epoch == 0  # one chunk still open
        tracker.complete(claims[2], 1, 4)
        assert tracker.epoch_status().complete and tracker.get_progress_stats()["blocks_this_epoch"] == 2
        tracker.advance_epoch(0)
        tracker.advance_epoch(0)  # a second worker racing to do the same is a no-op
        status = tracker.epoch_status()
        assert (status.epoch, status.open_chunks, status.blocks_registered) == (1, 3, 2)
        assert (tracker.claim("w", 60).epoch, tracker.get_progress_stats()["total_steps"]) == (1, 3)


def test_claim_loop_registers_blocks_and_stops_at_the_end_of_data(tmp_path, tracker_url):
    source = write_txt(tmp_path / "a.txt", 10)
    cfg = TrainConfig(model="", dataset=str(source), output=tmp_path, tracker=tracker_url, cache_dir=tmp_path / "c",
                      samples_per_block=4, chunk_size=3)
    with _setup(tracker_url, 4, 3) as tracker:
        seen = []
        while (claim := next_claim(tracker, cfg.block_manager(), "w", cfg, Budget(None))) is not None:
            seen.append((claim.block, claim.chunk))
            tracker.complete(claim, 1, 1)
        assert seen == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0)]
        assert tracker.epoch_status().total_blocks == 3


def test_state_export_import_round_trip_turns_leases_into_pending(tmp_path, tracker_url):
    with _setup(tracker_url) as tracker:
        tracker.register_block(0, 3, is_last=True)
        tracker.complete(tracker.claim("a", 60), 5, 4)
        tracker.claim("b", 60)
        write_state(tmp_path / "state.json", tracker.export_state())
    state = read_state(tmp_path / "state.json")
    assert [r["state"] for r in state["chunks"]] == ["done", "leased", "pending"]
    with open_tracker(str(tmp_path / "copy.sqlite")) as copy:
        copy.import_state(state)
        stats = copy.get_progress_stats()
        assert (stats["chunks_done"], stats["chunks_pending"], stats["total_steps"], stats["total_blocks"]) == (1, 2, 5, 1)
        assert copy.claim("c", 60).chunk == 1
        with pytest.raises(InvalidOption, match="already has data"):
            copy.import_state(state)


def test_other_blocking_on_an_existing_tracker_is_refused(tracker_url):
    _setup(tracker_url).close()
    with pytest.raises(InvalidOption, match="chunk size 4"):
        _setup(tracker_url, 100, 8)


def test_corrupt_tracker_file_is_reported_and_left_untouched(tmp_path):
    path = tmp_path / "tracker.sqlite"
    path.write_bytes(b"this is not a database " * 200)
    before = path.read_bytes()
    with pytest.raises(TrackerCorrupt, match=r"tracker file .*tracker.sqlite is not a valid SQLite database"):
        _setup(str(path))
    assert path.read_bytes() == before


@pytest.mark.parametrize("content, message", [
    ("{truncated", "cannot be read"),
    (json.dumps({"format": "shardstream.chunk_tracker_state", "version": 1}), "field 'chunks' is missing"),
])
def test_corrupt_state_file_is_reported(tmp_path, content, message):
    (tmp_path / "state.json").write_text(content)
    with pytest.raises(TrackerCorrupt, match=message):
        read_state(tmp_path / "state.json")


def test_unreachable_database_is_reported():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    with pytest.raises(TrackerUnavailable, match=f"tracker database postgresql://postgres@127.0.0.1:{port}/db cannot be reached"):
        open_tracker(f"postgresql://postgres:secret@127.0.0.1:{port}/db")


def test_block_manager_and_tracker_agree_on_chunk_counts(tmp_path):
    blocks = BlockManager(str(write_txt(tmp_path / "a.txt", 9)), tmp_path / "c", samples_per_block=5, chunk_size=2)
    assert [blocks.block(i).chunk_count(2) for i in range(2)] == [3, 2]
