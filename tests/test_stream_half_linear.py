"""Products from bfloat16/float16 weights as stored (stream/half_linear.py): the kernel and its fallback against
a float64 product of the same values, any width, any strides, a row's bits the same in any batch, both builds
(AVX-512 and AVX2), and never a float32 copy of the weight in memory."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

from shardstream.stream import half_linear
from shardstream.switches import HALF_KERNEL
from avx2_build import needs_avx2, run_as_avx2

needs_kernel = pytest.mark.skipif(not half_linear.available(), reason="no AVX-512 or AVX2, or no C++ compiler: the kernel is off here")
DTYPES = [torch.bfloat16, torch.float16]
# (out_features, in_features): whole 16-value chunks, and widths that end in a partial chunk of either build;
# one row reads each thread's weight rows as spans side by side, with rows left over where they do not divide
SHAPES = [(40, 96), (67, 33), (13, 256), (5, 7), (9, 2049), (3, 0), (11, 4111)]


def _weight(out_features: int, in_features: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return (torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed)) * 0.05).to(dtype)


def _reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ weight.double().t()
    return (out if bias is None else out + bias.double()).float()


@pytest.fixture
def switched_off(monkeypatch):
    """Switches the kernel off by its environment variable until the end of the test."""
    def switch_off():
        monkeypatch.setenv(HALF_KERNEL.name, "0")
        half_linear._library.cache_clear()
    yield switch_off
    half_linear._library.cache_clear()


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("out_features,in_features", SHAPES)
@pytest.mark.parametrize("rows", [1, 7, 64, 512])
def test_the_kernel_matches_the_float_product_and_a_row_keeps_its_bits_in_any_batch(out_features, in_features, rows,
                                                                                    dtype):
    weight = _weight(out_features, in_features, dtype)
    bias = torch.randn(out_features) if rows % 2 else None
    x = torch.randn(rows, in_features)
    got = half_linear.linear(x, weight, bias)
    assert got.dtype == torch.float32 and got.shape == (rows, out_features)
    torch.testing.assert_close(got, _reference(x, weight, bias), rtol=1e-5, atol=1e-5)
    alone = torch.cat([half_linear.linear(x[i:i + 1], weight, bias) for i in range(min(rows, 9))])
    assert torch.equal(got[:len(alone)], alone)   # 512 rows are several blocks of rows, a panel of columns at a time
    in_a_bigger_batch = half_linear.linear(torch.cat([torch.randn(20, in_features), x]), weight, bias)[20:]
    assert torch.equal(got, in_a_bigger_batch)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("out_features,in_features", [(67, 33), (5, 7), (40, 4111)])
@pytest.mark.parametrize("shared", [True, False], ids=["one-row", "a-row-each"])
def test_rows_gives_each_product_the_bits_of_linear(out_features, in_features, dtype, shared):
    """Several one-row products in one call (an MoE block's routed experts), their rows split over the threads
    together, whether they share x's one row or each has its own, one weight a view into a bigger buffer: each
    the bits `linear` gives it alone."""
    weights = [_weight(out_features, in_features, dtype, seed=i) for i in range(4)]
    weights.append(_weight(out_features, in_features + 9, dtype, seed=9)[:, 3:in_features + 3])
    x = torch.randn(1 if shared else 5, in_features)
    want = torch.cat([half_linear.linear(x[0 if shared else i].view(1, -1), w, None) for i, w in enumerate(weights)])
    assert half_linear.rows_fit(weights) and torch.equal(half_linear.rows(x, weights), want)
    assert not half_linear.rows_fit([*weights, _weight(out_features + 1, in_features, dtype)])
    assert not half_linear.rows_fit([*weights, weights[0].to(torch.float32)])
    with pytest.raises(ValueError, match="one row of x, or one for each of the 5 weights, not 2"):
        half_linear.rows(torch.randn(2, in_features), weights)


@pytest.mark.parametrize("kernel", [pytest.param("on", marks=needs_kernel), "off"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_any_leading_shape_strided_rows_and_a_weight_viewed_in_a_bigger_buffer(dtype, kernel, switched_off):
    if kernel == "off":
        switched_off()
        assert not half_linear.available()
    bigger = _weight(30, 100, dtype)
    weight = bigger[3:27, 5:69]   # rows 100 values apart
    x = torch.randn(2, 5, 128)[..., ::2]   # the last dimension strided
    got = half_linear.linear(x, weight, None)
    assert got.shape == (2, 5, 24)
    torch.testing.assert_close(got, _reference(x, weight, None), rtol=1e-5, atol=1e-5)
    row = torch.randn(9, 64)[4]   # one row sliced from a longer input
    torch.testing.assert_close(half_linear.linear(row, weight, None), _reference(row, weight, None), rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_fallback_gives_the_kernels_products(dtype, switched_off, caplog, monkeypatch):
    """Switched off, the weight is widened a tile of rows at a time (three tiles here) and F.linear multiplies it:
    the same values, summed in another order."""
    weight = _weight(70, 200, dtype)
    bias = torch.randn(70)
    xs = {rows: torch.randn(rows, 200) for rows in (1, 7, 64)}
    kernel = {rows: half_linear.linear(x, weight, bias) for rows, x in xs.items()}
    monkeypatch.setattr(half_linear, "TILE_BYTES", 25 * 200 * 4)
    with caplog.at_level(logging.INFO, logger="shardstream.stream"):
        switched_off()
        assert not half_linear.available()
    assert f"half-precision weight kernel: off ({HALF_KERNEL.name}=0)" in caplog.text
    for rows, x in xs.items():
        got = half_linear.linear(x, weight, bias)
        torch.testing.assert_close(got, _reference(x, weight, bias), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got, kernel[rows], rtol=1e-5, atol=1e-5)


def test_what_linear_takes():
    weight = _weight(8, 32, torch.bfloat16)
    assert half_linear.supports(weight, torch.float32)
    assert half_linear.supports(weight.half(), torch.float32)
    assert half_linear.supports(_weight(8, 64, torch.bfloat16)[:, 16:48], torch.float32)
    assert not half_linear.supports(weight, torch.bfloat16)   # activations in float32 only
    assert not half_linear.supports(weight.float(), torch.float32)
    assert not half_linear.supports(weight.t(), torch.float32)   # rows not contiguous
    assert not half_linear.supports(weight.view(2, 4, 32), torch.float32)
    with pytest.raises(ValueError, match="half_linear takes a float32 CPU x"):
        half_linear.linear(torch.randn(2, 32, dtype=torch.bfloat16), weight, None)


AVX2_CHECK = """
import torch
from shardstream.stream import half_linear
assert torch.backends.cpu.get_cpu_capability() == "AVX2" and half_linear.available()
for dtype in (torch.bfloat16, torch.float16):
    for out_features, in_features in [(40, 96), (67, 33), (5, 7), (9, 2049)]:
        weight = (torch.randn(out_features, in_features) * 0.05).to(dtype)
        for rows in (1, 2, 3, 4, 7, 64, 512):
            x = torch.randn(rows, in_features)
            got = half_linear.linear(x, weight, None)
            torch.testing.assert_close(got, (x.double() @ weight.double().t()).float(), rtol=1e-5, atol=1e-5)
            assert torch.equal(got[:5], torch.cat([half_linear.linear(x[i:i + 1], weight, None) for i in range(min(rows, 5))]))
print("ok")
"""


@needs_avx2
def test_the_avx2_build_gives_the_same_products(tmp_path):
    """Where torch reports AVX2 (forced here with ATEN_CPU_CAPABILITY on an AVX-512 machine), the kernel is
    built for 8-lane vectors, with the same guarantees."""
    assert run_as_avx2(AVX2_CHECK, tmp_path) == "ok"


PEAK_CHECK = """
import resource, sys, torch
from shardstream.stream import half_linear
assert half_linear.available() == (sys.argv[1] == "1")
weight = torch.full((128256, 2048), 0.01, dtype=torch.bfloat16)   # a Llama-3 head: 525 MB, 1 GB in float32
x = torch.randn(16, 2048)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
for rows in (1, 16):
    out = half_linear.linear(x[:rows], weight, None)
    assert out.shape == (rows, 128256)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


@pytest.mark.parametrize("kernel", [pytest.param("1", marks=needs_kernel), "0"])
def test_no_float32_copy_of_the_weight_is_made(kernel):
    """The peak memory of a process multiplying a 525 MB bfloat16 head grows by a few MB, not by its 1 GB float32 copy."""
    env = {**os.environ, HALF_KERNEL.name: kernel}
    run = subprocess.run([sys.executable, "-c", PEAK_CHECK, kernel], capture_output=True, text=True, timeout=300,
                         env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    assert int(run.stdout) < 64   # MiB


@needs_kernel
def test_the_log_says_the_kernel_runs(caplog):
    half_linear._library.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger="shardstream.stream"):
            assert half_linear.available()
    finally:
        half_linear._library.cache_clear()
    assert f"half-precision weight kernel: on ({torch.backends.cpu.get_cpu_capability()} build)" in caplog.text


WITHOUT_COMPILER = """
import logging, torch
logging.basicConfig(level=logging.INFO, format='%(message)s')
from shardstream.stream import half_linear
weight, x = torch.randn(5, 40).to(torch.bfloat16), torch.randn(3, 40)
torch.testing.assert_close(half_linear.linear(x, weight, None), x @ weight.float().t(), rtol=1e-5, atol=1e-5)
print(half_linear.available())
"""


def test_without_a_working_compiler_the_fallback_runs_and_the_log_says_why(tmp_path):
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "CXX": str(tmp_path / "no-such-compiler")}
    run = subprocess.run([sys.executable, "-c", WITHOUT_COMPILER], capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "False"
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        assert "half-precision weight kernel: off (building quant_linear.cpp failed" in run.stderr
        assert "converted to float32 a few MB at a time" in run.stderr
