"""`shardstream train` / `shardstream data status` as real subprocesses, and a real SIGKILL mid-chunk."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import psutil
import pytest
import typer
from conftest_data import CLI, REPO, read_jsonl, run_cli, tiny_model, write_txt  # noqa: F401  (fixtures)
import warm_python
from typer.testing import CliRunner

from shardstream.data.cli import data_app, train_command
from shardstream.data.config import TrainConfig
from shardstream.data.launch import train
from shardstream.data.model import load_model
from shardstream.data.tracker import open_tracker
from shardstream.errors import InvalidOption


def _train_args(tmp_path, model, samples: int, *extra: str) -> list[str]:
    source = write_txt(tmp_path / "corpus.txt", samples)
    return ["train", "--model", model, "--dataset-file", source, "--output", tmp_path / "out", "--cache-dir", tmp_path / "cache",
            "--samples-per-block", "40", "--batch-size", "2", "--seq-len", "16", *extra]


def test_train_two_workers_end_to_end_then_status(tmp_path, tiny_model):
    """From a checkpoint with weights; each worker once drew transformers' weight-loading bar, ending in a
    carriage return, so the run's last line ("trained N steps") was printed over a bar."""
    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(tiny_model, checkpoint)
    load_model(str(tiny_model), 0).save_pretrained(checkpoint)
    log = tmp_path / "artifacts" / "metrics.jsonl"
    result = run_cli(*_train_args(tmp_path, checkpoint, 100, "--dataset-chunk-size", "10", "--parallel-independent",
                                  "--workers", "2", "--stop-after-epoch", "--log-file", log))
    assert result.returncode == 0, result.stderr
    assert "Loading weights" not in result.stderr, result.stderr
    assert result.stdout.splitlines()[-1].startswith("trained ")
    assert "10/10 chunks done" in result.stdout
    steps = [r for r in read_jsonl(log) if r["event"] == "step"]
    assert len(steps) == 50 and {"step", "loss", "tokens_per_s", "block", "chunk", "worker"} <= steps[0].keys()
    # both workers ran, but on a loaded machine one may finish every chunk before the other starts
    # (concurrent claiming is covered by the tracker's multi-process tests)
    assert 1 <= len({r["worker"] for r in steps}) <= 2
    assert {"config.json", "model.safetensors", "tokenizer.json", "chunk_tracker_state.json"} <= {p.name for p in (tmp_path / "out").iterdir()}
    status = run_cli("data", "status", "--tracker", tmp_path / "out" / "chunk_tracker.sqlite", "--json")
    stats = json.loads(status.stdout)
    assert (stats["epoch_complete"], stats["chunks_done"], stats["total_steps"]) == (True, 10, 50)
    assert len(stats["workers"]) == len({r["worker"] for r in steps})
    table = run_cli("data", "status", "--tracker", f"sqlite:///{tmp_path / 'out' / 'chunk_tracker.sqlite'}")
    assert table.returncode == 0 and "blocks 3/3 done" in table.stdout


def test_sigkilled_worker_chunk_is_trained_again_by_another(tmp_path, tiny_model):
    tracker_path = tmp_path / "tracker.sqlite"
    # 6 chunks of 120 samples (60 steps each), so a kill lands inside a chunk.
    proc = warm_python.popen([sys.executable, "-c", CLI, *map(str, _train_args(
        tmp_path, tiny_model, 720, "--samples-per-block", "240", "--dataset-chunk-size", "120", "--workers", "2",
        "--lease-seconds", "3", "--tracker", tracker_path))], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    victim = killed_chunk = None
    deadline = time.time() + 180
    while victim is None and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
        if not tracker_path.exists():
            continue
        with open_tracker(str(tracker_path)) as tracker:
            leased = [r for r in tracker.export_state()["chunks"] if r["state"] == "leased"] if not tracker.is_empty() else []
        if leased:
            row = leased[0]
            victim = int(row["owner"].rsplit("-", 1)[1])
            assert victim in {c.pid for c in psutil.Process(proc.pid).children(recursive=True)}
            os.kill(victim, signal.SIGKILL)
            killed_chunk = (row["block"], row["chunk"])
    out, err = proc.communicate(timeout=240)
    assert victim is not None, err
    assert proc.returncode == 0, err
    assert "exited with code -9" in err
    with open_tracker(str(tracker_path)) as tracker:
        rows = tracker.export_state()["chunks"]
    assert len(rows) == 6 and all(r["state"] == "done" for r in rows)
    assert max(Counter((r["epoch"], r["block"], r["chunk"]) for r in rows).values()) == 1
    redone = next(r for r in rows if (r["block"], r["chunk"]) == killed_chunk)
    assert redone["attempts"] == 2 and not redone["worker"].endswith(f"-{victim}")


def test_corrupt_tracker_and_unreachable_database_print_a_message_not_a_traceback(tmp_path, tiny_model):
    bad = tmp_path / "bad.sqlite"
    bad.write_bytes(b"garbage!" * 512)
    result = run_cli(*_train_args(tmp_path, tiny_model, 10, "--tracker", bad))
    assert result.returncode == 1
    assert "error: tracker file" in result.stderr and "not a valid SQLite database" in result.stderr
    assert "Traceback" not in result.stderr and bad.read_bytes() == b"garbage!" * 512
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = run_cli("data", "status", "--tracker", f"postgresql://trainer@127.0.0.1:{port}/runs")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert f"tracker database postgresql://trainer@127.0.0.1:{port}/runs cannot be reached" in result.stderr


def test_option_parsing_and_conflicts():
    app = typer.Typer()
    app.command("train")(train_command)
    app.add_typer(data_app, name="data")
    runner = CliRunner()
    result = runner.invoke(app, ["train", "--model", "m", "--dataset-file", "d", "--output", "o", "--iterate", "--stop-after-epoch"])
    assert isinstance(result.exception, InvalidOption) and "--iterate and --stop-after-epoch" in str(result.exception)
    result = runner.invoke(app, ["train", "--model", "m", "--dataset-file", "d", "--output", "o", "--cuda-ids", "0,x"])
    assert isinstance(result.exception, InvalidOption) and "0,1" in str(result.exception)
    result = runner.invoke(app, ["train", "--model", "m", "--output", "o"])
    assert result.exit_code == 2 and "dataset-file" in result.output
    assert "status" in runner.invoke(app, ["data", "--help"]).output


@pytest.mark.parametrize("sig, workers", [(signal.SIGINT, ["--ddp", "--nproc", "2"]), (signal.SIGTERM, ["--workers", "2"])],
                         ids=["ctrl-c-ddp", "sigterm-workers"])
def test_ctrl_c_or_sigterm_stops_every_worker_with_one_line(tmp_path, tiny_model, sig, workers):
    # a relative --output with a space, as in the docs' examples (DDP ranks once met through a URL made of it, and hung)
    write_txt(tmp_path / "corpus.txt", 2000)
    args = ["train", "--model", tiny_model, "--dataset-file", "corpus.txt", "--output", "runs/my run", "--cache-dir", "cache",
            "--samples-per-block", "1000", "--dataset-chunk-size", "500", "--batch-size", "2", "--seq-len", "16",
            "--log-file", "steps.jsonl", "--iterate", *workers]   # --iterate: only the signal ends the run
    # as from a terminal: SIGINT at its default, not ignored or blocked as the test process (a pytest-xdist
    # worker that ran other tests) may pass it on
    proc = subprocess.Popen([sys.executable, "-m", "shardstream", *map(str, args)], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=_default_sigint)
    log, deadline = tmp_path / "steps.jsonl", time.time() + 120
    while not (log.exists() and log.read_text()) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.1)
    children = psutil.Process(proc.pid).children(recursive=True) if proc.poll() is None else []
    try:
        assert log.exists() and proc.poll() is None, "no worker trained a step"
        assert len(children) >= 2
        dispositions = re.findall(r"Sig(?:Blk|Ign):\s+\w+", Path(f"/proc/{proc.pid}/status").read_text())
        proc.send_signal(sig)
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the run went on after the signal (its {dispositions})") from None
        assert proc.returncode != 0 and "Traceback" not in err, err
        assert err.strip().splitlines() == ["interrupted; re-run the same command to continue where it stopped."], err
        _, alive = psutil.wait_procs(children, timeout=10)
        assert alive == []
    finally:   # whatever failed, leave no process behind
        for process in [*children, proc]:
            with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):
                process.kill()


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})


def test_two_workers_with_one_chunk_save_the_trained_replica_undiluted(tmp_path, tiny_model):
    # The README's shape in small: one chunk, two workers. One trains it all, the other nothing; the checkpoint
    # must be the trained replica (it once was the average with the untrained one: half the update).
    args = _train_args(tmp_path, tiny_model, 8, "--dataset-chunk-size", "8", "--workers", "2", "--lr", "0.01")
    result = run_cli(*args)
    assert result.returncode == 0, result.stderr
    alone = TrainConfig(model=str(tiny_model), dataset=str(tmp_path / "corpus.txt"), output=tmp_path / "alone",
                        cache_dir=tmp_path / "cache", samples_per_block=40, chunk_size=8, batch_size=2, seq_len=16, lr=0.01)
    assert train(alone)["steps_this_run"] == 4
    initial = load_model(str(tiny_model), 0).state_dict()
    two, one = load_model(str(tmp_path / "out"), 0).state_dict(), load_model(str(alone.output), 0).state_dict()
    update = max((one[k] - initial[k]).abs().max().item() for k in one)
    assert update > 0.01
    assert max((two[k] - one[k]).abs().max().item() for k in one) < update / 1000


def test_two_workers_with_steps_a_multiple_of_a_chunk_finish_whole_chunks_and_the_rerun_moves_on(tmp_path, tiny_model):
    # The README example in small: chunks of 5 steps, --steps 10 over two workers. Each worker reserves a whole
    # chunk's steps when it claims it, so the run ends on 2 whole chunks (no half-trained chunk to redo) and
    # the same command again trains the next 2.
    args = _train_args(tmp_path, tiny_model, 40, "--dataset-chunk-size", "10", "--workers", "2", "--steps", "10")
    for done in (2, 4):
        result = run_cli(*args)
        assert result.returncode == 0, result.stderr
        assert f"epoch 0: {done}/4 chunks done" in result.stdout


def test_an_unreachable_hub_dataset_is_one_line_at_once(tmp_path, tiny_model):
    """datasets' retries printed their raw errors for tens of seconds before the clean message."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]   # nothing listens there once the socket is closed
    env = {**os.environ, "HF_ENDPOINT": f"http://127.0.0.1:{port}"}
    started = time.monotonic()
    result = run_cli("train", "--model", tiny_model, "--dataset-file", "hf://someone/unreachable-set",
                     "--output", tmp_path / "out", "--cache-dir", tmp_path / "cache", env=env)
    assert result.returncode == 1 and time.monotonic() - started < 60
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: could not reach the Hub at http://127.0.0.1:{port} for dataset "
                               "hf://someone/unreachable-set (")
