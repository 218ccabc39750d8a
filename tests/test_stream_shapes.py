"""A store whose tensors disagree with its config.json is refused when it is opened, before any pass:
a tensor-parallel rank's share folder given as a store, a config.json of another model."""

from __future__ import annotations

import json
import shutil
import sys

import pytest

from shardstream.convert import convert
from shardstream.errors import ConfigMismatch
from shardstream.store import open_store
from shardstream import AutoModel
from shardstream.stream import StreamingModel
from shardstream.stream.meta import build_meta_model
from shardstream.tp.group import fingerprint
from shardstream.tp.rankstore import rank_folder, rank_layout
from tiny_models import char_tokenizer, save_checkpoint
import warm_python


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    folder = tmp_path_factory.mktemp("shapes")
    save_checkpoint("llama", folder / "src")
    char_tokenizer().save_pretrained(folder / "src")
    convert(folder / "src", folder / "store", progress=False)
    return folder / "store"


def test_a_rank_share_folder_is_refused_as_a_store(store, tmp_path):
    """`generate STORE/tp/rank_0_of_2` ran, computing from half of every split weight."""
    opened = open_store(store)
    layout = rank_layout(opened, build_meta_model(opened, None), 0, 2)
    share, _ = rank_folder(opened, layout, 0, 2, fingerprint(opened), tmp_path / "tp-cache")
    result = warm_python.run([sys.executable, "-m", "shardstream.cli", "generate", str(share.root), "--prompt", "Hi",
                              "--max-new-tokens", "2", "--no-progress"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert (f"{share.root} is rank 0 of 2's share of the store at {store}, written by a tensor-parallel run (it holds "
            f"1/2 of each split weight); give {store} instead") in result.stderr
    with pytest.raises(ConfigMismatch, match=r"holds model.embed_tokens.weight as \[64, 32\], but its config.json "
                                             r"makes model.embed_tokens.weight \[128, 32\]"):
        StreamingModel(share)   # the engine itself, given the folder: its shapes


def test_a_config_json_of_another_model_is_refused_before_the_first_pass(store, tmp_path):
    copy = tmp_path / "store"
    shutil.copytree(store, copy)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    with pytest.raises(ConfigMismatch, match=rf"the store at {copy} holds model.layers.0.mlp.down_proj.weight as "
                                             r"\[32, 64\], but its config.json makes .* \[32, 96\]: the tensors and "
                                             "config.json are of different models; put back the config.json"):
        AutoModel.from_pretrained(copy)
