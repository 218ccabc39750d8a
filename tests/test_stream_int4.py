"""int4: 4-bit integers with a bfloat16 scale per 32 values of a row (quant_int4.py), multiplied in integer dot
products on the CPU (stream/int4_linear.py): the round trip's error bound, the stored layout, the kernel against
the exact math it does and against the float product, every build, and converted models streaming with it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from shardstream import native, quant, quant_int4
from shardstream.convert import convert
from shardstream.errors import InvalidOption
from shardstream.options import compression
from shardstream.store import open_store
from shardstream import AutoModel
from shardstream.stream import StreamingModel, int4_linear, quant_linear, quant_triton
from shardstream.tp.layout import Take
from shardstream.tp.reading import ShareReader
from shardstream.switches import INT4_KERNEL
from counting import linear_dequantizations
from test_stream import _dequantized_reference
from tiny_models import save_checkpoint

needs_kernel = pytest.mark.skipif(not int4_linear.available(), reason="no AVX2 or no C++ compiler: the kernel is off here")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 0.05).to(dtype)


def per_row_blocks(values: torch.Tensor) -> torch.Tensor:
    """A tensor's rows (all but the last dimension), zero-padded to whole blocks of 32, one block a row."""
    matrix = values.reshape(-1, values.shape[-1] if values.dim() else 1).float()
    return F.pad(matrix, (0, -matrix.shape[1] % 32)).view(-1, 32)


def exact_weights(weight: quant.QuantizedTensor) -> torch.Tensor:
    """The weights the kernel multiplies: q * d in float32 (a bfloat16 or float16 tensor's are not rounded to it)."""
    return quant.dequantize(weight.data, weight.absmax, {**weight.meta, "dtype": "float32"}).view(weight.meta["shape"])


def activations_rounded(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel multiplies it: per block of 32 values of a row, round(x / d) * d for d = max|x| / 127."""
    columns = x.shape[-1]
    blocks = F.pad(x.float(), (0, -columns % 32)).view(x.shape[0], -1, 32)
    d = blocks.abs().amax(dim=2, keepdim=True) / 127
    q = torch.where(d > 0, blocks / d, 0).round()
    return (q * d).view(x.shape[0], -1)[:, :columns]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(37, 300), (3, 5, 70), (7,), (1, 1), (16, 64)])
def test_round_trip_error_within_bound_and_rows_read_alone_give_the_same_values(dtype, shape):
    x = randn(*shape, dtype=dtype)
    q = quant.quantize(x, "int4")
    assert q.meta == {"method": "int4", "blocksize": 32, "shape": list(shape), "dtype": str(dtype).split(".")[1]}
    assert q.absmax.dtype == torch.bfloat16 and q.data.numel() == quant_int4.code_bytes(list(shape))
    y = quant.dequantize(q.data, q.absmax, q.meta)
    assert y.shape == x.shape and y.dtype == dtype
    block_error = per_row_blocks(y.float() - x.float()).abs().amax(dim=1)
    block_absmax = per_row_blocks(x).abs().amax(dim=1)
    assert bool((block_error <= block_absmax * quant.relative_error_bound("int4", dtype)).all())
    assert float((y.float() - x.float()).abs().max()) <= quant.max_abs_error_bound(x, "int4")
    if x.dim() == 2:   # one row, a few (each read as a view of its group), every row (one gather, past FEW_ROWS)
        for rows in ([shape[0] - 1], [shape[0] - 1, 0, shape[0] // 2, 0], list(range(shape[0]))[::-1] * 2):
            assert torch.equal(quant.dequantize_rows(q, torch.tensor(rows)), y[rows])


def test_the_bound_is_reached_and_zeros_stay_exact():
    """A block holding both +-its largest magnitude meets the bound: the side of 7 steps is a step short."""
    x = randn(256, 256)
    x[3] = 0
    y = quant.dequantize(*quant.held_by(quant.quantize(x, "int4")), quant.quantize(x, "int4").meta)
    worst = (per_row_blocks(y - x).abs().amax(dim=1) / per_row_blocks(x).abs().amax(dim=1).clamp(min=1e-30)).max()
    assert float(worst) > 0.95 * quant.relative_error_bound("int4", torch.float32)
    assert bool((y[3] == 0).all())
    assert 0.125 < quant.relative_error_bound("int4", torch.float32) < 0.13


def test_codes_lie_where_the_layout_says():
    """Blocks whose largest magnitude is -8 have the scale 1: each value is its own code - 8, found at the byte and
    nibble quant_int4's docstring gives (rows in groups of 16, the last group of 3 narrower)."""
    rows, columns = 19, 64
    values = torch.randint(-8, 8, (rows, columns), generator=torch.Generator().manual_seed(0)).float()
    values[:, ::32] = -8
    q = quant.quantize(values, "int4")
    assert torch.equal(q.absmax.float(), torch.ones(rows * 2))
    data = q.data.int()
    for n in range(rows):
        group, lane, width = n // 16, n % 16, 16 if n < 16 else 3
        for k in range(columns):
            block, chunk, high, byte = k // 32, k % 32 // 8, k % 8 // 4, k % 4
            at = group * 16 * columns // 2 + block * 16 * width + chunk * 4 * width + lane * 4 + byte
            assert (data[at] >> (4 * high)) & 15 == values[n, k] + 8, (n, k)


def test_the_blocksize_and_the_method_are_checked():
    with pytest.raises(InvalidOption, match="blocksize of int4 is 32"):
        quant.quantize(randn(4, 64), "int4", 64)
    with pytest.raises(InvalidOption, match="NaN or infinite"):
        quant.quantize(torch.tensor([[1.0, float("inf")]]), "int4")
    with pytest.raises(InvalidOption, match="--compression must be one of none, 4bit, 8bit, int4, not 'int3'"):
        compression("int3")
    assert compression("INT4") == "int4"


@needs_kernel
# (1043, 64): enough groups of 16 columns that a decode step's share of them on a thread is read as several
# streams side by side (int4_linear.cpp's `product`), and 3 columns past the last group
@pytest.mark.parametrize("out_features,in_features", [(40, 96), (67, 32), (13, 256), (1, 50), (129, 2048), (1043, 64)])
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 64, 512])
def test_the_kernel_does_its_exact_math_and_a_row_keeps_its_bits_in_any_batch(out_features, in_features, rows):
    weight = quant.quantize(randn(out_features, in_features), "int4")
    assert quant_linear.packable(weight.meta)
    dense = quant.dequantize(weight.data, weight.absmax, weight.meta).view(out_features, in_features)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(out_features)
    got = quant_linear.linear(x, weight, bias)
    assert got.shape == (rows, out_features)
    rounded = activations_rounded(x)
    magnitude = F.linear(rounded.abs(), dense.abs())
    assert bool(((got - F.linear(rounded, dense, bias)).abs() <= 1e-6 * magnitude + 1e-6).all())
    # against the float product: x's int8 rounding moves each product by at most half a step of each block
    steps = F.linear(x.abs().view(rows, -1).amax(1, keepdim=True).expand(-1, in_features) / 254, dense.abs())
    assert bool(((got - F.linear(x, dense, bias)).abs() <= steps + 1e-5).all())
    if rows <= 64:
        assert torch.equal(got, torch.cat([quant_linear.linear(x[i:i + 1], weight, bias) for i in range(rows)]))
    assert torch.equal(got, quant_linear.linear(torch.cat([torch.randn(5, in_features), x]), weight, bias)[5:])


@needs_kernel
# (768, 64): enough groups that a thread's share of them is read as several streams side by side (`share`)
@pytest.mark.parametrize("out_features,in_features", [(16, 2048), (112, 50), (48, 96), (768, 64)])
@pytest.mark.parametrize("shared", [True, False], ids=["one-row", "a-row-each"])
def test_rows_gives_each_product_the_bits_of_linear(out_features, in_features, shared):
    """Several one-row products in one call (an MoE block's routed experts), whether they share x's one row or
    each has its own: each the bits `linear` gives it alone. Outputs in whole groups of 16 only."""
    weights = [quant.quantize(randn(out_features, in_features, seed=i), "int4") for i in range(5)]
    x = torch.randn(1 if shared else 5, in_features)
    want = torch.cat([int4_linear.linear(x[0 if shared else i].view(1, -1), w, None) for i, w in enumerate(weights)])
    assert int4_linear.rows_fit(weights) and torch.equal(int4_linear.rows(x, weights), want)
    assert not int4_linear.rows_fit([*weights, quant.quantize(randn(out_features + 16, in_features), "int4")])
    assert not int4_linear.rows_fit([quant.quantize(randn(40, in_features), "int4")])
    with pytest.raises(ValueError, match="one row of x, or one for each of the 5 weights, not 2"):
        int4_linear.rows(torch.randn(2, in_features), weights)


@needs_kernel
def test_half_precision_activations_and_weights_and_leading_shapes():
    weight = quant.quantize(randn(24, 64, dtype=torch.bfloat16), "int4")
    dense = exact_weights(weight)
    x = torch.randn(2, 5, 128)[..., ::2]   # strided rows, a leading shape
    for dtype in DTYPES:
        got = quant_linear.linear(x.to(dtype), weight, None)
        assert got.shape == (2, 5, 24) and got.dtype == dtype
        want = F.linear(activations_rounded(x.to(dtype).reshape(10, 64).float()), dense).view(2, 5, 24)
        assert (got.float() - want).abs().max().item() <= (1e-5 if dtype == torch.float32 else 2e-2)


@needs_kernel
def test_non_finite_activations_give_non_finite_rows_only():
    weight = quant.quantize(randn(20, 64), "int4")
    x = torch.randn(3, 64)
    x[1, 40] = float("nan")
    got = quant_linear.linear(x, weight, None)
    assert bool(got[1].isnan().all()) and bool(got[[0, 2]].isfinite().all())
    assert torch.equal(got[[0, 2]], quant_linear.linear(x[[0, 2]], weight, None))


BUILD_CHECK = """
import sys, torch
from shardstream import quant
from shardstream.stream import int4_linear
print(int4_linear.build(), int4_linear.available())
torch.manual_seed(0)
got = []
for out_features, in_features in [(40, 96), (67, 32), (35, 50), (1043, 64)]:
    weight = quant.quantize(torch.randn(out_features, in_features) * 0.05, "int4")
    for rows in (1, 2, 3, 5, 64):
        got.append(int4_linear.linear(torch.randn(rows, in_features), weight, None))
torch.save(got, sys.argv[1])
"""


@needs_kernel
@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512", reason="no AVX-512 here to compare with")
def test_the_avx2_build_gives_the_same_bits(tmp_path):
    """Where torch reports AVX2 (forced with ATEN_CPU_CAPABILITY on an AVX-512 machine), the 8-lane build (vpmaddubsw
    without AVX-VNNI) gives the same bits as the AVX-512 VNNI one: the integer sums are exact either way."""
    results = {}
    for capability in ("avx2", "avx512"):
        env = {**os.environ, "ATEN_CPU_CAPABILITY": capability, "XDG_CACHE_HOME": str(tmp_path)}
        out = tmp_path / f"{capability}.pt"
        run = subprocess.run([sys.executable, "-c", BUILD_CHECK, str(out)], capture_output=True, text=True,
                             timeout=300, env=env)
        assert run.returncode == 0, run.stderr[-2000:]
        results[run.stdout.split()[0]] = torch.load(out)
        assert run.stdout.split()[1] == "True"
    wanted = {"AVX2", "AVX512-VNNI"} if not torch.cpu.get_capabilities().get("avx_vnni") else {"AVX2-VNNI", "AVX512-VNNI"}
    assert set(results) == wanted
    first, second = results.values()
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


@pytest.mark.skipif(native.find_compiler() is None, reason="no C++ compiler")
def test_every_build_compiles(tmp_path, monkeypatch):
    """The builds this CPU cannot run (AVX-VNNI on a CPU without it) at least compile and load."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    log = int4_linear.log
    for name, flags in int4_linear.BUILD_FLAGS.items():
        assert native.build(int4_linear.SOURCE, ["-O3", *flags, "-fopenmp"], ["c10", "torch_cpu"], log, name, "") is not None, name


def test_on_a_gpu_it_is_dequantized_and_the_triton_kernel_refuses_it():
    weight = quant.quantize(randn(16, 64), "int4")
    assert not quant_linear.packable(weight.meta, torch.device("cuda"))
    with pytest.raises(ValueError, match="reads 4bit, 8bit codes, not int4"):
        quant_triton.linear(torch.randn(1, 64), weight, None)


def test_switched_off_it_dequantizes(monkeypatch):
    weight = quant.quantize(randn(16, 64), "int4")
    x = torch.randn(3, 64)
    dense = quant.dequantize(weight.data, weight.absmax, weight.meta)
    monkeypatch.setenv(INT4_KERNEL.name, "0")
    int4_linear._library.cache_clear()
    try:
        assert not quant_linear.packable(weight.meta)
        assert torch.equal(int4_linear.linear(x, weight, None), F.linear(x, dense))
    finally:
        int4_linear._library.cache_clear()


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def converted(tmp_path_factory, request):
    folder = tmp_path_factory.mktemp(request.param)
    original = save_checkpoint(request.param, folder / "ckpt")
    convert(folder / "ckpt", folder / "store", compression="int4", progress=False)
    return original, folder / "store", _dequantized_reference(folder / "store", folder / "dequantized")


IDS = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(1))


@needs_kernel
def test_a_converted_model_streams_from_its_codes_near_its_dequantized_weights(converted, monkeypatch):
    """Llama (head apart) and Qwen2 (head tied to the embedding): every Linear and the embedding stay as codes,
    streamed and resident; the logits are transformers' on the dequantized weights but for x's int8 rounding."""
    original, store, reference = converted
    assert open_store(store).manifest.compression == "int4"
    with AutoModel.from_pretrained(store, max_resident_memory=0) as model, torch.no_grad():
        dequantized = linear_dequantizations(monkeypatch)
        got = model(IDS).logits
        assert dequantized == []
        assert model.model.get_input_embeddings().packed is not None
        tokens = model.generate(IDS, max_new_tokens=6, do_sample=False, pad_token_id=0)
    with AutoModel.from_pretrained(store, max_resident_memory=None) as model, torch.no_grad():
        assert model.resident_blocks == list(range(model.store.num_layers))
        assert torch.equal(model(IDS).logits, got)
        assert dequantized == []
    with torch.no_grad():
        want = reference(IDS).logits
        assert (got - want).abs().max().item() <= 0.02 * want.abs().max().item()
        assert (got - original(IDS).logits).abs().max().item() > 1e-4   # quantization did change the weights
    assert tokens.shape == (2, 15)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_an_int4_store_is_dequantized_there_to_its_weights(converted):
    """Its codes cross the bus and are dequantized on the GPU (no kernel there): transformers' logits on the
    dequantized weights, x unrounded."""
    _, store, reference = converted
    with StreamingModel(open_store(store), device="cuda", max_resident_memory=0) as model, torch.no_grad():
        got = model(IDS.cuda()).logits.cpu()
        assert (got - reference(IDS).logits).abs().max().item() <= 1e-4


def test_a_tensor_parallel_share_of_an_int4_weight_is_read_whole_and_dequantized(converted):
    _, store_path, _ = converted
    store = open_store(store_path)
    name = next(n for n, r in store.manifest.tensors.items() if r.quant and n.endswith("down_proj.weight"))
    record = store.manifest.tensors[name]
    rows = record.quant["shape"][0]
    buffer, stored = ShareReader(store).read(record, Take(0, ((0, rows // 2),)))
    assert "quant" not in stored and stored["shape"] == [rows // 2, record.quant["shape"][1]]
    whole = store.load(record.part)[name]
    share = torch.frombuffer(buffer, dtype=whole.dtype).view(stored["shape"])
    assert torch.equal(share, whole[: rows // 2])
