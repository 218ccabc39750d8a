"""Convert and the store cache lose nothing and answer nothing silently wrong.

Real files, real CLI subprocesses, a real HTTP server on 127.0.0.1 (tests/http_server.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from http_server import serve_directory, unused_port
from test_convert import store_tensors
from tiny_models import save_checkpoint
import warm_python

from shardstream.convert import ConvertReport, convert
from shardstream.errors import CorruptShard, InvalidOption, SourceNotFound, SourceUnreachable
from shardstream.front.resolve import default_store_path, ensure_store
from shardstream.options import ConversionOptions
from shardstream.switches import CACHE

CLI = [sys.executable, "-m", "shardstream.cli"]


def run_cli(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return warm_python.run([*CLI, *args], cwd=cwd, capture_output=True, text=True, timeout=300,
                           env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def two_models(tmp_path_factory) -> Path:
    """w/src3 and w/other/src3: the same config and relative name, different weights."""
    root = tmp_path_factory.mktemp("w")
    save_checkpoint("llama", root / "src3", seed=0)
    save_checkpoint("llama", root / "other" / "src3", seed=1)
    return root


# 1. the cache is keyed by what the source is, not how it was typed


def test_cache_is_keyed_by_the_resolved_folder(two_models, tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE.name, str(tmp_path / "cache"))
    monkeypatch.chdir(two_models)
    first = ensure_store("./src3", progress=False)
    monkeypatch.chdir(two_models / "other")
    second = ensure_store("./src3", progress=False)
    assert first.root != second.root
    assert first.manifest.source == str(two_models / "src3")
    assert second.manifest.source == str(two_models / "other" / "src3")
    a, b = store_tensors(first.root), store_tensors(second.root)
    assert any(not a[name].equal(b[name]) for name in a), "the second model must not be the first one's store"


def test_changed_source_is_converted_again_in_the_cache_and_refused_elsewhere(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE.name, str(tmp_path / "cache"))
    src = tmp_path / "src"
    save_checkpoint("llama", src, seed=0)
    before = store_tensors(ensure_store(src, progress=False).root)
    named = tmp_path / "named"
    convert(src, named, progress=False)
    time.sleep(0.01)
    shutil.rmtree(src)
    save_checkpoint("llama", src, seed=1)   # same folder, new weights: new sizes or dates
    after_store = ensure_store(src, progress=False)
    after = store_tensors(after_store.root)
    assert any(not before[n].equal(after[n]) for n in before), "a stale cached store was reused"
    assert after_store.root == default_store_path(str(src))
    for attempt in (lambda: ensure_store(src, ConversionOptions(store_path=named), progress=False),
                    lambda: convert(src, named, progress=False)):
        with pytest.raises(InvalidOption, match=f"{named} holds a store converted from {src}, and {src} differs"):
            attempt()


def test_hub_ids_and_urls_are_keyed_with_their_revision(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE.name, str(tmp_path))
    assert default_store_path("org/name") != default_store_path("org/name", ConversionOptions(revision="v2"))
    assert default_store_path("org/name") == default_store_path("hf://org/name", ConversionOptions(revision="main"))
    assert default_store_path("http://h/m") == default_store_path("http://h/m/")


# 3, 6, 8, 10: the output folder


@pytest.fixture
def src1(tmp_path) -> Path:
    save_checkpoint("llama", tmp_path / "src1")
    return tmp_path / "src1"


def test_foreign_folder_is_refused_and_kept(src1, tmp_path):
    occ = tmp_path / "occ3"
    occ.mkdir()
    (occ / "config.json").write_text('{"mine":1}')
    (occ / "tokenizer.json").write_text("keep me")
    result = run_cli("convert", "src1", "occ3", "--no-progress", cwd=tmp_path)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "occ3 is not empty and is not a shardstream store" in result.stderr
    assert (occ / "config.json").read_text() == '{"mine":1}' and (occ / "tokenizer.json").read_text() == "keep me"
    assert sorted(p.name for p in occ.iterdir()) == ["config.json", "tokenizer.json"]


def test_foreign_manifest_is_not_a_store(src1, tmp_path):
    (tmp_path / "occ4").mkdir()
    (tmp_path / "occ4" / "manifest.json").write_text('{"mine":1}')
    with pytest.raises(InvalidOption, match="occ4 is not a shardstream store"):
        convert(src1, tmp_path / "occ4", progress=False)


def test_store_of_another_source_is_refused(src1, tmp_path):
    convert(src1, tmp_path / "store", progress=False)
    save_checkpoint("llama", tmp_path / "copy", seed=0)
    with pytest.raises(InvalidOption, match=f"converted from {src1}, and {tmp_path / 'copy'} differs from that"):
        convert(tmp_path / "copy", tmp_path / "store", progress=False)


@pytest.mark.parametrize("args,message", [
    (["convert", "src1", "afile"], "afile is a file; give a new or empty folder"),
    (["convert", "src1", "/proc/nope/x"], "cannot create /proc/nope/x"),
    (["convert", "./nonexistent", "a/b/c"], "nonexistent does not exist"),
])
def test_bad_output_or_source_is_one_sentence_and_creates_nothing(src1, tmp_path, args, message):
    (tmp_path / "afile").write_text("mine")
    result = run_cli(*args, "--no-progress", cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "src1"]
    assert (tmp_path / "afile").read_text() == "mine"


def test_converting_a_store_says_use_it_directly(src1, tmp_path):
    convert(src1, tmp_path / "st", progress=False)
    with pytest.raises(InvalidOption, match="st is already a store; use it directly"):
        convert(tmp_path / "st", tmp_path / "st2", progress=False)
    assert not (tmp_path / "st2").exists()


def test_missing_source_in_the_cache_creates_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE.name, str(tmp_path / "cache"))
    with pytest.raises(SourceNotFound):
        ensure_store(tmp_path / "nomodel", progress=False)
    assert not (tmp_path / "cache").exists()


def test_one_part_is_singular():
    report = ConvertReport(Path("s"), ["start"], [], 10, 1.0)
    assert report.summary().startswith("1 part written, 0 already complete")


def test_http_404_and_dead_port_leave_no_folder(tmp_path):
    with serve_directory(tmp_path / "empty") as (url, _log):
        with pytest.raises(SourceNotFound):
            convert(url + "nothing/", tmp_path / "out404", progress=False)
    with pytest.raises(SourceUnreachable):
        convert(f"http://127.0.0.1:{unused_port()}/m/", tmp_path / "outdead", progress=False)
    assert not (tmp_path / "out404").exists() and not (tmp_path / "outdead").exists()


# 7. integrity of what comes in over HTTP


def _flip_last_byte(path: Path) -> str:
    """Damage the tensor data (not the header) and return the sha256 of the original."""
    data = bytearray(path.read_bytes())
    digest = hashlib.sha256(data).hexdigest()
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    return digest


@pytest.mark.parametrize("where", ["sidecar", "index"])
def test_http_shard_that_differs_from_its_published_sha256_is_refused(src1, tmp_path, where):
    victim = sorted(src1.glob("*.safetensors"))[1]
    good = _flip_last_byte(victim)
    if where == "sidecar":
        (src1 / (victim.name + ".sha256")).write_text(f"{good}  {victim.name}\n")
    else:
        index = json.loads((src1 / "model.safetensors.index.json").read_text())
        index["sha256"] = {victim.name: good}
        (src1 / "model.safetensors.index.json").write_text(json.dumps(index))
    with serve_directory(src1) as (url, _log):
        with pytest.raises(CorruptShard, match=f"{victim.name} .* sha256 is .* the published one {good[:12]}"):
            convert(url, tmp_path / "out", progress=False)
    assert not (tmp_path / "out" / ".staging" / victim.name).exists()


def test_http_shards_matching_their_sha256_convert(src1, tmp_path):
    for shard in src1.glob("*.safetensors"):
        (src1 / (shard.name + ".sha256")).write_text(hashlib.sha256(shard.read_bytes()).hexdigest())
    with serve_directory(src1) as (url, log):
        convert(url, tmp_path / "out", progress=False)
    assert any(r.path.endswith(".sha256") and r.status == 200 for r in log)
    assert store_tensors(tmp_path / "out")


# 11. the Hub offline: one line, fast, nothing left behind


@pytest.mark.parametrize("offline", ["dead-port", "HF_HUB_OFFLINE"])
def test_offline_hub_fails_once_and_fast(tmp_path, offline):
    env = {"HF_ENDPOINT": f"http://127.0.0.1:{unused_port()}", "HF_HOME": str(tmp_path / "hf")}
    if offline == "HF_HUB_OFFLINE":
        env["HF_HUB_OFFLINE"] = "1"
    started = time.perf_counter()
    result = run_cli("convert", "tiny-org/tiny", "out", cwd=tmp_path, env=env)
    elapsed = time.perf_counter() - started
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.count("could not reach the Hub") == 1 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert elapsed < 20, f"took {elapsed:.1f} s"   # start-up included; the old retries took 27 s more
    assert not (tmp_path / "out").exists()


HUB_CONVERT = """
import sys
from shardstream.convert import convert
from shardstream.errors import CorruptShard
try:
    convert("tiny-org/tiny", sys.argv[1], progress=False)
except CorruptShard as exc:
    print(exc)
"""


def test_hub_shard_that_differs_from_the_published_sha256_is_refused(src1, tmp_path):
    """The Hub publishes each LFS file's sha256 as its ETag; a download that differs is refused."""
    from http_server import serve_hub

    victim = sorted(src1.glob("*.safetensors"))[2].name
    with serve_hub({"tiny-org/tiny": src1}, published={victim: "ab" * 32}) as (url, _log):
        env = {**os.environ, "HF_ENDPOINT": url.rstrip("/"), "HF_HOME": str(tmp_path / "hf")}
        env.pop("HF_HUB_OFFLINE", None)
        done = subprocess.run([sys.executable, "-c", HUB_CONVERT, str(tmp_path / "out")],
                              env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"shard {victim} of hub tiny-org/tiny is corrupt (its sha256 is" in done.stdout
    assert "the published one abababababab" in done.stdout
    assert not (tmp_path / "out" / ".staging" / victim).exists()
