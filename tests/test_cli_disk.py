"""`shardstream convert` onto a small disk (a real tmpfs), as a user runs it: it stops
before writing what cannot fit, in one sentence with sizes in MB, and warns in one line."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from test_cli_convert import kill_after, run_cli
from test_convert import du, save_wide_llama


@contextmanager
def tmpfs(folder: Path, size: str) -> Iterator[Path]:
    folder.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a small tmpfs needs root and a system that permits it")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)


def test_small_disk_is_refused_before_anything_is_written(tmp_path):
    save_wide_llama(tmp_path / "src")   # about 2.7 MB in 10 shards
    shards = sorted(p.name for p in (tmp_path / "src").glob("*.safetensors"))
    with tmpfs(tmp_path / "small", "2m") as small:
        for attempt in range(2):   # the re-run says the same
            result = run_cli("convert", "src", str(small / "store"), "--sequential", "--no-progress", cwd=tmp_path)
            assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
            lines = result.stderr.strip().splitlines()
            assert len(lines) == 1 and "MB free but converting the 10 shards left needs about" in lines[0], lines
            assert "0.00 GB" not in lines[0] and "py.warnings" not in lines[0]
            assert not (small / "store").exists(), "the refused run leaves no output folder behind"
        assert sorted(p.name for p in (tmp_path / "src").glob("*.safetensors")) == shards, "no shard was deleted"


def test_low_disk_warning_is_one_line(tmp_path):
    save_wide_llama(tmp_path / "src")
    with tmpfs(tmp_path / "small", "8m") as small:
        result = run_cli("convert", "src", str(small / "store"), "--no-progress", cwd=tmp_path, check=True)
        assert run_cli("verify", str(small / "store"), cwd=tmp_path).returncode == 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning: low disk space in "), lines
    assert "MB free, about" in lines[0] and "--min-free-space (1.00 GB)" in lines[0]


def test_sequential_from_the_same_disk_needs_room_for_one_shard_only(tmp_path):
    """With room for little more than one shard's output beside the checkpoint, each run converted one shard
    and stopped: the next shard's room was counted before the converted one was deleted."""
    save_wide_llama(tmp_path / "wide")   # 10 shards of at most 0.3 MB
    with tmpfs(tmp_path / "small", f"{du(tmp_path / 'wide') // 1024 + 420}k") as small:
        shutil.copytree(tmp_path / "wide", small / "src")
        result = run_cli("convert", "src", "store", "--sequential", "--no-progress", cwd=small)
        assert result.returncode == 0, result.stderr
        assert run_cli("verify", "store", cwd=small).returncode == 0
        assert not list((small / "src").glob("*.safetensors"))


def test_verify_of_an_interrupted_sequential_run_asks_for_no_deleted_shard(tmp_path):
    """It told the user to download again the shards whose parts the run had written before it stopped."""
    save_wide_llama(tmp_path / "src")
    assert kill_after(2, ["convert", "src", "store", "--sequential"], cwd=tmp_path, kinds=("released shard",)) < 0
    assert not (tmp_path / "src" / "model-00001-of-00010.safetensors").exists()
    result = run_cli("verify", "store", cwd=tmp_path)
    assert result.returncode == 1 and "manifest.json: incomplete" in result.stderr
    assert "Re-run `shardstream convert` (or `shardstream shard`) with the same arguments" in result.stderr
    assert "download" not in result.stderr
    run_cli("convert", "src", "store", "--sequential", "--no-progress", cwd=tmp_path, check=True)
    assert run_cli("verify", "store", cwd=tmp_path).returncode == 0
