"""Store files as the disk holds them: their mode, and a torn part after a kill (real processes)."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys

import pytest

from test_cli_convert import kill_after, run_cli, store_files
from tiny_models import save_checkpoint

from shardstream.store import load_manifest, verify_store


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_store_files_get_the_umask_mode(tmp_path, umask):
    save_checkpoint("llama", tmp_path / "src")
    script = (f"import os, sys; os.umask({umask:#o}); sys.argv = ['shardstream', 'convert', 'src', 'store', "
              "'--no-progress']; from shardstream.cli import main; main()")
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    files = [p for p in (tmp_path / "store").rglob("*") if p.is_file()]
    assert len(files) > 3
    modes = {str(p.relative_to(tmp_path)): oct(stat.S_IMODE(p.stat().st_mode)) for p in files}
    assert set(modes.values()) == {oct(0o666 & ~umask)}, modes


def test_torn_part_is_found_and_rewritten_on_resume(tmp_path):
    """Parts are fsynced in one pass before the final commit, so a crash can leave a recorded part
    torn; the resumed run must notice (checksum) and write it again."""
    save_checkpoint("llama", tmp_path / "ref" / "src")
    run_cli("convert", "src", "store", "--no-progress", cwd=tmp_path / "ref", check=True)
    expected = store_files(tmp_path / "ref" / "store")

    work = tmp_path / "work"
    save_checkpoint("llama", work / "src")
    # killed once a part is recorded ("wrote part" is logged after the manifest entry): a count of any
    # step could land before the writer thread recorded one
    assert kill_after(1, ["convert", "src", "store"], cwd=work, kinds=("wrote part",)) == -signal.SIGKILL
    manifest = load_manifest(work / "store")
    assert not manifest.complete and manifest.files
    torn = work / "store" / sorted(manifest.files)[0]
    with open(torn, "r+b") as handle:   # what a power cut before the fsync pass can leave
        handle.truncate(os.path.getsize(torn) // 2)

    run_cli("convert", "src", "store", "--no-progress", cwd=work, check=True)
    resumed = store_files(work / "store")
    assert resumed[str(torn.relative_to(work / "store"))] == expected[str(torn.relative_to(work / "store"))]
    assert set(resumed) == set(expected)
    assert verify_store(work / "store")[1] == []


def test_module_umask_is_read_without_changing_it(tmp_path):
    script = "import os; os.umask(0o027); import shardstream.atomic as a; print(oct(a.FILE_MODE), oct(os.umask(0)))"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout.split() == ["0o640", "0o27"]
