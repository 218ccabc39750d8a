"""Products from quantized codes (stream/quant_linear.py): the kernel against dequantize-then-`F.linear`,
4-bit and 8-bit, a row's bits the same in any batch, and a quantized store's Linears kept packed,
streamed and resident, never dequantized; where the kernel cannot run, weights are dequantized as
before and the log says why."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from shardstream import quant
from shardstream.convert import convert
from shardstream import AutoModel
from shardstream.stream import quant_linear
from shardstream.store import open_store
from shardstream import native
from shardstream.native import find_compiler
from shardstream.switches import QUANT_KERNEL
from counting import linear_dequantizations
from tiny_models import save_checkpoint
from avx2_build import needs_avx2, run_as_avx2

needs_kernel = pytest.mark.skipif(not quant_linear.available(), reason="no AVX-512 or AVX2, or no C++ compiler: the kernel is off here")


def _packed(out_features: int, in_features: int, blocksize: int, method: str = "4bit") -> quant.QuantizedTensor:
    torch.manual_seed(0)
    return quant.quantize(torch.randn(out_features, in_features) * 0.05, method, blocksize)


@needs_kernel
@pytest.mark.parametrize("method", ["4bit", "8bit"])
@pytest.mark.parametrize("out_features,in_features,blocksize", [(40, 96, 64), (67, 32, 16), (13, 256, 128), (21, 96, 48)])
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 8, 13, 31, 32, 33])
def test_the_kernel_matches_the_dequantized_product_and_a_row_keeps_its_bits_in_any_batch(
        out_features, in_features, blocksize, rows, method):
    weight = _packed(out_features, in_features, blocksize, method)
    assert quant_linear.packable(weight.meta)
    dense = quant.dequantize(weight.data, weight.absmax, weight.meta).view(out_features, in_features)
    bias = torch.randn(out_features)
    x = torch.randn(rows, in_features)
    got = quant_linear.linear(x, weight, bias)
    assert got.shape == (rows, out_features)
    assert (got - F.linear(x, dense, bias)).abs().max().item() <= 1e-5
    alone = torch.cat([quant_linear.linear(x[i:i + 1], weight, bias) for i in range(rows)])
    assert torch.equal(got, alone)   # one row decodes in registers; from quant_linear.BUFFER_ROWS on, through a buffer
    in_a_bigger_batch = quant_linear.linear(torch.cat([torch.randn(3, in_features), x]), weight, bias)[3:]
    assert torch.equal(got, in_a_bigger_batch)


@needs_kernel
@pytest.mark.parametrize("method", ["4bit", "8bit"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("out_features,in_features,blocksize", [(40, 96, 64), (24, 128, 64), (21, 96, 48)])
def test_a_half_precision_weight_multiplies_the_values_dequantization_writes(method, dtype, out_features, in_features,
                                                                             blocksize):
    """Each decoded value is rounded to the checkpoint's dtype, as dequantizing into it rounds (without, float32
    products differ by ~1e-3); an activation in that dtype gets the dtype's own product, within one rounding.
    Rows that start on a block (K a multiple of the block size) are read a block at a time, others a chunk."""
    torch.manual_seed(0)
    weight = quant.quantize((torch.randn(out_features, in_features) * 0.05).to(dtype), method, blocksize)
    assert quant_linear.packable(weight.meta)
    dense = quant.dequantize(weight.data, weight.absmax, weight.meta).view(out_features, in_features)
    assert dense.dtype == dtype
    for rows in (1, 8, 33):
        x = torch.randn(rows, in_features)
        assert (quant_linear.linear(x, weight, None) - F.linear(x, dense.float())).abs().max().item() <= 1e-5
        half = quant_linear.linear(x.to(dtype), weight, None)
        assert half.dtype == dtype
        assert torch.allclose(half.float(), F.linear(x.to(dtype), dense).float(), rtol=1e-2, atol=1e-3)


@needs_kernel
def test_the_kernel_takes_any_leading_shape_and_strided_rows():
    weight = _packed(24, 64, 64)
    dense = quant.dequantize(weight.data, weight.absmax, weight.meta).view(24, 64)
    x = torch.randn(2, 5, 128)[..., ::2]   # last dimension strided
    got = quant_linear.linear(x, weight, None)
    assert got.shape == (2, 5, 24)
    assert (got - F.linear(x, dense)).abs().max().item() <= 1e-5
    half = quant_linear.linear(x.to(torch.bfloat16), weight, None)   # multiplied in float32, rounded once
    assert half.dtype == torch.bfloat16
    assert (half.float() - F.linear(x.to(torch.bfloat16), dense.to(torch.bfloat16)).float()).abs().max().item() <= 1e-2


AVX2_CHECK = """
import torch, torch.nn.functional as F
from shardstream import quant
from shardstream.stream import quant_linear
assert torch.backends.cpu.get_cpu_capability() == "AVX2" and quant_linear.available()
torch.manual_seed(0)
for out_features, in_features, blocksize, method, dtype in [(40, 96, 64, "4bit", torch.float32), (67, 32, 16, "4bit", torch.float32),
                                                           (40, 96, 32, "8bit", torch.float32), (40, 96, 64, "4bit", torch.bfloat16),
                                                           (40, 96, 32, "8bit", torch.float16)]:
    weight = quant.quantize((torch.randn(out_features, in_features) * 0.05).to(dtype), method, blocksize)
    dense = quant.dequantize(weight.data, weight.absmax, weight.meta).view(out_features, in_features)
    for rows in (1, 2, 3, 4, 7, 32, 33):
        x = torch.randn(rows, in_features)
        got = quant_linear.linear(x, weight, None)
        assert (got - F.linear(x, dense.float())).abs().max().item() <= 1e-5, (out_features, rows)
        assert torch.equal(got, torch.cat([quant_linear.linear(x[i:i + 1], weight, None) for i in range(rows)]))
print("ok")
"""


@needs_avx2
def test_the_avx2_build_gives_the_same_products(tmp_path):
    """Where torch reports AVX2 (forced here with ATEN_CPU_CAPABILITY on an AVX-512 machine), the kernel is
    built for 8-lane vectors, with the same guarantees."""
    assert run_as_avx2(AVX2_CHECK, tmp_path) == "ok"


def test_what_the_kernel_cannot_take_is_not_packed():
    four_bit = _packed(16, 64, 64).meta
    assert not quant_linear.packable(None)
    assert quant_linear.packable(quant.quantize(torch.randn(16, 64), "8bit", 64).meta)
    assert quant_linear.packable({**four_bit, "dtype": "bfloat16"})
    assert not quant_linear.packable({**four_bit, "dtype": "float64"})
    assert not quant_linear.packable(quant.quantize(torch.randn(16, 40), "4bit", 64).meta)   # rows not whole 16-value chunks
    assert not quant_linear.packable(quant.quantize(torch.randn(1024), "4bit", 64).meta)


@pytest.fixture(scope="module", params=["4bit", "8bit"])
def store(tmp_path_factory, request):
    folder = tmp_path_factory.mktemp(request.param)
    save_checkpoint("llama", folder / "ckpt")
    convert(folder / "ckpt", folder / "store", compression=request.param, progress=False)
    return folder / "store"


@needs_kernel
@pytest.mark.parametrize("direct", ["on", "off"])
def test_a_quantized_store_keeps_its_linears_packed_streamed_and_resident(store, monkeypatch, direct):
    """Streamed or resident, every Linear of a 4-bit or 8-bit store stays packed, and the embedding is looked up
    in its codes: dequantized, an 8-bit weight would take four times its stored size in float32."""
    monkeypatch.setenv("SHARDSTREAM_DIRECT_IO", direct)
    ids = torch.randint(3, 128, (3, 9), generator=torch.Generator().manual_seed(1))
    with AutoModel.from_pretrained(store, max_resident_memory=0) as streamed, torch.no_grad():
        dequantized = linear_dequantizations(monkeypatch)
        want = streamed(ids).logits
        alone = torch.cat([streamed(ids[i:i + 1]).logits for i in range(len(ids))])
        assert dequantized == []
        blocks = streamed.store.num_layers
        assert len(streamed.packed_weights) == 7 * blocks + 2   # q, k, v, o, gate, up, down; head, embedding
    assert (want - alone).abs().max().item() <= 1e-5   # attention's kernels may round a batch differently
    with AutoModel.from_pretrained(store, max_resident_memory=None) as resident, torch.no_grad():
        assert resident.resident_blocks == list(range(blocks))
        got = resident(ids).logits
    assert dequantized == []   # the blocks' Linears, the head and the embedding stay packed
    assert torch.equal(got, want)


@needs_kernel
def test_resident_quantized_blocks_take_their_stored_size(store):
    manifest = open_store(store).manifest
    stored = sum(manifest.files[f].size for p, rec in manifest.parts.items() if p.startswith("mid/") for f in rec.files)
    with AutoModel.from_pretrained(store, max_resident_memory=int(stored * 1.2)) as model:
        assert model.resident_blocks == list(range(model.store.num_layers))   # dequantized they take 4-7x more


def test_switched_off_the_weights_are_dequantized_as_before(store, monkeypatch, caplog):
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(2))
    with AutoModel.from_pretrained(store, max_resident_memory=0) as model, torch.no_grad():
        packed = model(ids).logits
    monkeypatch.setenv(QUANT_KERNEL.name, "0")
    quant_linear._library.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger="shardstream.stream"):
            with AutoModel.from_pretrained(store, max_resident_memory=0) as model, torch.no_grad():
                dequantized = linear_dequantizations(monkeypatch)
                assert model.packed_weights == frozenset()
                plain = model(ids).logits
                assert dequantized
        assert f"quantized-weight kernel: off ({QUANT_KERNEL.name}=0)" in caplog.text
    finally:
        quant_linear._library.cache_clear()
    assert (packed - plain).abs().max().item() <= 1e-5


@pytest.mark.skipif(find_compiler() is None, reason="no C++ compiler")
def test_without_a_working_compiler_the_kernel_is_off_and_says_why(tmp_path):
    code = ("import logging; logging.basicConfig(level=logging.INFO, format='%(message)s')\n"
            "from shardstream.stream import quant_linear; print(quant_linear.available())")
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "CXX": str(tmp_path / "no-such-compiler")}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "False"
    if torch.backends.cpu.get_cpu_capability() in native.ISA_FLAGS:
        assert "quantized-weight kernel: off (building quant_linear.cpp failed" in run.stderr
        assert "dequantized on every pass" in run.stderr
