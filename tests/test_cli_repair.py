"""Repairing a damaged store whose source shards a `--sequential` or `--delete-original` run deleted:
the CLI as a user runs it, in a subprocess."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from test_cli_convert import run_cli
from tiny_models import char_tokenizer, save_checkpoint


def _damage(store: Path, part: str) -> str:
    """Flip a byte of the part's file; return its name relative to the store."""
    name = next(n for n in json.loads((store / "manifest.json").read_text())["files"] if n.startswith(part + "/"))
    data = bytearray((store / name).read_bytes())
    data[-1] ^= 0xFF
    (store / name).write_bytes(bytes(data))
    return name


def test_failed_repair_after_sequential_changes_nothing_and_names_the_shard(tmp_path):
    save_checkpoint("llama", tmp_path / "src")
    index = json.loads((tmp_path / "src" / "model.safetensors.index.json").read_text())["weight_map"]
    run_cli("convert", "src", "store", "--sequential", "--no-progress", cwd=tmp_path, check=True)
    damaged = _damage(tmp_path / "store", "mid/1")
    manifest_before = (tmp_path / "store" / "manifest.json").read_bytes()

    verified = run_cli("verify", "store", cwd=tmp_path)
    shard = index["model.layers.1.self_attn.q_proj.weight"]
    assert verified.returncode == 1 and f"{damaged}: checksum mismatch" in verified.stderr
    assert shard in verified.stderr and "download them again" in verified.stderr, verified.stderr

    rerun = run_cli("convert", "src", "store", "--sequential", "--no-progress", cwd=tmp_path)
    assert rerun.returncode == 1 and "Traceback" not in rerun.stderr
    assert "left as it was" in rerun.stderr and shard in rerun.stderr
    assert str((tmp_path / "src").resolve()) in rerun.stderr and "restore the store from a copy" in rerun.stderr
    assert (tmp_path / "store" / "manifest.json").read_bytes() == manifest_before
    # the parts that are intact still load: the store is as usable as before the attempt
    assert run_cli("verify", "store", "--parts", "mid/0,end", cwd=tmp_path).returncode == 0

    # downloaded again and given its recorded date as the message says, the same command repairs the store
    save_checkpoint("llama", tmp_path / "again")
    (tmp_path / "again" / shard).rename(tmp_path / "src" / shard)
    touch = re.search(r"`(touch -d @[0-9.]+ \S+)`", rerun.stderr)[1]
    subprocess.run(touch.split(), check=True)
    run_cli("convert", "src", "store", "--sequential", "--no-progress", cwd=tmp_path, check=True)
    assert run_cli("verify", "store", cwd=tmp_path).returncode == 0


def test_checksum_error_after_delete_original_advises_what_can_work(tmp_path):
    save_checkpoint("llama", tmp_path / "src")
    char_tokenizer().save_pretrained(tmp_path / "src")   # generate needs one before it loads the damaged block
    index = json.loads((tmp_path / "src" / "model.safetensors.index.json").read_text())["weight_map"]
    run_cli("convert", "src", "store", "--delete-original", "--no-progress", cwd=tmp_path, check=True)
    assert not (tmp_path / "src").exists()
    _damage(tmp_path / "store", "mid/2")
    shards = {index[n] for n in index if n.startswith("model.layers.2.")}

    result = run_cli("generate", "store", "--prompt", "hi", "--max-new-tokens", "2", "--no-progress", cwd=tmp_path)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert "fails its checksum" in result.stderr and all(s in result.stderr for s in shards)
    assert "download the checkpoint again" in result.stderr and "into a new folder" in result.stderr
    assert "restore the store from a copy" in result.stderr
