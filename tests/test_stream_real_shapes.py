"""Real checkpoint shapes: bf16 and 128k-152k vocabularies (scripts/real_shapes.py, at 2 blocks).

The embedding/head of such a vocabulary is as big as several blocks, so how it is loaded decides
whether a model loads at all under a memory cap: no part may be in memory twice while loading (a
tied head read again beside the embedding was), the embedding is read by rows when it is not in
memory anyway, and a tied embedding is one tensor serving both ends. Memory is measured as a cap
counts it as far as a process can see: VmHWM, the peak resident set, mapped file pages included,
reset after loading (/proc/self/clear_refs) to get the peak while decoding apart.

Every test whose result depends on the CPU runs as on a CPU with bf16 instructions (bf16 compute) and
as on one without ("bf16 weights, float32 math": the weights stay bf16 in memory, multiplied in
float32), the flags pinned by SHARDSTREAM_CPU_FLAGS whatever this machine has. A resident embedding/head
is asked for with max_resident_memory=None, not "auto", so that no test depends on the memory others
left free.
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
from shardstream.stream.ends import StreamedHead
from shardstream.switches import CPU_FLAGS

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from real_shapes import write_checkpoint  # noqa: E402
from test_serving_serve_memory import MEMCAP, _memcap_missing  # noqa: E402

LAYERS = 2
IDS = [[128000, 1, 2, 3, 90000, 5, 5, 127999]]
# SHARDSTREAM_CPU_FLAGS of each kind of CPU, and the compute dtype `auto` then picks for a bf16 store
CPUS = {"bf16_cpu": ("+avx512_bf16", torch.bfloat16), "no_bf16_cpu": ("-avx512_bf16,-amx_bf16", torch.float32)}


@pytest.fixture(params=list(CPUS))
def cpu(request, monkeypatch) -> torch.dtype:
    """This test as on a CPU with bf16 instructions and as on one without (flags pinned, subprocesses
    included); the compute dtype `auto` picks there for a bf16 store."""
    flags, dtype = CPUS[request.param]
    monkeypatch.setenv(CPU_FLAGS.name, flags)
    return dtype


@pytest.fixture(scope="module")
def built(module_tmp_path):
    """name -> (checkpoint, store), each made once for the module."""
    made: dict[str, tuple[Path, Path]] = {}

    def get(shape: str, **overrides) -> tuple[Path, Path]:
        name = shape + "".join(f"-{k}={v}" for k, v in overrides.items())
        if name not in made:
            root = module_tmp_path / name
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

    budget = json.loads(sys.argv[2])   # JSON null: None
    reset()
    model = StreamingModel(open_store(sys.argv[1]), max_resident_memory=budget)
    loading = peak()
    reset()
    ids = torch.tensor(json.loads(sys.argv[3]))
    model.generate(ids, max_new_tokens=4, do_sample=False)
    print(json.dumps({"loading": loading, "decoding": peak(), "streamed": sorted(model.streamed_ends)}))
""")


@pytest.mark.parametrize("budget", [None, 0], ids=["resident", "streamed"])
def test_load_peak_within_decode_peak(built, cpu, budget):
    """Qwen2.5-0.5B's tied 272 MB embedding/head, resident or streamed (0): loading peaks no higher than
    decoding (+5%); a tied head read again beside the mapped embedding had made it 1.2x, and converting it to
    float32 at load (a CPU without bf16 instructions) 1.12x."""
    _, store = built("qwen2.5-0.5b")
    run = subprocess.run([sys.executable, "-c", PEAKS, str(store), json.dumps(budget), json.dumps(IDS)],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "SHARDSTREAM_DIRECT_IO": "off"})
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["streamed"] == ([] if budget is None else ["lm_head.weight", "model.embed_tokens.weight"])
    assert result["loading"] <= 1.05 * result["decoding"], result


def _read_bytes() -> int:
    """Bytes this process has read with read/pread calls so far (/proc/self/io rchar)."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


@pytest.mark.parametrize("overrides", [{}, {"tie_word_embeddings": False}], ids=["tied", "untied"])
def test_embedding_reads_rows_by_offset(built, cpu, overrides):
    """With the embedding not in memory (streamed with its tied head, or untied, everything else resident), a
    pass reads only the bf16 rows of its distinct tokens, by their offsets in the store file, and gets exactly
    the stored rows (in the compute dtype)."""
    ckpt, store = built("qwen2.5-0.5b", **overrides)
    model = StreamingModel(open_store(store), max_resident_memory=0 if not overrides else None)
    embed = model.model.get_input_embeddings()
    assert "model.embed_tokens.weight" in model.streamed_ends
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
    assert rows.dtype == cpu and torch.equal(rows[0], expected.to(cpu))
    assert embed.weight.shape == (0, 896) and embed.weight.device.type == "cpu"   # a stand-in between passes
    assert embed.weight.dtype == model.model.dtype == cpu
    model.close()


@pytest.mark.parametrize("compute_dtype", ["auto", "float32"])
def test_tied_embedding_held_once(built, cpu, compute_dtype):
    """A resident tied embedding/head is one bf16 tensor in memory serving both ends, in every compute dtype: in
    bf16 the parameter itself, in float32 held as stored for the float32 products (each end used to get its own
    float32 copy of the bf16 matrix, then both one shared float32 copy)."""
    _, store = built("qwen2.5-0.5b")
    model = StreamingModel(open_store(store), max_resident_memory=None, compute_dtype=compute_dtype)
    embedding, head = model.model.get_input_embeddings(), model.model.get_output_embeddings()
    if model.model.dtype == torch.bfloat16:
        embedding, head = embedding.weight, head.weight
    else:
        assert embedding.weight.device.type == head.weight.device.type == "meta"
        embedding, head = embedding.packed, head.packed
    assert model.model.dtype == (torch.float32 if compute_dtype == "float32" else cpu)
    assert embedding.device.type == "cpu" and embedding.shape == (151936, 896) and embedding.dtype == torch.bfloat16
    storages = (embedding.untyped_storage().data_ptr(), head.untyped_storage().data_ptr())   # ints: a failure
    starts = (embedding.data_ptr(), head.data_ptr())                                          # prints no matrix
    model.close()
    assert storages[0] == storages[1] and starts[0] == starts[1]


@pytest.fixture(scope="module")
def reference(built):
    """(shape, dtype) -> transformers' own logits and 3 greedy tokens for IDS, in memory, on the same weights
    (computed once each, on first use)."""
    made: dict[tuple[str, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def get(shape: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if (shape, dtype) not in made:
            model = AutoModelForCausalLM.from_pretrained(built(shape)[0], dtype=dtype).eval()
            ids = torch.tensor(IDS)
            with torch.no_grad():
                made[shape, dtype] = model(ids).logits, model.generate(ids, max_new_tokens=3, do_sample=False)
        return made[shape, dtype]

    return get


@pytest.mark.parametrize("shape", ["llama-3.2-1b", "qwen2.5-0.5b"])
@pytest.mark.parametrize("budget", [None, 0], ids=["resident", "streamed"])
def test_real_shapes_exact_against_transformers(built, reference, cpu, shape, budget):
    """The default compute dtype against transformers' own in memory on the same bf16 weights, with the
    embedding/head resident or streamed (rows, and the head in slices): in bf16 the logits bit for bit; in
    float32 math on bf16 weights within 1e-4 of transformers computing in float32; greedy tokens equal."""
    _, store = built(shape)
    expected, tokens = reference(shape, cpu)
    model = StreamingModel(open_store(store), max_resident_memory=budget)
    assert bool(model.streamed_ends) == (budget == 0)
    ids = torch.tensor(IDS)
    got = model(ids).logits
    assert got.dtype == cpu
    if cpu == torch.bfloat16:
        assert torch.equal(got, expected)
    else:
        assert (got - expected).abs().max().item() <= 1e-4
    assert torch.equal(model.generate(ids, max_new_tokens=3, do_sample=False), tokens)
    model.close()


@pytest.mark.parametrize("shape", ["llama-3.2-1b", "qwen2.5-0.5b"])   # a tied head; an untied one
def test_pipeline_stages_of_a_real_vocabulary_read_rows_and_stream_the_head(built, reference, cpu, shape):
    """Two stages of a real shape's store, each the engine over its block: the first reads the embedding's
    rows (it holds no head), the last, with no memory for blocks, streams the head in slices, read from the
    embedding's bytes where tied; greedy tokens equal transformers'."""
    from shardstream.pipeline.stage import StageModel

    store = open_store(built(shape)[1])
    _, tokens = reference(shape, cpu)
    stages = [StageModel(store, 0, 1), StageModel(store, 1, LAYERS, stream_budget=0)]
    assert [stage.engine.streamed_ends for stage in stages] == [{"model.embed_tokens.weight"}, {"lm_head.weight"}]
    ids, position = torch.tensor(IDS), 0
    for _ in range(3):
        data = ids[:, position:]
        for stage in stages:
            data = stage.forward("s", position, data)
        position = ids.shape[1]
        ids = torch.cat([ids, data.argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(ids, tokens)
    for stage in stages:
        stage.close()


def _weights_in_use(model: StreamingModel) -> list[tuple[str, torch.dtype, int]]:
    """Records (module, dtype, bytes) of every Linear's and embedding's weight in memory as it runs, from
    now on: the parameter where it is real, else what its module multiplies from (`packed`)."""
    seen: list[tuple[str, torch.dtype, int]] = []

    def record(name: str, module: torch.nn.Module, args) -> None:
        weight = module.weight if module.weight.device.type != "meta" else getattr(module, "packed", None)
        if isinstance(weight, torch.Tensor) and weight.numel():
            seen.append((name, weight.dtype, weight.nbytes))

    for name, module in model.model.named_modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            module.register_forward_pre_hook(lambda m, a, name=name: record(name, m, a))
    return seen


@pytest.mark.parametrize("budget", [None, 0], ids=["resident", "streamed"])
def test_no_bf16_weight_is_held_at_float32_size(built, cpu, budget):
    """Whatever the compute dtype, every weight matrix of a pass is in memory as stored, bf16 (an embedding
    read by rows aside: only its pass's rows, in the compute dtype), and a streamed head is read in slices,
    never whole; a pass reads each streamed block's stored bytes once."""
    _, store = built("qwen2.5-0.5b")
    with StreamingModel(open_store(store), max_resident_memory=budget) as model:
        seen = _weights_in_use(model)
        model(torch.tensor(IDS))
        before = model.bytes_read   # the readers read ahead into the next pass: count a steady one
        model(torch.tensor(IDS))
        per_pass = model.bytes_read - before
        seen = seen[:len(seen) // 2]
        forward = model.model.get_output_embeddings().forward
        slices = len(forward.__self__.slices) if isinstance(forward.__self__, StreamedHead) else 0
        streamed = model.streamed_ends
    matrices = [(name, dtype) for name, dtype, nbytes in seen if name != "model.embed_tokens" or not streamed]
    assert len(matrices) == 7 * LAYERS + (0 if streamed else 2)
    assert {dtype for _, dtype in matrices} == {torch.bfloat16}, matrices
    rows = [nbytes for name, _, nbytes in seen if name == "model.embed_tokens"]
    assert rows == ([len(set(IDS[0])) * 896 * cpu.itemsize] if streamed else [151936 * 896 * 2])
    if streamed:
        assert slices > 1
        manifest = open_store(store).manifest
        assert per_pass == sum(manifest.tensors[name].length for i in range(LAYERS)   # the blocks' tensors as stored
                               for name in manifest.parts[f"mid/{i}"].tensors)
    else:
        assert per_pass == 0   # everything was read once, at load


@pytest.mark.parametrize("compression", [None, "4bit"])
def test_auto_read_ahead_cuts_finer_pieces_in_the_same_memory(built, tmp_path, cpu, compression):
    """prefetch_depth='auto' on a CPU: the Llama-3.2-1B shape's MLP Linears (32 MiB each in bf16, computed in
    bf16 or held so for float32 math; their codes, multiplied packed, in a 4-bit store) are one piece each, 3
    read ahead, in the working set that two pieces of gate and up together took with one read ahead: more
    reads in flight, no more memory, the same logits."""
    ckpt, store = built("llama-3.2-1b")
    if compression:
        convert(ckpt, tmp_path / "store", compression=compression, progress=False)
        store = tmp_path / "store"
    ids = torch.tensor(IDS)
    runs = {}
    for name, options in (("auto", {}), ("before", dict(prefetch_depth=1, piece_bytes=64 << 20))):
        with StreamingModel(open_store(store), max_resident_memory=0, **options) as model:
            runs[name] = (model(ids).logits, model.report().prefetch_depth, model.stream_working_set,
                          max(len(ps) for ps in model.pieces.values()))
    assert runs["auto"][1:] == (3, runs["before"][2], 5) and runs["before"][1:] == (1, runs["before"][2], 4)
    assert torch.equal(runs["auto"][0], runs["before"][0])


@pytest.mark.parametrize("depth", [0, "deep", True, 1.5])
def test_prefetch_depth_is_checked(built, depth):
    _, store = built("llama-3.2-1b")
    with pytest.raises(InvalidOption, match=r"prefetch_depth must be 'auto' or a number of pieces >= 1, not "):
        StreamingModel(open_store(store), prefetch_depth=depth)


CAPPED = textwrap.dedent(r"""
    import json, sys
    import torch
    from shardstream.store import open_store
    from shardstream.stream import StreamingModel

    model = StreamingModel(open_store(sys.argv[1]))
    tokens = model.generate(torch.tensor(json.loads(sys.argv[2])), max_new_tokens=3, do_sample=False)
    print(json.dumps([str(model.model.dtype), tokens.tolist()]))
""")
CAP = "1000M"


@pytest.mark.skipif(_memcap_missing() is not None, reason=_memcap_missing() or "")
def test_the_defaults_hold_a_cap_that_float32_copies_exceeded(built, reference, cpu):
    """Under a 1000 MiB cap that counts the page cache, the 2-layer Llama-3.2-1B shape (768 MB of bf16, 525 MB
    of it the tied embedding/head) runs with the defaults and gives transformers' greedy tokens, on either CPU.
    On a CPU without bf16 instructions its float32 copies (a 1 GB head, the blocks converted) peaked at 2.5 GiB
    and were killed under 1500 MiB."""
    ckpt, store = built("llama-3.2-1b")
    _, tokens = reference("llama-3.2-1b", cpu)
    run = subprocess.run([str(MEMCAP), CAP, "--cold", str(store), "--", sys.executable, "-c", CAPPED, str(store),
                          json.dumps(IDS)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    dtype, got = json.loads(run.stdout.strip().splitlines()[-1])
    assert dtype == str(cpu) and got == tokens.tolist()


def test_a_streamed_head_reads_as_the_blocks_do_once_a_batch_engine_switches_them(built, monkeypatch):
    """The model opens with its blocks in the page cache (they fit); a batch engine then moves the streamed
    blocks past it (`leave_memory_to_a_batch`: O_DIRECT), and the streamed head follows at its next read."""
    from shardstream.stream import ends

    _, store = built("qwen2.5-0.5b")
    direct: list[bool] = []
    real = ends.read_ranges

    def recording(*args):
        direct.append(args[5])
        return real(*args)

    monkeypatch.setattr(ends, "read_ranges", recording)
    with StreamingModel(open_store(store), max_resident_memory=0, compute_dtype="bfloat16") as model:
        model(torch.tensor(IDS))
        assert direct and not any(direct)   # read through the page cache, as the blocks are
        model.leave_memory_to_a_batch()
        direct.clear()
        model(torch.tensor(IDS))
        assert direct and all(direct)
