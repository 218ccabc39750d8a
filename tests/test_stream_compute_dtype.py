"""The compute dtype (stream/compute_dtype.py): bfloat16 and float16 checkpoints exact against transformers
in the same dtype on the same weights, `auto`'s choice and its log line, the option from Python and the
CLI, a quantized bfloat16 store multiplied from its codes, and generate's chunked prefill
(admission.prefill_chunk) equal to one pass."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import warm_python
import torch
from transformers import AutoModelForCausalLM

from shardstream.convert import convert
from shardstream.errors import InvalidOption
from shardstream.serving import admission
from shardstream import AutoModel
from shardstream.stream import compute_dtype, loader, quant_linear
from shardstream.serving.admission import MIN_PREFILL_CHUNK, Shape, kv_peak, prefill_chunk
from shardstream.switches import CPU_FLAGS
from counting import linear_dequantizations
from tiny_models import char_tokenizer, save_checkpoint

IDS = torch.randint(3, 128, (2, 11), generator=torch.Generator().manual_seed(1))
HALF = {"bfloat16": torch.bfloat16, "float16": torch.float16}


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """(family, stored dtype name) -> (checkpoint folder, store folder), made on first use."""
    made = {}

    def make(family: str, stored: str, compression: str | None = None):
        key = (family, stored, compression)
        if key not in made:
            folder = tmp_path_factory.mktemp(f"{family}-{stored}-{compression}")
            save_checkpoint(family, folder / "ckpt", dtype=HALF[stored])
            char_tokenizer().save_pretrained(folder / "ckpt")
            convert(folder / "ckpt", folder / "store", compression=compression, progress=False)
            made[key] = folder / "ckpt", folder / "store"
        return made[key]

    return make


def _reference(checkpoint, dtype: torch.dtype):
    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype).eval()


@pytest.mark.parametrize("family,stored", [("llama", "bfloat16"), ("qwen2", "bfloat16"), ("mistral", "bfloat16"),
                                          ("llama", "float16")])
@pytest.mark.parametrize("compute", ["float32", "stored"])
def test_a_half_precision_checkpoint_is_exact_in_its_compute_dtype(stores, family, stored, compute):
    """float32 compute against transformers on the same weights upcast (logits within 1e-4); the stored dtype
    against transformers in that dtype; greedy tokens equal either way."""
    checkpoint, store = stores(family, stored)
    dtype = torch.float32 if compute == "float32" else HALF[stored]
    reference = _reference(checkpoint, dtype)
    with AutoModel.from_pretrained(store, compute_dtype=compute if compute == "float32" else stored,
                                   max_resident_memory=0) as model, torch.no_grad():
        assert model.model.dtype == dtype
        got, want = model(IDS).logits, reference(IDS).logits
        assert got.dtype == dtype
        assert (got.float() - want.float()).abs().max().item() <= (1e-4 if dtype == torch.float32 else 1e-2)
        options = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(model.generate(IDS, **options), reference.generate(IDS, **options))


@pytest.mark.parametrize("stored,flags,device,chosen", [
    (torch.bfloat16, set(), "cpu", torch.float32),
    (torch.bfloat16, {"avx512f", "avx512_bf16"}, "cpu", torch.bfloat16),
    (torch.bfloat16, {"amx_bf16"}, "cpu", torch.bfloat16),
    (torch.float16, {"avx512_bf16"}, "cpu", torch.float32),
    (torch.float16, {"avx512_fp16"}, "cpu", torch.float16),
    (torch.float16, set(), "cuda", torch.float16),
    (torch.float32, set(), "cpu", torch.float32),
])
def test_auto_keeps_the_checkpoint_dtype_only_where_the_device_multiplies_it_fast(stored, flags, device, chosen):
    assert compute_dtype.choose(stored, torch.device(device), frozenset(flags))[0] == chosen


def test_this_machine_reports_its_cpu_flags():
    flags = compute_dtype.cpu_flags()
    if os.path.exists("/proc/cpuinfo") and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        assert "avx2" in flags


def test_the_environment_masks_and_adds_cpu_flags(monkeypatch):
    """SHARDSTREAM_CPU_FLAGS edits what cpu_flags reports, so any machine can take either path; a malformed
    entry is one sentence naming the variable."""
    monkeypatch.delenv(CPU_FLAGS.name, raising=False)
    listed = compute_dtype.cpu_flags()
    monkeypatch.setenv(CPU_FLAGS.name, " -avx512_bf16, -amx_bf16,+made_up_flag ")
    assert compute_dtype.cpu_flags() == (listed - {"avx512_bf16", "amx_bf16"}) | {"made_up_flag"}
    monkeypatch.setenv(CPU_FLAGS.name, "-avx512_bf16,amx_bf16")
    with pytest.raises(InvalidOption, match=r"SHARDSTREAM_CPU_FLAGS entry 'amx_bf16' is neither -flag \(mask it\) nor "
                                            r"\+flag \(add it\); write e.g. SHARDSTREAM_CPU_FLAGS=-avx512_bf16,-amx_bf16."):
        compute_dtype.cpu_flags()


@pytest.mark.parametrize("flags,chosen,why", [
    ("-avx512_bf16,-amx_bf16", torch.float32,
     "auto: the checkpoint is bfloat16, but this CPU lists none of avx512_bf16, amx_bf16"),
    ("+avx512_bf16", torch.bfloat16, "auto: the checkpoint's dtype, bfloat16: this CPU has avx512_bf16"),
])
def test_auto_says_what_it_chose_and_why(stores, monkeypatch, caplog, flags, chosen, why):
    """The flags pinned through the environment, whatever this machine has; on a CPU without bf16 instructions
    the weights stay bfloat16 (held as stored: the Linears' `packed`), multiplied in float32."""
    _, store = stores("llama", "bfloat16")
    monkeypatch.setenv(CPU_FLAGS.name, flags)
    with caplog.at_level(logging.INFO, "shardstream"), \
            AutoModel.from_pretrained(store, max_resident_memory=None) as model:
        assert model.model.dtype == chosen
        proj = model.model.model.layers[0].mlp.down_proj
        held = proj.packed if chosen == torch.float32 else proj.weight
        assert held.dtype == torch.bfloat16 and held.device.type == "cpu"
    assert f"compute dtype: {str(chosen).removeprefix('torch.')} ({why}" in caplog.text
    assert ("half-precision matrices stay as stored in memory, multiplied in float32" in caplog.text) == (
        chosen == torch.float32)


def test_the_option_overrides_auto_and_a_wrong_value_is_one_sentence(stores):
    _, store = stores("llama", "bfloat16")
    with AutoModel.from_pretrained(store, compute_dtype=torch.float16, max_resident_memory=0) as model:
        assert model.model.dtype == torch.float16
    with AutoModel.from_pretrained(store, dtype=torch.float32, max_resident_memory=0) as model:   # AirLLM's name
        assert model.model.dtype == torch.float32
    with pytest.raises(InvalidOption, match="compute_dtype 'float8' is not one shardstream computes in; use auto"):
        AutoModel.from_pretrained(store, compute_dtype="float8")


def _cli(*args: str, **environ: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(["src", os.environ.get("PYTHONPATH", "")]), **environ}
    return warm_python.run([sys.executable, "-m", "shardstream", *args], capture_output=True, text=True, timeout=300,
                           env=env)


def test_the_cli_takes_compute_dtype_and_says_what_it_chose(stores):
    checkpoint, store = stores("llama", "bfloat16")
    run = _cli("generate", str(store), "--prompt", "Hello", "--max-new-tokens", "5", "--compute-dtype", "float32",
               "--no-progress")
    assert run.returncode == 0, run.stderr[-2000:]
    assert "compute dtype: float32 (asked for; the checkpoint is bfloat16)" in run.stderr
    tokenizer = char_tokenizer()
    ids = tokenizer("Hello", return_tensors="pt")
    out = _reference(checkpoint, torch.float32).generate(**ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert run.stdout.strip() == tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).strip()
    flags = _cli("generate", str(store), "--prompt", "Hello", SHARDSTREAM_CPU_FLAGS="avx2")
    assert flags.returncode != 0 and "Traceback" not in flags.stderr
    assert "error: SHARDSTREAM_CPU_FLAGS entry 'avx2' is neither -flag (mask it) nor +flag (add it)" in flags.stderr
    wrong = _cli("generate", str(store), "--prompt", "Hello", "--compute-dtype", "half")
    assert wrong.returncode != 0 and "Traceback" not in wrong.stderr
    assert "--compute-dtype must be one of auto, float32, bfloat16, float16, not 'half'." in wrong.stderr
    from typer.testing import CliRunner

    from shardstream.cli import app
    assert "--compute-dtype" in CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "200"}).output


@pytest.mark.skipif(not quant_linear.available(), reason="no AVX-512 or AVX2, or no C++ compiler: the kernel is off here")
@pytest.mark.parametrize("compute", ["float32", "bfloat16"])
def test_a_4bit_bfloat16_store_multiplies_from_its_codes(stores, monkeypatch, compute):
    """No Linear weight of the blocks or the head is dequantized on a pass, in either compute dtype, and of the
    embedding only the rows of the pass's tokens; the logits are those of the same store dequantized (the
    kernel rounds each value to bfloat16, as dequantizing does)."""
    _, store = stores("llama", "bfloat16", "4bit")
    with AutoModel.from_pretrained(store, compute_dtype=compute, max_resident_memory=0) as model, torch.no_grad():
        dequantized = linear_dequantizations(monkeypatch)
        got = model(IDS).logits
        assert dequantized == []   # the embedding's rows (hidden 32, blocks of 64) are cut from 1-D spans of blocks
        assert model.model.get_input_embeddings().packed is not None
        assert len(model.packed_weights) == 7 * model.store.num_layers + 2   # and the head, the embedding
        tokens = model.generate(IDS, max_new_tokens=6, do_sample=False, pad_token_id=0)
    monkeypatch.undo()
    monkeypatch.setattr(loader, "packable", lambda meta, device: False)
    with AutoModel.from_pretrained(store, compute_dtype=compute, max_resident_memory=0) as model, torch.no_grad():
        assert not model.packed_weights
        want = model(IDS).logits
        assert torch.equal(tokens, model.generate(IDS, max_new_tokens=6, do_sample=False, pad_token_id=0))
    assert got.dtype == want.dtype == getattr(torch, compute)
    assert (got.float() - want.float()).abs().max().item() <= (1e-4 if compute == "float32" else 2e-2)


@pytest.mark.skipif(not quant_linear.available(), reason="no AVX-512 or AVX2, or no C++ compiler: the kernel is off here")
@pytest.mark.parametrize("compute", ["float32", "bfloat16"])
def test_a_tied_4bit_embedding_and_head_are_one_packed_tensor(stores, monkeypatch, compute):
    """Qwen2's tied embedding/head of a 4-bit store stays as its codes, one tensor serving both ends (no
    dequantized matrix in memory), and the resident budget counts its packed bytes once; same greedy tokens
    and logits within rounding as the store dequantized."""
    _, store = stores("qwen2", "bfloat16", "4bit")
    with AutoModel.from_pretrained(store, compute_dtype=compute) as model, torch.no_grad():
        embedding, head = model.model.get_input_embeddings(), model.model.get_output_embeddings()
        assert embedding.packed is not None and embedding.packed is head.packed
        assert embedding.weight.device.type == head.weight.device.type == "meta"
        names = {"model.embed_tokens.weight", "lm_head.weight"}
        codes = embedding.packed.data.nbytes + embedding.packed.absmax.nbytes
        assert 2 * embedding.weight.nbytes - model._loader.packing_saves(names, resident=True) == codes
        got = model(IDS).logits
        tokens = model.generate(IDS, max_new_tokens=6, do_sample=False, pad_token_id=0)
    monkeypatch.setattr(loader, "packable", lambda meta, device: False)
    with AutoModel.from_pretrained(store, compute_dtype=compute) as model, torch.no_grad():
        assert model.model.get_input_embeddings().packed is None
        want = model(IDS).logits
        assert torch.equal(tokens, model.generate(IDS, max_new_tokens=6, do_sample=False, pad_token_id=0))
    assert (got.float() - want.float()).abs().max().item() <= (1e-4 if compute == "float32" else 2e-2)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("compute", ["float32", "bfloat16"])
def test_a_chunked_prefill_equals_one_pass(stores, family, compute):
    """A prompt prefilled 8 tokens a pass (each pass adds its keys and values to the cache) gives the first
    token's logits of one pass, within rounding, and the same greedy tokens."""
    _, store = stores(family, "bfloat16")
    ids = torch.randint(3, 128, (1, 45), generator=torch.Generator().manual_seed(2))
    options = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    with AutoModel.from_pretrained(store, compute_dtype=compute, max_resident_memory=0) as model, torch.no_grad():
        whole = model.generate(ids, **options)
        passes = []
        model.prefill_chunk = lambda rows, length, new_tokens: 8
        hook = model.model.register_forward_pre_hook(lambda m, a, k: passes.append(k["input_ids"].shape[-1]),
                                                      with_kwargs=True)
        chunked = model.generate(ids, **options)
        hook.remove()
    assert passes == [8] * 5 + [5] + [1] * 5
    assert torch.equal(chunked.sequences, whole.sequences)
    tolerance = 1e-4 if compute == "float32" else 2e-2
    assert (chunked.scores[0] - whole.scores[0]).float().abs().max().item() <= tolerance


def test_admission_sizes_the_prefill_chunk_to_the_memory_left():
    """The whole prompt in one pass where it fits, else the most tokens (halving) whose pass's activations plus the
    whole KV cache fit; it counts the compute dtype's bytes, so float32 gets smaller chunks than bfloat16."""
    from transformers import AutoConfig

    config = AutoConfig.for_model("llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                                  num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8)
    shape = Shape.of(config, torch.float32)
    kv = kv_peak(shape, 1, 2048, 64)
    assert prefill_chunk(shape, 1, 2048, 64, 8 << 30) == 2048
    for free in (1 << 30, 400 << 20, 200 << 20, 120 << 20):
        chunk = prefill_chunk(shape, 1, 2048, 64, free)
        assert chunk == MIN_PREFILL_CHUNK or kv + shape.pass_bytes(1, chunk, 2048, 1) <= free
        assert chunk < 2048 and kv + shape.pass_bytes(1, chunk * 2, 2048, 1) > free   # the next size up would not fit
    assert prefill_chunk(shape, 1, 2048, 64, 0) == MIN_PREFILL_CHUNK   # never less: each pass reads the weights
    assert prefill_chunk(shape, 1, 20, 4, 0) == 20
    half = Shape.of(config, torch.bfloat16)
    assert prefill_chunk(half, 1, 2048, 64, 300 << 20) > prefill_chunk(shape, 1, 2048, 64, 300 << 20)


def test_generate_prefills_a_long_prompt_in_the_chunks_admission_sizes(stores, monkeypatch):
    _, store = stores("llama", "bfloat16")
    monkeypatch.setattr(admission, "MIN_PREFILL_CHUNK", 8)   # a prompt of the tiny model's context is short
    ids = torch.randint(3, 128, (1, 50), generator=torch.Generator().manual_seed(3))
    with AutoModel.from_pretrained(store, compute_dtype="float32", max_resident_memory=0) as model, torch.no_grad():
        shape = Shape.of(model.config, torch.float32)
        free = kv_peak(shape, 1, 50, 4) + shape.pass_bytes(1, 40, 50, 1)   # room for 40 tokens a pass, not 50
        monkeypatch.setattr("shardstream.stream.model.room", lambda device: free)
        assert model.prefill_chunk(1, 50, 4) == 25
        passes = []
        hook = model.model.register_forward_pre_hook(lambda m, a, k: passes.append(k["input_ids"].shape[-1]),
                                                     with_kwargs=True)
        model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
        hook.remove()
    assert passes == [25, 25, 1, 1, 1]


@pytest.mark.parametrize("rows", [1, 2])
def test_a_model_that_reads_nothing_a_pass_prefills_in_short_chunks(stores, monkeypatch, rows):
    """Every block and the head resident: a pass reads no weights, so a prompt goes in passes of at most
    RESIDENT_PREFILL_CHUNK tokens (over all rows), keeping a prefill's activations small; streamed blocks keep
    admission's chunk (here the whole prompt), since every pass reads them again. Tokens equal one pass's."""
    _, store = stores("llama", "bfloat16")
    monkeypatch.setattr("shardstream.stream.model.RESIDENT_PREFILL_CHUNK", 16)
    ids = torch.randint(3, 128, (rows, 40), generator=torch.Generator().manual_seed(4))
    options = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
    sequences, passes = {}, {}
    for residency in ("auto", 0):
        with AutoModel.from_pretrained(store, compute_dtype="float32", max_resident_memory=residency) as model, \
                torch.no_grad():
            assert (not model.pieces) == (residency == "auto")
            seen = passes[residency] = []
            hook = model.model.register_forward_pre_hook(lambda m, a, k: seen.append(k["input_ids"].shape[-1]),
                                                         with_kwargs=True)
            sequences[residency] = model.generate(ids, **options)
            hook.remove()
    columns = 16 // rows
    assert passes["auto"] == [columns] * (40 // columns) + [40 % columns] * (40 % columns > 0) + [1, 1]
    assert passes[0] == [40, 1, 1]
    assert torch.equal(sequences["auto"], sequences[0])
