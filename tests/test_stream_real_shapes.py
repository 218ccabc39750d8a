"""Real checkpoint shapes: bf16 and 128k-152k vocabularies (scripts/real_shapes.py, at 2 blocks).

The embedding/head of such a vocabulary is as big as several blocks, so how it is loaded decides
whether a model loads at all under a memory cap: no part may be in memory twice while loading (a
tied head read again beside the embedding was), the embedding is read by rows when it is not in
memory anyway, and a tied embedding is one tensor serving both ends. Memory is measured as a cap
counts it as far as a process can see: VmHWM, the peak resident set, mapped file pages included,
reset after loading (/proc/self/clear_refs) to get the peak while decoding apart.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from shardstream.convert import convert
from shardstream.errors import InvalidOption
from shardstream.store import open_store
from shardstream.stream import StreamingModel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from real_shapes import write_checkpoint  # noqa: E402

LAYERS = 2
IDS = [[128000, 1, 2, 3, 90000, 5, 5, 127999]]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """name -> (checkpoint, store), each made once for the module."""
    made: dict[str, tuple[Path, Path]] = {}

    def get(shape: str, **overrides) -> tuple[Path, Path]:
        name = shape + "".join(f"-{k}={v}" for k, v in overrides.items())
        if name not in made:
            root = tmp_path_factory.mktemp(name)
            ckpt = write_checkpoint(shape, root / "ckpt", layers=LAYERS, **overrides)
            convert(ckpt, root / "store", progress=False)
            made[name] = (ckpt, root / "store")
        return made[name]

    return get


PEAKS = textwrap.dedent(r"""
    import json, re, sys
    import torch
    from shardstream.store import open_store
    from shardstream.stream import StreamingModel

    def peak():
        with open("/proc/self/status") as f:
            return int(re.search(r"VmHWM:\s+(\d+) kB", f.read())[1]) * 1024

    def reset():   # the peak so far (inherited from the forking parent, or the load's) starts again from now
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    budget = json.loads(sys.argv[2])
    reset()
    model = StreamingModel(open_store(sys.argv[1]), max_resident_memory=budget)
    loading = peak()
    reset()
    ids = torch.tensor(json.loads(sys.argv[3]))
    model.generate(ids, max_new_tokens=4, do_sample=False)
    print(json.dumps({"loading": loading, "decoding": peak(), "streamed": sorted(model._ends.streamed)}))
""")


@pytest.mark.parametrize("budget", ["auto", 0])
def test_load_peak_within_decode_peak(built, budget):
    """Qwen2.5-0.5B's tied 272 MB embedding/head, resident ('auto') or streamed (0): loading peaks no higher
    than decoding (+5%); a tied head read again beside the mapped embedding had made it 1.2x."""
    _, store = built("qwen2.5-0.5b")
    run = subprocess.run([sys.executable, "-c", PEAKS, str(store), json.dumps(budget), json.dumps(IDS)],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "SHARDSTREAM_DIRECT_IO": "off"})
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["streamed"] == ([] if budget == "auto" else ["lm_head.weight", "model.embed_tokens.weight"])
    assert result["loading"] <= 1.05 * result["decoding"], result


def _read_bytes() -> int:
    """Bytes this process has read with read/pread calls so far (/proc/self/io rchar)."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


@pytest.mark.parametrize("overrides", [{}, {"tie_word_embeddings": False}], ids=["tied", "untied"])
def test_embedding_reads_rows_by_offset(built, overrides):
    """With the embedding not in memory (streamed with its tied head, or untied), a pass reads only the rows of
    its distinct tokens, by their offsets in the store file, and gets exactly the stored rows."""
    ckpt, store = built("qwen2.5-0.5b", **overrides)
    model = StreamingModel(open_store(store), max_resident_memory=0 if not overrides else "auto")
    embed = model.model.get_input_embeddings()
    assert "model.embed_tokens.weight" in model._ends.streamed
    ids = torch.tensor(IDS)
    embed(ids)   # the first use checksums the file whole, through a small buffer
    before = _read_bytes()
    rows = embed(ids)
    read = _read_bytes() - before
    distinct = len(set(IDS[0]))
    assert distinct * 896 * 2 <= read <= distinct * 896 * 2 + 512   # bf16 rows of hidden 896 (+ reading /proc)
    with safe_open(str(next(ckpt.glob("*.safetensors"))), "pt") as f:
        stored = f.get_slice("model.embed_tokens.weight")
        expected = torch.stack([stored[i:i + 1][0] for i in IDS[0]])
    assert torch.equal(rows[0], expected)
    assert embed.weight.shape == (0, 896) and embed.weight.device.type == "cpu"   # a stand-in between passes
    model.close()


@pytest.mark.parametrize("compute_dtype", ["auto", "float32"])
def test_tied_embedding_held_once(built, compute_dtype):
    """A resident tied embedding/head is one tensor in memory serving both ends, also when cast to a compute
    dtype other than the store's (each end used to get its own float32 copy of the bf16 matrix)."""
    _, store = built("qwen2.5-0.5b")
    model = StreamingModel(open_store(store), max_resident_memory="auto", compute_dtype=compute_dtype)
    embedding = model.model.get_input_embeddings().weight
    head = model.model.get_output_embeddings().weight
    assert embedding.device.type == "cpu" and embedding.shape == (151936, 896)
    assert embedding.dtype == (torch.float32 if compute_dtype == "float32" else model.model.dtype)
    storages = (embedding.untyped_storage().data_ptr(), head.untyped_storage().data_ptr())   # ints: a failure
    starts = (embedding.data_ptr(), head.data_ptr())                                          # prints no matrix
    model.close()
    assert storages[0] == storages[1] and starts[0] == starts[1]


@pytest.mark.parametrize("shape", ["llama-3.2-1b", "qwen2.5-0.5b"])
@pytest.mark.parametrize("budget", ["auto", 0], ids=["resident", "streamed"])
def test_real_shapes_exact_against_transformers(built, shape, budget):
    """bf16 logits and greedy tokens equal transformers' own in memory, bit for bit, with the embedding/head
    resident or streamed (rows, and the head in slices)."""
    ckpt, store = built(shape)
    reference = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).eval()
    ids = torch.tensor(IDS)
    with torch.no_grad():
        expected = reference(ids).logits
    tokens = reference.generate(ids, max_new_tokens=3, do_sample=False)
    del reference
    model = StreamingModel(open_store(store), max_resident_memory=budget, compute_dtype=torch.bfloat16)
    assert bool(model._ends.streamed) == (budget == 0)
    got = model(ids).logits
    assert got.dtype == torch.bfloat16 and torch.equal(got, expected)
    assert torch.equal(model.generate(ids, max_new_tokens=3, do_sample=False), tokens)
    model.close()


@pytest.mark.parametrize("compression", [None, "4bit"])
def test_auto_read_ahead_cuts_finer_pieces_in_the_same_memory(built, tmp_path, compression):
    """prefetch_depth='auto' on a CPU: the Llama-3.2-1B shape's MLP Linears (32 MiB each in bf16; their
    codes, multiplied packed, in a 4-bit store) are one piece each, 3 read ahead, in the working set that
    two pieces of gate and up together took with one read ahead: more reads in flight, no more memory,
    the same logits."""
    ckpt, store = built("llama-3.2-1b")
    if compression:
        convert(ckpt, tmp_path / "store", compression=compression, progress=False)
        store = tmp_path / "store"
    ids = torch.tensor(IDS)
    runs = {}
    for name, options in (("auto", {}), ("before", dict(prefetch_depth=1, piece_bytes=64 << 20))):
        with StreamingModel(open_store(store), max_resident_memory=0, **options) as model:
            runs[name] = (model(ids).logits, model._streaming._depth, model.stream_working_set,
                          max(len(ps) for ps in model.pieces.values()))
    assert runs["auto"][1:] == (3, runs["before"][2], 5) and runs["before"][1:] == (1, runs["before"][2], 4)
    assert torch.equal(runs["auto"][0], runs["before"][0])


@pytest.mark.parametrize("depth", [0, "deep", True, 1.5])
def test_prefetch_depth_is_checked(built, depth):
    _, store = built("llama-3.2-1b")
    with pytest.raises(InvalidOption, match=r"prefetch_depth must be 'auto' or a number of pieces >= 1, not "):
        StreamingModel(open_store(store), prefetch_depth=depth)
