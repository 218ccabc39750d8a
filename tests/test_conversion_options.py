"""ConversionOptions: the conversion's options as one value, checked when made; `AutoModel.from_pretrained`
and `convert()` take it or their keywords (AirLLM's names), not both, and convert the same either way."""

from __future__ import annotations

import shutil

import pytest
import torch

import shardstream
from shardstream import AutoModel, ConversionOptions, EngineOptions
from shardstream.convert import convert
from shardstream.errors import InvalidOption
from shardstream.store import open_store
from test_convert import store_tensors
from tiny_models import save_checkpoint


def test_the_conversion_value_is_checked_when_made():
    assert shardstream.ConversionOptions is ConversionOptions
    assert ConversionOptions().compression is None and ConversionOptions(compression="none").compression is None
    assert ConversionOptions(compression="INT4").compression == "int4"
    with pytest.raises(InvalidOption, match="compression must be one of none, 4bit, 8bit, int4, not '3bit'"):
        ConversionOptions(compression="3bit")


def test_from_pretrained_converts_the_same_from_the_value_as_from_its_keywords(tmp_path):
    save_checkpoint("llama", tmp_path / "ckpt")
    for copy in ("a", "b"):
        shutil.copytree(tmp_path / "ckpt", tmp_path / copy)
    ids = torch.tensor([[3, 5, 7, 9]])
    engine = EngineOptions(max_resident_memory=0)
    with AutoModel.from_pretrained(tmp_path / "a", layer_shards_saving_path=tmp_path / "by-keywords", compression="8bit",
                                   sequential_shard_processing=True, options=engine, progress=False) as by_keywords:
        expected = by_keywords(ids).logits
    conversion = ConversionOptions(store_path=str(tmp_path / "by-value"), compression="8bit", sequential=True)
    with AutoModel.from_pretrained(tmp_path / "b", conversion=conversion, options=engine, progress=False) as by_value:
        assert torch.equal(by_value(ids).logits, expected)
    for copy in ("a", "b"):
        assert not list((tmp_path / copy).glob("*.safetensors")), "sequential: each source shard deleted after use"
    assert open_store(tmp_path / "by-value").manifest.compression == "8bit"
    keyed, valued = store_tensors(tmp_path / "by-keywords"), store_tensors(tmp_path / "by-value")
    assert keyed.keys() == valued.keys() and all(torch.equal(keyed[n], valued[n]) for n in keyed)


def test_the_value_and_a_keyword_it_covers_are_refused_together(tmp_path):
    save_checkpoint("llama", tmp_path / "ckpt")
    conversion = ConversionOptions(compression="4bit")
    for keywords in (dict(compression="8bit"), dict(layer_shards_saving_path=tmp_path / "s"), dict(token="t"),
                     dict(hf_token="t"), dict(revision="v2"), dict(sequential_shard_processing=True)):
        with pytest.raises(InvalidOption, match="as `conversion` or one by one, not both"):
            AutoModel.from_pretrained(tmp_path / "ckpt", conversion=conversion, **keywords)
    with pytest.raises(InvalidOption, match="as `conversion` or one by one, not both"):
        convert(tmp_path / "ckpt", tmp_path / "out", conversion=conversion, compression="4bit")
    with pytest.raises(InvalidOption, match="conversion.store_path is .*elsewhere but the store to convert into is"):
        convert(tmp_path / "ckpt", tmp_path / "out", conversion=ConversionOptions(store_path=str(tmp_path / "elsewhere")))
    assert not (tmp_path / "out").exists() and not (tmp_path / "s").exists()


def test_convert_takes_the_value_as_its_keywords(tmp_path):
    save_checkpoint("llama", tmp_path / "ckpt")
    convert(tmp_path / "ckpt", tmp_path / "by-keywords", compression="4bit", progress=False)
    convert(tmp_path / "ckpt", tmp_path / "by-value", conversion=ConversionOptions(
        compression="4bit", store_path=str(tmp_path / "by-value")), progress=False)
    keyed, valued = store_tensors(tmp_path / "by-keywords"), store_tensors(tmp_path / "by-value")
    assert open_store(tmp_path / "by-value").manifest.compression == "4bit"
    assert keyed.keys() == valued.keys() and all(torch.equal(keyed[n], valued[n]) for n in keyed)
