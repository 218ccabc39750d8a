"""`shardstream convert/inspect/verify` as a user runs them: real subprocesses, real SIGKILLs."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from store_lock_holder import stop_while_locked
from test_convert import save_wide_llama
from tiny_models import save_checkpoint
import warm_python

CLI = [sys.executable, "-m", "shardstream.cli"]
EVENTS = ("wrote part", "wrote piece", "processed shard", "released shard")


def run_cli(*args: str, cwd: Path, check: bool = False) -> subprocess.CompletedProcess:
    result = warm_python.run([*CLI, *args], cwd=cwd, capture_output=True, text=True, timeout=300)
    if check:
        assert result.returncode == 0, result.stderr
    return result


def store_files(root: Path) -> dict[str, bytes]:
    """Every store file's bytes; the manifest's recorded source (an absolute path, different for
    each copy of the checkpoint) and the checksum over it are left out of the comparison."""
    files = {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*")) if p.is_file() and p.name != "convert_profile.json"
    }
    manifest = json.loads(files.pop("manifest.json"))
    assert manifest.pop("source") == str((root.parent / "src").resolve())
    manifest.pop("checksum")
    files["manifest.json"] = json.dumps(manifest, sort_keys=True).encode()
    return files


def kill_after(events: int, args: list[str], cwd: Path, kinds: tuple[str, ...] = EVENTS) -> int:
    """Start a conversion and SIGKILL it right after its `events`-th logged step of these kinds."""
    proc = warm_python.popen([*CLI, *args, "-v", "--no-progress"], cwd=cwd,
                             stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    seen = 0
    for line in proc.stderr:
        if any(e in line for e in kinds):
            seen += 1
            if seen == events:
                proc.send_signal(signal.SIGKILL)
                break
    proc.wait()
    return proc.returncode


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("pristine") / "src"
    save_wide_llama(folder)
    return folder


@pytest.mark.parametrize("mode", ["--sequential", "--verbose"])  # --verbose: the default, all-shards-first path
def test_sigkill_anywhere_then_rerun_gives_identical_store(tmp_path, pristine, mode):
    reference = tmp_path / "reference"
    shutil.copytree(pristine, reference / "src")
    run_cli("convert", "src", "store", mode, "--no-progress", cwd=reference, check=True)
    expected = store_files(reference / "store")

    for events in (1, 4, 9, 15):
        work = tmp_path / f"kill{events}"
        shutil.copytree(pristine, work / "src")
        code = kill_after(events, ["convert", "src", "store", mode], cwd=work)
        assert code == -signal.SIGKILL, f"the run ended before event {events}; the test would prove nothing"
        run_cli("convert", "src", "store", mode, "--no-progress", cwd=work, check=True)
        assert store_files(work / "store") == expected, f"store differs after a kill at event {events}"
        if mode == "--sequential":
            assert not list((work / "src").glob("*.safetensors"))


def test_corrupt_shard_is_one_clear_sentence(tmp_path):
    save_checkpoint("llama", tmp_path / "src")
    victim = sorted((tmp_path / "src").glob("*.safetensors"))[1]
    data = bytearray(victim.read_bytes())
    data[0:8] = (10**12).to_bytes(8, "little")   # header length beyond the file
    victim.write_bytes(bytes(data))
    result = run_cli("convert", "src", "store", "--sequential", "--no-progress", cwd=tmp_path)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert victim.name in result.stderr and "download the checkpoint again" in result.stderr


def test_verify_and_inspect(tmp_path):
    save_checkpoint("llama", tmp_path / "src")
    run_cli("convert", "src", "store", "--compression", "4bit", "--no-progress", cwd=tmp_path, check=True)

    ok = run_cli("verify", "store", cwd=tmp_path, check=True)
    assert ok.stdout.startswith("OK:")
    shown = run_cli("inspect", "store", cwd=tmp_path, check=True).stdout
    for text in ("start", "mid/3", "end", "4bit", "complete", "family=llama"):
        assert text in shown

    victim = tmp_path / "store" / "mid" / "1" / "weights.safetensors"
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    bad = run_cli("verify", "store", cwd=tmp_path)
    assert bad.returncode == 1
    assert "mid/1/weights.safetensors: checksum mismatch" in bad.stderr
    assert run_cli("verify", "store", "--parts", "mid/0, end", cwd=tmp_path).returncode == 0
    assert run_cli("verify", "store", "--parts", "mid/0, mid/1", cwd=tmp_path).returncode == 1
    for unknown in ("mid/99", "MID/1", "experts"):   # each was "OK: ... verified", with mid/1 left unchecked
        refused = run_cli("verify", "store", "--parts", f"mid/0,{unknown}", cwd=tmp_path)
        assert refused.returncode == 1 and "Traceback" not in refused.stderr
        assert (f"has no part '{unknown}'" if unknown != "experts" else "has no experts stored apart") in refused.stderr

    (tmp_path / "store" / "mid" / "2" / "weights.safetensors").unlink()
    assert "mid/2/weights.safetensors: missing" in run_cli("verify", "store", cwd=tmp_path).stderr


@pytest.mark.parametrize("args,message", [
    (["convert", "./nowhere", "out"], "nowhere does not exist"),
    (["inspect", "src"], "not a shardstream store"),
    (["verify", "nowhere"], "does not exist"),
])
def test_user_mistakes_exit_1_without_traceback(tmp_path, args, message):
    save_checkpoint("llama", tmp_path / "src")
    result = run_cli(*args, cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "out" / "manifest.json").exists()
    assert os.path.exists(tmp_path / "src" / "config.json")


def test_a_second_convert_into_the_same_store_is_refused_while_the_first_runs(tmp_path, pristine):
    """The second run died with a long FileNotFoundError traceback (the first one's temp file, removed), or
    removed the first one's; a SIGKILLed run must not leave the store locked."""
    shutil.copytree(pristine, tmp_path / "src")
    first = subprocess.Popen([*CLI, "convert", "src", "store", "--no-progress"], cwd=tmp_path,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        stop_while_locked(first, tmp_path / "store")
        second = run_cli("convert", "src", "store", "--no-progress", cwd=tmp_path)
        assert second.returncode == 1 and len(second.stderr.strip().splitlines()) == 1, second.stderr
        assert (f"another process is writing the store at store (pid {first.pid}: shardstream convert src store "
                "--no-progress); wait for it to finish (or stop it), then run this command again.") in second.stderr
    finally:
        first.kill()   # SIGKILL, stopped as it is: the kernel drops its lock
        first.wait()
    run_cli("convert", "src", "store", "--no-progress", cwd=tmp_path, check=True)
    assert run_cli("verify", "store", cwd=tmp_path, check=True).stdout.startswith("OK")
