"""Streaming runtime against transformers' own model on the same weights (fp32, max abs diff <= 1e-5)."""

from __future__ import annotations

import inspect
import json
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from shardstream.cli import app
from shardstream.convert import convert
from shardstream.errors import InvalidOption, StoreCorrupt, StoreIncomplete, UnsupportedModel
from shardstream.serving.kvcache import ReservedLayer
from shardstream.store import load_manifest, open_store
from shardstream import AutoModel, EngineOptions
from shardstream.stream import StreamingModel
from shardstream.stream.loader import LoadedBlock
from shardstream.stream.prefetch import Prefetcher
from shardstream.stream.profile import Profile
from shardstream.stream.residency import choose_resident
from tiny_models import save_checkpoint

FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "gemma", "phi3", "mixtral", "qwen2_moe", "qwen3_moe", "gpt2",
            "gpt_neox", "falcon"]
MOE_FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe"]   # Qwen2-MoE: a gated shared expert beside the routed ones
TOLERANCE = 1e-5


def _prompts(batch: int = 2, length: int = 9, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (batch, length), generator=generator)


def _make(tmp: Path, family: str, compression: str | None = None):
    reference = save_checkpoint(family, tmp / "ckpt")
    convert(tmp / "ckpt", tmp / "store", compression=compression, progress=False)
    return reference, tmp / "store"


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A converted tiny llama store and its reference model, shared by the tests that only read it."""
    return _make(tmp_path_factory.mktemp("llama"), "llama")


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_greedy_tokens_match_transformers(tmp_path, family):
    reference, _ = _make(tmp_path, family)
    ids = _prompts()
    mask = torch.ones_like(ids)
    with AutoModel.from_pretrained(tmp_path / "ckpt", layer_shards_saving_path=tmp_path / "store",
                                   max_resident_memory=0, progress=False) as model:
        assert model.resident_blocks == []
        with torch.no_grad():
            expected = reference(ids, attention_mask=mask).logits
        assert (model(ids, attention_mask=mask).logits - expected).abs().max().item() <= TOLERANCE
        want = reference.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
        got = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(got, want)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_experts_placed_apart_match_transformers_with_their_block_and_on_demand(tmp_path, family):
    """After `shardstream shard STORE --experts` every expert is a file of its own: read back with its block
    (the default) or only when routed to, each family's logits and greedy tokens stay transformers'."""
    reference, store = _make(tmp_path, family)
    placed = CliRunner().invoke(app, ["shard", str(store), "--experts"])
    assert placed.exit_code == 0 and "experts placed" in placed.output, placed.output
    ids = _prompts()
    mask = torch.ones_like(ids)
    with torch.no_grad():
        expected = reference(ids, attention_mask=mask).logits
    options = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    want = reference.generate(ids, **options)
    for experts in ("with_block", "on_demand"):
        with AutoModel.from_pretrained(store, experts=experts, max_resident_memory=0, progress=False) as model:
            assert (model(ids, attention_mask=mask).logits - expected).abs().max().item() <= TOLERANCE, experts
            assert torch.equal(model.generate(ids, **options), want), experts


def _dequantized_reference(store_path: Path, folder: Path):
    """transformers' from_pretrained over a checkpoint holding the store's dequantized weights."""
    store = open_store(store_path)
    tensors = {}
    for part in store.parts:
        tensors.update(store.load(part))
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(store.config))
    save_file({n: t.contiguous() for n, t in tensors.items() if n not in store.manifest.aliases},
              str(folder / "model.safetensors"))
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.mark.parametrize("family,compression", [("llama", "4bit"), ("mixtral", "8bit")])
def test_quantized_store_matches_the_dequantized_reference(tmp_path, family, compression):
    original, store_path = _make(tmp_path, family, compression)
    reference = _dequantized_reference(store_path, tmp_path / "dequantized")
    ids = _prompts()
    with AutoModel.from_pretrained(store_path, max_resident_memory=0) as model:
        got = model(ids).logits
        with torch.no_grad():
            assert (got - reference(ids).logits).abs().max().item() <= TOLERANCE
            assert (got - original(ids).logits).abs().max().item() > 1e-4  # quantization did change the weights
        want = reference.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
        assert torch.equal(model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0), want)


def test_left_padded_batch_matches_the_reference(llama):
    reference, store_path = llama
    ids = _prompts(batch=3, length=8)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[2, :5] = 0
    ids = ids.masked_fill(mask == 0, 0)
    options = dict(attention_mask=mask, max_new_tokens=7, do_sample=False, pad_token_id=0)
    with AutoModel.from_pretrained(store_path, max_resident_memory=0) as model:
        assert torch.equal(model.generate(ids, **options), reference.generate(ids, **options))
        with torch.no_grad():
            expected = reference(ids, attention_mask=mask).logits
        diff = (model(ids, attention_mask=mask).logits - expected)[mask.bool()]
        assert diff.abs().max().item() <= TOLERANCE


SEARCHES = {"greedy": dict(do_sample=False), "beams": dict(num_beams=3, do_sample=False),
            "beams, 2 returned": dict(num_beams=3, num_return_sequences=2, do_sample=False),
            "sampling, 2 returned": dict(do_sample=True, top_k=5, num_return_sequences=2)}


@pytest.mark.parametrize("search", SEARCHES)
def test_generate_writes_its_kv_cache_in_place_and_matches_transformers(llama, search):
    """`generate` reserves the cache for the prompt and the new tokens (no copy of it per step); beam search
    reorders its rows inside that reservation, and several returned sequences each get a row of it."""
    reference, store_path = llama
    ids = _prompts(batch=2, length=9)
    options = dict(max_new_tokens=7, pad_token_id=0, **SEARCHES[search])
    with AutoModel.from_pretrained(store_path, max_resident_memory=0) as model:
        torch.manual_seed(3)
        got = model.generate(ids, return_dict_in_generate=True, **options)
        torch.manual_seed(3)
        assert torch.equal(got.sequences, reference.generate(ids, **options))
    layer = got.past_key_values.layers[0]
    assert isinstance(layer, ReservedLayer) and layer.capacity == 9 + 7


def test_generate_keeps_transformers_cache_for_a_sliding_window(tmp_path):
    """A sliding-window layer keeps only its window: such a model keeps transformers' own cache."""
    reference = save_checkpoint("mistral", tmp_path / "ckpt", sliding_window=4)
    convert(tmp_path / "ckpt", tmp_path / "store", progress=False)
    ids = _prompts(batch=1, length=9)
    options = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    with AutoModel.from_pretrained(tmp_path / "store") as model:
        got = model.generate(ids, return_dict_in_generate=True, **options)
    assert torch.equal(got.sequences, reference.generate(ids, **options))
    assert not any(isinstance(layer, ReservedLayer) for layer in got.past_key_values.layers)


def test_each_generated_token_streams_each_block_once(llama):
    _, store_path = llama
    with AutoModel.from_pretrained(store_path, max_resident_memory=0) as model:
        model.generate(_prompts(batch=1), max_new_tokens=5, do_sample=False, pad_token_id=0)
        assert sorted(model.profile.blocks) == [0, 1, 2, 3]
        assert {t.passes for t in model.profile.blocks.values()} == {5}  # prefill + 4 cached decode steps


def test_resident_blocks_stay_and_are_not_streamed(llama):
    reference, store_path = llama
    ids = _prompts()
    with AutoModel.from_pretrained(store_path, max_resident_memory=0) as probe:
        block = probe.report().block_bytes[0]
    with AutoModel.from_pretrained(store_path, max_resident_memory=4 * block - 1) as model:  # 1 resident + 2 streaming
        assert model.resident_blocks == [0]
        with torch.no_grad():
            assert (model(ids).logits - reference(ids).logits).abs().max().item() <= TOLERANCE
        assert sorted(model.profile.blocks) == [1, 2, 3]
    with AutoModel.from_pretrained(store_path) as model:  # "auto": a tiny model fits entirely
        assert model.resident_blocks == [0, 1, 2, 3]
    with AutoModel.from_pretrained(store_path, max_resident_memory=None) as model:  # None: no limit (it was 0)
        assert model.resident_blocks == [0, 1, 2, 3]
        with torch.no_grad():
            assert (model(ids).logits - reference(ids).logits).abs().max().item() <= TOLERANCE


def test_budget_and_choice_of_resident_blocks():
    assert choose_resident([10, 10, 10], 25) == [0, 1]
    assert choose_resident([10, 30, 10], 25) == [0]
    assert choose_resident([10, 10, 10], 30, streaming_bytes=20) == [0, 1, 2]  # all fit: nothing streams
    assert choose_resident([10, 10, 10, 10], 30, streaming_bytes=20) == [0]
    assert EngineOptions(max_resident_memory=0).resident_budget(5) == 0
    no_limit = EngineOptions(max_resident_memory=None).resident_budget(5)
    assert choose_resident([10, 10, 10], no_limit, streaming_bytes=10) == [0, 1, 2]
    assert 0 < EngineOptions().resident_budget(0)   # auto
    with pytest.raises(InvalidOption, match="max_resident_memory"):
        EngineOptions(max_resident_memory=-1)
    assert EngineOptions().host_budget("cpu") == 0
    assert EngineOptions(max_host_memory=0).host_budget("cpu") == 0
    with pytest.raises(InvalidOption, match="max_host_memory applies only with device='cuda'"):
        EngineOptions(max_host_memory=1 << 30).host_budget("cpu")


def test_profiling_mode_prints_per_block_times(llama, capsys):
    _, store_path = llama
    with AutoModel.from_pretrained(store_path, max_resident_memory=0, profiling_mode=True) as model:
        model(_prompts())
    printed = capsys.readouterr().err
    assert "| 3 | 1 |" in printed and "read time hidden behind compute" in printed


def test_without_prefetching_results_are_the_same(llama):
    reference, store_path = llama
    ids = _prompts()
    with AutoModel.from_pretrained(store_path, max_resident_memory=0, prefetching=False) as model:
        with torch.no_grad():
            assert (model(ids).logits - reference(ids).logits).abs().max().item() <= TOLERANCE


def test_prefetch_keeps_at_most_depth_plus_one_blocks_and_hides_reads():
    """Reads of 10 ms behind 30 ms of compute: nearly all hidden, never more than depth+1 in memory."""
    in_memory, peak, lock = 0, 0, threading.Lock()

    def load(index: int) -> LoadedBlock:
        nonlocal in_memory, peak
        with lock:
            in_memory += 1
            peak = max(peak, in_memory)
        time.sleep(0.01)
        return LoadedBlock(index, {}, 0.01)

    for depth in (1, 2):
        in_memory, peak = 0, 0
        prefetcher = Prefetcher(load, [0, 1, 2, 3], depth)
        waited = 0.0
        for _ in range(3):
            for index in range(4):
                block, wait = prefetcher.get(index)
                waited += wait
                time.sleep(0.03)
                with lock:
                    in_memory -= 1
                prefetcher.release(block)
        prefetcher.close()
        assert peak <= depth + 1
        # the reads take 0.12 s in all; hidden behind the compute, little more than the very first is waited for
        # (a loaded machine adds its scheduling delays to every wait)
        assert waited < 0.5 * 12 * 0.01


def test_a_load_error_reaches_the_forward_pass():
    def load(index: int) -> LoadedBlock:
        if index == 1:
            raise StoreCorrupt("mid/1 fails its checksum")
        return LoadedBlock(index, {}, 0.0)

    prefetcher = Prefetcher(load, [0, 1], 1)
    prefetcher.release(prefetcher.get(0)[0])
    with pytest.raises(StoreCorrupt, match="mid/1"):
        prefetcher.get(1)
    prefetcher.close()


def test_an_existing_store_is_reused_not_reconverted(llama, tmp_path):
    _, store_path = llama
    before = (store_path / "manifest.json").stat().st_mtime_ns
    AutoModel.from_pretrained(store_path.parent / "ckpt", layer_shards_saving_path=store_path).close()
    assert (store_path / "manifest.json").stat().st_mtime_ns == before


def test_an_unfinished_quantized_store_is_finished_with_its_own_compression(tmp_path):
    """Naming an unfinished store finishes it from the checkpoint its manifest records, quantized as it
    was begun (before: the default, no compression, was refused as "another model or compression")."""
    _, store_path = _make(tmp_path, "llama", "4bit")
    manifest = load_manifest(store_path)   # as a convert killed before its last part leaves it
    manifest.complete = False
    del manifest.parts["mid/1"]
    manifest.save(store_path)
    with AutoModel.from_pretrained(store_path, max_resident_memory=0) as model:
        assert model.store.manifest.complete and "mid/1" in model.store.manifest.parts
        assert model.store.manifest.compression == "4bit"
        model(_prompts())


def test_an_unfinished_store_says_it_is_finished_or_that_its_checkpoint_is_gone(tmp_path, caplog):
    """generate/serve given an unfinished store finish it from the checkpoint its manifest records and say
    so; where that folder has moved, the error was that a checkpoint the user never named does not exist."""
    from shardstream.front.resolve import ensure_store
    from shardstream.store.verify import verify_store

    _, store_path = _make(tmp_path, "llama")
    ckpt = tmp_path / "ckpt"
    manifest = load_manifest(store_path)
    manifest.complete = False
    del manifest.parts["mid/1"]
    manifest.save(store_path)
    # verify names the part not written yet by the store's incompleteness, not as one it does not have
    assert [p.file for p in verify_store(store_path, ["mid/1"])[1]] == ["manifest.json"]
    ckpt.rename(tmp_path / "moved")
    with pytest.raises(StoreIncomplete, match=f"the store at {store_path} is unfinished, and {ckpt.resolve()}, the "
                                              "checkpoint it was being converted from, is not there any more"):
        ensure_store(str(store_path))
    (tmp_path / "moved").rename(ckpt)
    with caplog.at_level("WARNING", logger="shardstream.resolve"):
        assert ensure_store(str(store_path)).manifest.complete
    assert f"the store at {store_path} is unfinished; finishing its conversion from {ckpt.resolve()}" in caplog.text


def test_corrupt_block_fails_its_checksum_on_first_use(tmp_path):
    _, store_path = _make(tmp_path, "llama")
    store = open_store(store_path)
    name = store.manifest.parts["mid/2"].files[0]
    data = bytearray((store_path / name).read_bytes())
    data[-1] ^= 0xFF
    (store_path / name).write_bytes(bytes(data))
    with AutoModel.from_pretrained(store_path, max_resident_memory=0) as model:
        with pytest.raises(StoreCorrupt, match="checksum"):
            model(_prompts())


def test_missing_part_file_is_reported_before_running(tmp_path):
    _, store_path = _make(tmp_path, "llama")
    store = open_store(store_path)
    (store_path / store.manifest.parts["mid/1"].files[0]).unlink()
    with pytest.raises(StoreIncomplete, match="shardstream convert"):
        AutoModel.from_pretrained(store_path, max_resident_memory=0)


def test_unsupported_architecture_is_refused(tmp_path):
    _, store_path = _make(tmp_path, "llama")
    config = json.loads((store_path / "config.json").read_text())
    config["model_type"] = "no_such_architecture"
    (store_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModel, match="no_such_architecture"):
        StreamingModel(open_store(store_path))


def test_prompt_longer_than_the_context_is_refused(llama):
    _, store_path = llama
    with AutoModel.from_pretrained(store_path) as model:
        with pytest.raises(InvalidOption, match="shorten the prompt"):
            model(_prompts(batch=1, length=65))
        with pytest.raises(InvalidOption, match="at most 4 new tokens"):
            model.generate(_prompts(batch=1, length=60), max_new_tokens=10)
        for given, kind in (([[1, 2, 3]], "list"), ("ROMEO:", "str")):   # an AttributeError from inside
            with pytest.raises(InvalidOption, match=f"input_ids must be a tensor of token ids, not a {kind}; make one "
                                                    "with model.tokenizer"):
                model.generate(given, max_new_tokens=2)


# -- AirLLM's from_pretrained -----------------------------------------------------------------

AIRLLM_PARAMETERS = ("device", "dtype", "max_seq_len", "layer_shards_saving_path", "profiling_mode", "compression",
                     "hf_token", "prefetching", "delete_original", "install_hooks", "load_resident")


def test_a_store_named_as_its_own_saving_path_opens(llama):
    """AirLLM code passes the store again as layer_shards_saving_path; that failed with "has neither
    model.safetensors..." once the cache was keyed by source."""
    reference, store_path = llama
    ids = _prompts(batch=1)
    for saving_path in (store_path, str(store_path) + "/"):
        with AutoModel.from_pretrained(str(store_path), layer_shards_saving_path=saving_path) as model:
            with torch.no_grad():
                assert (model(ids).logits - reference(ids).logits).abs().max().item() <= TOLERANCE


def test_compression_other_than_the_stores_is_refused_not_ignored(tmp_path, monkeypatch):
    """compression="4bit" against an fp32 store the user names was silently ignored; the cache keeps a
    4-bit copy beside the plain one."""
    _, store_path = _make(tmp_path, "llama")
    words = f"{store_path} holds a store converted with compression none, not 4bit; leave compression out"
    with pytest.raises(InvalidOption, match=words):
        AutoModel.from_pretrained(store_path, compression="4bit")
    with pytest.raises(InvalidOption, match=words):
        AutoModel.from_pretrained(tmp_path / "ckpt", layer_shards_saving_path=store_path, compression="4bit")
    assert load_manifest(store_path).compression is None
    monkeypatch.setenv("SHARDSTREAM_CACHE", str(tmp_path / "cache"))
    with AutoModel.from_pretrained(tmp_path / "ckpt", progress=False) as plain, \
            AutoModel.from_pretrained(tmp_path / "ckpt", compression="4bit", progress=False) as packed:
        assert (plain.store.manifest.compression, packed.store.manifest.compression) == (None, "4bit")
        assert packed.store.root.name.startswith("ckpt-4bit-") and plain.store.root.parent == packed.store.root.parent


def test_every_airllm_parameter_is_taken(llama):
    """AirLLM 4.0's AutoModel.from_pretrained parameters: the same meaning, or refused by name."""
    reference, store_path = llama
    assert set(AIRLLM_PARAMETERS) <= set(inspect.signature(AutoModel.from_pretrained).parameters)
    ids = _prompts(batch=1, length=15)
    with AutoModel.from_pretrained(store_path, device="cpu", dtype=torch.float32, max_seq_len=20,
                                   layer_shards_saving_path=store_path, profiling_mode=False, compression=None,
                                   hf_token="hf_unused_for_a_local_store", prefetching=True, delete_original=False,
                                   install_hooks=True, load_resident=True) as model:
        want = reference.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
        assert torch.equal(model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0), want)
        with pytest.raises(InvalidOption, match=r"plus max_new_tokens \(6\) is more than the max_seq_len=20"):
            model.generate(ids, max_new_tokens=6)
    for options, words in (({"install_hooks": False}, "install_hooks=False .* not supported"),
                           ({"load_resident": False}, "load_resident=False .* not supported"),
                           ({"token": "a", "hf_token": "b"}, "token and hf_token .* differ"),
                           ({"max_seq_len": 0}, "max_seq_len must be at least 1")):
        with pytest.raises(InvalidOption, match=words):
            AutoModel.from_pretrained(store_path, **options)


def test_profiling_with_every_block_resident_says_so(llama, capsys):
    """It printed a table with no block in it."""
    _, store_path = llama
    with AutoModel.from_pretrained(store_path, max_resident_memory=None, profiling_mode=True) as model:
        model.generate(_prompts(batch=1), max_new_tokens=2, do_sample=False, pad_token_id=0)
    printed = capsys.readouterr().err
    assert "profile: no block was streamed in this call, so there was no read to time: 4 of 4 blocks are resident" \
        in printed and "| block |" not in printed
    profile = Profile()
    profile.record(2, 0.01, 0.0, 0.02)
    assert profile.table([0, 1], 3).endswith("2 of 3 blocks are resident (max_resident_memory keeps them in "
                                             "memory) and not listed: 0, 1.")
