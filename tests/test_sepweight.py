"""sepweight interop: llm_sepweight's dump contract, and importing such a folder as a store."""

from __future__ import annotations

import re

import pytest
import torch

from shardstream.errors import InvalidOption
from shardstream.sepweight import dump_to_directory, import_directory
from shardstream.store import open_store, verify_store

from tiny_models import tiny_model


def gpt2_decider(key: str) -> list[str]:
    if match := re.match(r"transformer\.h\.(\d+)\.(.+)", key):
        return ["mid", match[1], match[2]]
    if key.startswith(("transformer.wte", "transformer.wpe")):
        return ["start", key.removeprefix("transformer.")]
    return ["end", key.removeprefix("transformer.")]


def test_dump_layout_matches_llm_sepweight(tmp_path):
    state = tiny_model("gpt2").state_dict()
    dump_to_directory(gpt2_decider, state, tmp_path / "sep")
    assert (tmp_path / "sep" / "start" / "wte.weight.pth").is_file()
    assert (tmp_path / "sep" / "mid" / "3" / "attn.c_attn.weight.pth").is_file()
    assert (tmp_path / "sep" / "end" / "ln_f.weight.pth").is_file()
    loaded = torch.load(tmp_path / "sep" / "mid" / "0" / "mlp.c_fc.weight.pth", weights_only=True)
    assert torch.equal(loaded, state["transformer.h.0.mlp.c_fc.weight"])


def test_several_calls_combine(tmp_path):
    state = tiny_model("gpt2").state_dict()
    keys = sorted(state)
    dump_to_directory(gpt2_decider, {k: state[k] for k in keys[::2]}, tmp_path / "sep")
    dump_to_directory(gpt2_decider, {k: state[k] for k in keys[1::2]}, tmp_path / "sep")
    assert len(list((tmp_path / "sep").rglob("*.pth"))) == len(state)


def test_import_round_trip_with_model_names(tmp_path):
    model = tiny_model("gpt2")
    state = model.state_dict()
    dump_to_directory(gpt2_decider, state, tmp_path / "sep")

    def rename(part: str, stem: str) -> str:
        return f"transformer.h.{part[4:]}.{stem}" if part.startswith("mid/") else \
            ("lm_head.weight" if stem == "lm_head.weight" else f"transformer.{stem}")

    import_directory(tmp_path / "sep", tmp_path / "store", config=model.config.to_dict(), rename=rename)
    store = open_store(tmp_path / "store")
    assert store.parts == ["start", "mid/0", "mid/1", "mid/2", "mid/3", "end"]
    assert verify_store(tmp_path / "store")[1] == []
    loaded = {}
    for part in store.parts:
        loaded.update(store.load(part))
    for name, tensor in state.items():
        assert torch.equal(loaded[name], tensor), name


def test_import_default_names_are_unique_per_layer(tmp_path):
    dump_to_directory(gpt2_decider, tiny_model("gpt2").state_dict(), tmp_path / "sep")
    store = open_store(import_directory(tmp_path / "sep", tmp_path / "store"))
    assert "mid.2.attn.c_attn.weight" in store.load("mid/2")


@pytest.mark.parametrize("goal,message", [
    (["middle", "x"], "must return a list starting with"),
    (["mid", "x", "w"], "needs the layer number"),
    (["start", "..", "w"], "outside its folder"),
    ("start/w", "must return a list"),
])
def test_bad_decider_output_is_named(tmp_path, goal, message):
    with pytest.raises(InvalidOption if "outside" not in message else ValueError, match=message):
        dump_to_directory(lambda key: goal, {"w": torch.zeros(2)}, tmp_path / "sep")
