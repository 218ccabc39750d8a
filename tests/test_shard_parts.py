"""Whole parts on storage tiers: relocation survives SIGKILL at every step, and every reader
(Store.load, streaming, verify, a remote store, the CLI) follows the part to its tier."""

from __future__ import annotations

import shutil

import pytest
import torch

import shardstream
from http_server import serve_directory
from shardstream.convert import convert
from shardstream.errors import InvalidOption
from shardstream.pipeline.package import package_stage
from shardstream.shard import RELOCATION_STEPS, define_tiers, load_index, relocate_part
from shardstream.store import verify_store
from shardstream.store.remote import open_remote_store
from shardstream.stream import StreamingModel
from test_cli_convert import run_cli
from test_shard_experts import assert_same_parts, kill_relocation_at
from tiny_models import save_checkpoint


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(the converted tiny Llama store, never modified; transformers' model on the same weights)."""
    folder = tmp_path_factory.mktemp("parts")
    reference = save_checkpoint("llama", folder / "src")
    convert(folder / "src", folder / "store", progress=False)
    return shardstream.open_store(folder / "store"), reference


@pytest.fixture
def store(converted, tmp_path):
    """A private copy with tiers hot (the store folder), warm (inside it) and cold (outside)."""
    shutil.copytree(converted[0].root, tmp_path / "store")
    store = shardstream.open_store(tmp_path / "store")
    index = load_index(store, for_update=True)
    define_tiers(store, index, {"hot": ".", "warm": "tiers/warm", "cold": str(tmp_path / "hdd")})
    index.save(store)
    return store


def test_a_relative_tier_folder_outside_the_store_is_refused(store):
    """It was said to name "the file '../warm', which is outside its folder"."""
    index = load_index(store, for_update=True)
    for outside in ("../warm", "~/warm"):
        with pytest.raises(InvalidOption, match=f"--tiers folder '{outside}' of tier 'lukewarm' is outside the store: "
                                                "a relative folder is inside it; give a folder outside as an absolute path."):
            define_tiers(store, index, {"lukewarm": outside})


def test_a_part_moves_and_every_reader_follows(store, converted, tmp_path):
    original, reference = converted
    assert relocate_part(store, "mid/1", "cold") == "cold"
    assert (tmp_path / "hdd/mid/1/weights.safetensors").is_file()
    assert not (store.root / "mid/1/weights.safetensors").exists()
    assert load_index(store).parts == {"mid/1": "cold"}
    assert_same_parts(store, original)
    assert verify_store(store.root)[1] == []
    ids = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(0))
    with StreamingModel(store, max_resident_memory=0) as model, torch.no_grad():
        assert (model(ids).logits - reference(ids).logits).abs().max().item() <= 1e-5

    relocate_part(store, "mid/1", "hot")   # back into the store folder
    assert (store.root / "mid/1/weights.safetensors").is_file()
    assert not list((tmp_path / "hdd").rglob("*.safetensors"))
    assert_same_parts(store, original)


@pytest.mark.parametrize("stop", RELOCATION_STEPS)
def test_sigkill_at_each_step_leaves_a_store_that_loads(store, converted, tmp_path, stop):
    kill_relocation_at(store.root, "mid/2", "cold", stop)

    store = shardstream.open_store(store.root)
    assert load_index(store).parts.get("mid/2") == (None if stop in ("copy", "verify") else "cold")
    assert verify_store(store.root)[1] == []
    assert_same_parts(store, converted[0])

    relocate_part(store, "mid/2", "cold")   # the re-run finishes the move
    assert not (store.root / "mid/2/weights.safetensors").exists()
    assert not list(store.root.rglob(".tmp-*")) and not list((tmp_path / "hdd").rglob(".tmp-*"))
    assert_same_parts(store, converted[0])


def test_parts_over_http(store, converted):
    relocate_part(store, "mid/2", "warm")   # inside the store folder: reachable over HTTP
    relocate_part(store, "mid/0", "cold")   # another disk: not
    with serve_directory(store.root) as (url, log):
        remote = open_remote_store(url)
        part = remote.load("mid/2")
        with pytest.raises(InvalidOption, match="part mid/0 is on tier 'cold' .* outside the store"):
            remote.load("mid/0")
    want = converted[0].load("mid/2")
    assert all(torch.equal(part[n], want[n]) for n in want)
    assert "/tiers/warm/mid/2/weights.safetensors" in [r.path for r in log]


def test_cli_defines_tiers_and_relocates_a_part(converted, tmp_path):
    shutil.copytree(converted[0].root, tmp_path / "store")
    cold = tmp_path / "hdd"
    assert "tiers: hot=., cold=" in run_cli("shard", "store", "--tiers", f"hot=.,cold={cold}", cwd=tmp_path, check=True).stdout
    moved = run_cli("relocate", "store", "--part", "mid/1", "--tier", "cold", cwd=tmp_path, check=True)
    assert "part mid/1 is on tier cold" in moved.stdout and (cold / "mid/1/weights.safetensors").is_file()
    assert run_cli("verify", "store", cwd=tmp_path, check=True).stdout.startswith("OK")
    for args, words in [(["--tier", "cold"], "exactly one of --expert"),
                        (["--part", "mid/99", "--tier", "cold"], "has no part 'mid/99'"),
                        (["--part", "mid/1", "--tier", "tape"], "has no tier 'tape'")]:
        bad = run_cli("relocate", "store", *args, cwd=tmp_path)
        assert bad.returncode == 1 and words in bad.stderr and "Traceback" not in bad.stderr


def test_a_pipeline_stage_packs_a_relocated_part(store, converted, tmp_path):
    relocate_part(store, "mid/1", "cold")
    stage = package_stage(store, 0, store.num_layers, tmp_path / "stages")
    packed = shardstream.open_store(stage.folder)   # a plain store layout: the stage has no tiers
    assert (stage.folder / "mid/1/weights.safetensors").is_file()
    assert_same_parts(packed, converted[0])
