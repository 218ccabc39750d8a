"""A 4-bit or 8-bit store's big embedding and head (stream/ends.py), as a real vocabulary's are handled: the
embedding's rows read by offset as codes and scales and dequantized, the head streamed in slices multiplied
from their codes; the same logits and greedy tokens as with both held packed. The tiny models' matrices are
made big by lowering `STREAMED_BYTES`."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from shardstream.convert import convert
from shardstream.store import open_store
from shardstream.stream import StreamingModel, ends, quant_linear
from shardstream.stream.ends import StreamedHead
from shardstream.switches import QUANT_KERNEL
from tiny_models import save_checkpoint, tiny_config

# Rows of whole blocks of either method's default block size (64, 256); a head several times a block's stored
# bytes, so that its slices, of a block piece's size, are several.
VOCAB, HIDDEN = 8192, 256
IDS = [[1, 7, 8, 9, 8191, 300, 7, 5]]
EMBEDDING, HEAD = "model.embed_tokens.weight", "lm_head.weight"

needs_kernel = pytest.mark.skipif(not quant_linear.available(), reason="no AVX-512 or AVX2, or no C++ compiler")


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """(family, method) -> a converted store of a 2-block model with a VOCAB x HIDDEN embedding, made once."""
    made = {}

    def get(family: str, method: str):
        if (family, method) not in made:
            folder = tmp_path_factory.mktemp(f"{family}-{method}")
            config = tiny_config(family, vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                                 num_hidden_layers=2)
            torch.manual_seed(0)
            AutoModelForCausalLM.from_config(config).save_pretrained(folder / "ckpt")
            convert(folder / "ckpt", folder / "store", compression=method, progress=False)
            made[family, method] = folder / "store"
        return made[family, method]

    return get


def _read_bytes() -> int:
    """Bytes this thread has read with read/pread calls so far (/proc/thread-self/io rchar): the rows are read
    by the thread running the pass, while the blocks' reader threads may be reading ahead."""
    with open("/proc/thread-self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def _held(model: StreamingModel) -> list[int]:
    """Bytes of every weight held in memory now, each tensor once: the real parameters and what modules
    multiply or look up from (`packed`: a tensor, or a quantized one's codes and scales)."""
    tensors = [p for p in model.model.parameters() if p.device.type != "meta"]
    for module in model.model.modules():
        packed = getattr(module, "packed", None)
        tensors += [] if packed is None else [packed] if isinstance(packed, torch.Tensor) else [packed.data]
    return [t.nbytes for t in {t.data_ptr(): t for t in tensors}.values()]


def _run(store, **options) -> tuple[torch.Tensor, torch.Tensor]:
    with StreamingModel(open_store(store), **options) as model, torch.no_grad():
        ids = torch.tensor(IDS)
        return model(ids).logits, model.generate(ids, max_new_tokens=4, do_sample=False)


@needs_kernel
@pytest.mark.parametrize("method", ["4bit", "8bit"])
@pytest.mark.parametrize("family,budget,streamed", [
    ("llama", None, {EMBEDDING}),          # untied: the embedding is read by rows, the head fits
    ("llama", 0, {EMBEDDING, HEAD}),       # and with no memory for it, the head is streamed
    ("qwen2", None, set()),                # tied: the embedding follows a resident head
    ("qwen2", 0, {EMBEDDING, HEAD}),       # a tied pair streamed: rows and slices of the same codes
], ids=["untied-resident-head", "untied-streamed-head", "tied-resident", "tied-streamed"])
def test_quantized_ends_read_by_rows_and_streamed_in_slices(stores, monkeypatch, method, family, budget, streamed):
    """The embedding's rows are read from their codes and scales by offset (those bytes only, each run of rows
    one read) and dequantized into the model's dtype, the head multiplied slice by slice from its codes: the
    logits are those of the same store with both held packed, bit for bit, and greedy tokens equal. Neither
    streamed matrix is in memory whole, nor was loaded so."""
    store = stores(family, method)
    packed_logits, packed_tokens = _run(store, max_resident_memory=None)   # too small to stream: held packed
    monkeypatch.setattr(ends, "STREAMED_BYTES", 1 << 16)
    record = open_store(store).manifest.tensors[EMBEDDING]
    assert record.stored_bytes >= 1 << 16
    with StreamingModel(open_store(store), max_resident_memory=budget) as model, torch.no_grad():
        assert model.streamed_ends == streamed
        whole = {EMBEDDING, HEAD} - streamed   # a tied pair: one tensor
        assert _held(model).count(record.length) == (min(len(whole), 1) if family == "qwen2" else len(whole))
        head = model.model.get_output_embeddings().forward
        if HEAD in streamed:
            assert isinstance(head.__self__, StreamedHead) and len(head.__self__.slices) > 1
            assert model.report().streamed_head_bytes == record.stored_bytes
        embed = model.model.get_input_embeddings()
        ids = torch.tensor(IDS)
        embed(ids)   # the first use checksums the file whole, through a small buffer
        before = _read_bytes()
        rows = embed(ids)
        read = _read_bytes() - before
        logits = model(ids).logits
        tokens = model.generate(ids, max_new_tokens=4, do_sample=False)
    blocks = record.quant["blocksize"]
    row_bytes = HIDDEN * {"4bit": 1, "8bit": 2}[method] // 2 + HIDDEN // blocks * 4   # codes, float32 scales
    distinct = len(set(IDS[0]))
    if EMBEDDING in streamed:
        assert distinct * row_bytes <= read <= distinct * row_bytes + 512   # (+ reading /proc)
    assert rows.dtype == logits.dtype == packed_logits.dtype == torch.float32
    assert torch.equal(logits, packed_logits)
    assert torch.equal(tokens, packed_tokens)


@pytest.mark.parametrize("family,method", [("llama", "4bit"), ("llama", "int4")], ids=["part-blocks", "int4"])
def test_rows_that_are_not_runs_of_the_file_stay_packed(tmp_path, monkeypatch, family, method):
    """A 4-bit matrix whose rows share blocks (the tiny model's 32 columns, blocks of 64) and an int4 one (rows
    interleaved in groups of 16) cannot be read by rows: however big, both ends stay held packed."""
    if method == "int4":
        config = tiny_config(family, vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                             num_hidden_layers=2)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "ckpt")
    else:
        save_checkpoint(family, tmp_path / "ckpt")
    convert(tmp_path / "ckpt", tmp_path / "store", compression=method, progress=False)
    monkeypatch.setattr(ends, "STREAMED_BYTES", 0)
    with StreamingModel(open_store(tmp_path / "store"), max_resident_memory=0) as model:
        assert model.streamed_ends == set()


@pytest.mark.parametrize("method", ["4bit", "8bit"])
def test_the_planner_counts_a_quantized_embedding_as_rows(stores, monkeypatch, method):
    """A pipeline plan counts a big 4-bit or 8-bit embedding as the engine holds it (not at all: read by rows),
    and a big head at its codes and scales, which a last stage may stream."""
    from shardstream.pipeline import costs

    store = open_store(stores("llama", method))
    held = costs.model_cost(store)
    monkeypatch.setattr(costs, "STREAMED_BYTES", 1 << 16)
    streamed = costs.model_cost(store)
    tensors = store.manifest.tensors
    assert held.start_bytes - streamed.start_bytes == tensors[EMBEDDING].stored_bytes
    assert streamed.head_bytes == tensors[HEAD].stored_bytes and held.head_bytes == 0


@pytest.mark.parametrize("family,streamed", [("llama", {EMBEDDING}), ("qwen2", set())], ids=["untied", "tied"])
def test_without_the_kernel_a_quantized_head_stays_resident(stores, monkeypatch, family, streamed):
    """Where the kernel is off the loader dequantizes a quantized head whole, so it is neither streamed nor
    counted at its stored size, and a tied embedding stays with it; an untied one is still read by rows (no
    kernel needed to dequantize rows): the same greedy tokens, logits within the kernel's rounding."""
    store = stores(family, "4bit")
    want_logits, want_tokens = _run(store, max_resident_memory=None)
    monkeypatch.setattr(ends, "STREAMED_BYTES", 1 << 16)
    monkeypatch.setenv(QUANT_KERNEL.name, "0")
    quant_linear._library.cache_clear()
    try:
        with StreamingModel(open_store(store), max_resident_memory=0) as model, torch.no_grad():
            assert model.streamed_ends == streamed and model.packed_weights == frozenset()
            ids = torch.tensor(IDS)
            logits, tokens = model(ids).logits, model.generate(ids, max_new_tokens=4, do_sample=False)
    finally:
        quant_linear._library.cache_clear()
    assert (logits - want_logits).abs().max().item() <= 1e-5
    assert torch.equal(tokens, want_tokens)
