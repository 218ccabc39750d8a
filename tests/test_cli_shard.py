"""`shardstream shard / relocate / verify` on a tiny Mixtral, as a user runs them."""

from __future__ import annotations

import signal
import subprocess

import torch

from shardstream.convert import convert
from shardstream.store import open_store

from http_server import serve_directory
from store_lock_holder import stop_while_locked
from test_cli_convert import CLI, run_cli
from tiny_models import save_checkpoint


def test_shard_relocate_verify(tmp_path):
    save_checkpoint("mixtral", tmp_path / "src")
    convert(tmp_path / "src", tmp_path / "store", progress=False)
    cold = tmp_path / "cold"

    run_cli("shard", "store", "--tp", "2", cwd=tmp_path, check=True)
    placed = run_cli("shard", "store", "--experts", "--tiers", f"hot=.,cold={cold}", cwd=tmp_path, check=True)
    assert placed.stdout.strip().endswith("12 experts placed: 12 on hot"), placed.stdout
    moved = run_cli("relocate", "store", "--expert", "1:2", "--tier", "cold", cwd=tmp_path, check=True)
    assert "expert 1:2 is on tier cold" in moved.stdout
    again = run_cli("shard", "store", "--experts", cwd=tmp_path, check=True)   # a rerun says where they are
    assert again.stdout.strip() == "12 experts placed: 11 on hot, 1 on cold", again.stdout
    assert (cold / "experts" / "tier_cold" / "group_1.1.experts").is_file()
    assert run_cli("verify", "store", cwd=tmp_path, check=True).stdout.startswith("OK")
    listed = "".join(run_cli("inspect", "store", cwd=tmp_path, check=True).stdout.split())   # as if never wrapped
    for line in ["experts on tier hot (.): 11 experts in 3 files", f"experts on tier cold ({cold}): 1 experts in 1 files",
                 "tensor-parallel slices: 2 ranks"]:
        assert "".join(line.split()) in listed

    store = open_store(tmp_path / "store")
    assert store.manifest.sharding == "sharding.json"
    whole = store.load("mid/1")
    expert = store.load_expert(layer=1, expert=2).tensors   # the API
    for name, tensor in expert.items():
        assert torch.equal(tensor, whole[name])
    halves = [store.load("mid/1", tp_rank=r, tp_size=2) for r in range(2)]
    q = "model.layers.1.self_attn.q_proj.weight"
    assert torch.equal(torch.cat([h[q] for h in halves]), whole[q])

    victim = cold / "experts" / "tier_cold" / "group_1.1.experts"
    data = bytearray(victim.read_bytes())
    data[100] ^= 1
    victim.write_bytes(bytes(data))
    bad = run_cli("verify", "store", "--parts", "experts", cwd=tmp_path)
    assert bad.returncode == 1 and "group_1.1.experts: checksum mismatch in expert 1:2" in bad.stderr
    assert run_cli("verify", "store", "--parts", "mid/0", cwd=tmp_path).returncode == 0


def test_open_store_by_url(tmp_path):
    save_checkpoint("llama", tmp_path / "src")
    convert(tmp_path / "src", tmp_path / "store", progress=False)
    with serve_directory(tmp_path / "store") as (url, log):
        remote = open_store(url)
        assert torch.equal(remote.load("mid/2")["model.layers.2.mlp.up_proj.weight"],
                           open_store(tmp_path / "store").load("mid/2")["model.layers.2.mlp.up_proj.weight"])
    assert any(r.path.endswith("mid/2/weights.safetensors") for r in log)
    assert not any("mid/3" in r.path for r in log), "only the requested part is read"


def _tree_bytes(folder) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*.safetensors"))


def test_verify_names_files_once_and_counts_slices(tmp_path):
    save_checkpoint("llama", tmp_path / "src")
    convert(tmp_path / "src", tmp_path / "sh1", progress=False)
    before = _tree_bytes(tmp_path / "sh1")
    run_cli("shard", "sh1", "--tp", "2", cwd=tmp_path, check=True)
    ok = run_cli("verify", "sh1", cwd=tmp_path, check=True).stdout
    assert f"OK: {_tree_bytes(tmp_path / 'sh1') / 1e6:.1f} MB verified" in ok
    assert _tree_bytes(tmp_path / "sh1") > before   # the slices are in the total

    slice_file = next(p for p in (tmp_path / "sh1").rglob("*.safetensors") if "rank_" in p.name)
    slice_file.unlink()
    bad = run_cli("verify", "sh1", cwd=tmp_path)
    assert bad.returncode == 1
    shown = f"sh1/{slice_file.relative_to(tmp_path / 'sh1')}: missing"
    assert shown in bad.stderr and "sh1/sh1/" not in bad.stderr


def test_inspect_names_a_missing_file_and_original_dtypes(tmp_path):
    save_checkpoint("llama", tmp_path / "src")
    convert(tmp_path / "src", tmp_path / "store", compression="4bit", progress=False)
    shown = run_cli("inspect", "store", cwd=tmp_path, check=True).stdout
    assert "complete" in shown and "float32" not in shown and "F32" in shown and "U8" not in shown
    (tmp_path / "store" / "mid" / "3" / "weights.safetensors").unlink()
    shown = " ".join(run_cli("inspect", "store", cwd=tmp_path, check=True).stdout.split())   # as if never wrapped
    assert "damaged: 1 missing" in shown and " complete" not in shown
    assert "store/mid/3/weights.safetensors: missing" in shown


def test_verify_a_file_is_one_sentence(tmp_path):
    (tmp_path / "afile").write_text("not a store")
    result = run_cli("verify", "afile", cwd=tmp_path)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "afile is not a folder" in result.stderr


def test_experts_on_a_dense_model_is_one_sentence_and_exit_1(tmp_path):
    """`shard --experts` on a dense model says so in one sentence and exits 1, not "0 experts placed" and 0."""
    save_checkpoint("llama", tmp_path / "src")
    convert(tmp_path / "src", tmp_path / "store", progress=False)
    before = sorted(p.relative_to(tmp_path) for p in (tmp_path / "store").rglob("*"))
    result = run_cli("shard", "store", "--experts", cwd=tmp_path)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "holds no mixture-of-experts experts to place (model_type 'llama'" in result.stderr
    assert "leave out --experts" in result.stderr and "experts placed" not in result.stdout
    assert sorted(p.relative_to(tmp_path) for p in (tmp_path / "store").rglob("*")) == before


def test_a_second_shard_of_the_same_store_is_refused_while_the_first_runs(tmp_path):
    """The second `shard --experts` claimed mid/0/weights.safetensors was missing (the first had replaced
    it) and told the user to re-run convert on an intact store."""
    save_checkpoint("mixtral", tmp_path / "src")
    convert(tmp_path / "src", tmp_path / "store", progress=False)
    first = subprocess.Popen([*CLI, "shard", "store", "--experts"], cwd=tmp_path,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stop_while_locked(first, tmp_path / "store")
        second = run_cli("shard", "store", "--experts", cwd=tmp_path)
    finally:
        first.send_signal(signal.SIGCONT)
    assert first.wait(timeout=300) == 0 and "experts placed" in first.stdout.read()
    assert second.returncode == 1 and "missing" not in second.stderr, second.stderr
    assert (f"another process is writing the store at store (pid {first.pid}: shardstream shard store --experts); "
            "wait for it to finish (or stop it), then run this command again.") in second.stderr
    assert run_cli("verify", "store", cwd=tmp_path, check=True).stdout.startswith("OK")
    assert "experts placed" in run_cli("shard", "store", "--experts", cwd=tmp_path, check=True).stdout


def test_relocate_names_a_layer_or_expert_the_store_lacks(tmp_path):
    """`relocate --expert 12:7` on a 3-layer store said to run `shard --experts` first."""
    save_checkpoint("mixtral", tmp_path / "src")   # 3 layers of 4 experts
    convert(tmp_path / "src", tmp_path / "store", progress=False)
    save_checkpoint("llama", tmp_path / "dense-src")
    convert(tmp_path / "dense-src", tmp_path / "dense", progress=False)
    for store, expert, words in (
            ("store", "12:7", "the store at store has 3 layers (0 to 2), so no layer 12; name one of them."),
            ("store", "1:7", "the store at store has 4 experts a layer (0 to 3), so no expert 7; name one of them."),
            ("dense", "1:1", "the store at dense holds no mixture-of-experts experts (model_type 'llama'); move "
                             "whole parts with --part instead."),
            ("store", "1:2", "places no expert 1:2; run `shardstream shard store --experts` first.")):
        result = run_cli("relocate", store, "--expert", expert, "--tier", "cold", cwd=tmp_path)
        assert result.returncode == 1 and "Traceback" not in result.stderr
        assert words in " ".join(result.stderr.split()), result.stderr
