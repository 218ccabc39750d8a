"""Products from quantized codes on a GPU (stream/quant_triton.py): the Triton kernel, run on the CPU by Triton's
interpreter (TRITON_INTERPRET=1, in a process of its own: quant_triton_worker.py), against dequantize + F.linear
in float32, 4-bit and 8-bit, float32, bfloat16 and float16 weights and activations; and which products go to
it (`quant_linear.uses_triton`), and why it is off where it is. The kernel on a real GPU: test_stream_cuda.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import warm_python
import torch

from shardstream import quant
from shardstream.stream import quant_linear

SRC = str(Path(__file__).resolve().parents[1] / "src")
WORKER = Path(__file__).with_name("quant_triton_worker.py")
# (out_features, in_features, blocksize): odd or even columns; rows shorter than the kernel's step of 256
# weights (and straddling two blocks of scales), one 16-value chunk longer than it, and two steps whole
SHAPES = [(67, 96, 64), (13, 272, 16), (40, 512, 128)]
BIAS = [True, False, True]   # with SHAPES
TOLERANCE = 1e-5   # float32 sums in another order


def _cases() -> list[dict]:
    cases = []
    for dtype in ("float32", "bfloat16", "float16"):
        for x_dtype in sorted({"float32", dtype}):
            for rows in (1, 3, 16):
                for shape, bias in zip(SHAPES, BIAS):
                    cases.append(dict(method="4bit", dtype=dtype, x_dtype=x_dtype, rows=rows, shape=shape, bias=bias))
        for shape, bias in zip(SHAPES[:2], BIAS[1::-1]):
            cases.append(dict(method="8bit", dtype=dtype, x_dtype=dtype, rows=3, shape=shape, bias=bias))
    cases.append(dict(method="4bit", dtype="bfloat16", x_dtype="bfloat16", rows=16, shape=SHAPES[0], bias=True, alone=True))
    cases.append(dict(method="4bit", dtype="float32", x_dtype="float32", rows=6, shape=SHAPES[1], bias=False, lead=[2, 3]))
    return [{**case, "id": i} for i, case in enumerate(cases)]


CASES = _cases()


def _env(**changes: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]), **changes}


@pytest.fixture(scope="module")
def interpreted() -> dict:
    pytest.importorskip("triton", reason="triton is not installed (pyproject's `gpu` extra): its interpreter runs the kernel")
    run = subprocess.run([sys.executable, str(WORKER)], input=json.dumps(CASES), capture_output=True, text=True,
                         timeout=600, env=_env(TRITON_INTERPRET="1"))
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def _name(case: dict) -> str:
    out_features, in_features, _ = case["shape"]
    return (f"{case['method']}-{case['dtype']}-x_{case['x_dtype']}-{case['rows']}rows-{out_features}x{in_features}"
            f"{'-bias' if case['bias'] else ''}{'-alone' if case.get('alone') else ''}{'-strided' if case.get('lead') else ''}")


@pytest.mark.parametrize("case", CASES, ids=_name)
def test_the_kernel_gives_the_dequantized_product_rounded_once_to_the_activations_dtype(interpreted, case):
    """The weights multiplied are the values dequantization writes (each rounded to the stored dtype; without that
    rounding a bfloat16 weight's products differ by ~1e-3), in float32 with the activations upcast, the bias added
    in float32, and the result rounded once to x's dtype: each output is the float32 product's, within the
    rounding of float32 sums in another order (an output in bfloat16 or float16 may round the other way only
    where the float32 product lies that close to the midpoint of two of its values)."""
    result = interpreted[str(case["id"])]
    dtype = quant.DTYPES[case["x_dtype"]]
    assert result["dtype"] == case["x_dtype"]
    assert result["shape"] == [*case.get("lead", [case["rows"]]), case["shape"][0]]
    got, want = torch.tensor(result["got"], dtype=torch.float64), torch.tensor(result["want"], dtype=torch.float32)
    low, high = (want - TOLERANCE).to(dtype).double(), (want + TOLERANCE).to(dtype).double()
    outside = ((got < low) | (got > high)).sum().item()
    assert outside == 0, f"{outside} of {got.numel()} outputs off by up to {(got - want.double()).abs().max().item():.3g}"
    if case.get("alone"):
        assert result["alone"]   # a row's bits alone as in a batch: no size of the kernel depends on the rows


@pytest.mark.parametrize("bits,stored,activations", [(4, "fp32", "fp32"), (4, "bf16", "bf16"), (8, "fp16", "fp16")])
def test_the_kernel_compiles_for_the_gpus_it_runs_on(tmp_path, monkeypatch, bits, stored, activations):
    """Compiled ahead of time to a cubin for an H100/H200 (sm_90), with no GPU: the code generation that the
    interpreter skips (types, layouts, the integer rounding, ptxas), without spilling registers to memory."""
    pytest.importorskip("triton", reason="triton is not installed")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 is set: this process's kernels are the interpreter's")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from shardstream.stream import quant_triton

    constants = dict(K=2816, BITS=bits, BLOCKSIZE=64, ROUND=["fp32", "bf16", "fp16"].index(stored),
                     OUTPUT=["fp32", "bf16", "fp16"].index(activations), HAS_BIAS=True,
                     BLOCK_N=quant_triton.BLOCK_N, BLOCK_K=quant_triton.BLOCK_K)
    written = "i16" if activations == "bf16" else activations   # bfloat16 outputs are written as their bits
    signature = {"x_ptr": f"*{activations}", "codes_ptr": "*u8", "absmax_ptr": "*fp32", "table_ptr": "*fp32",
                 "bias_ptr": f"*{stored}", "out_ptr": f"*{written}", "N": "i32", "x_stride": "i32",
                 **{name: "constexpr" for name in constants}}
    kernel = triton.compile(ASTSource(quant_triton._product, signature, constants), target=GPUTarget("cuda", 90, 32))
    assert kernel.asm["cubin"] and ".local" not in kernel.asm["ptx"]


def test_a_gpu_product_of_a_decode_steps_rows_goes_to_the_kernel_and_a_prefills_to_dequantization():
    for dtype in quant_linear.TRITON_DTYPES:
        assert all(quant_linear.few_rows(rows, dtype) for rows in (1, 3, quant_linear.TRITON_ROWS))
        assert not any(quant_linear.few_rows(rows, dtype) for rows in (0, quant_linear.TRITON_ROWS + 1, 512))
    assert not quant_linear.few_rows(1, torch.float64)
    # on the CPU, the C++ kernel (quant_linear.cpp) multiplies; nothing there asks for triton
    assert not quant_linear.uses_triton(1, torch.float32, torch.device("cpu"))
    meta = quant.quantize(torch.randn(16, 64), "4bit", 64).meta
    assert not quant_linear.packable(meta, torch.device("meta"))
    assert quant_linear.packable(meta) == quant_linear.packable(meta, torch.device("cpu")) == quant_linear.available()


AVAILABILITY = """
import logging, os, sys, torch
logging.basicConfig(level=logging.INFO, format='%(message)s')
{setup}
from shardstream import quant
from shardstream import AutoModel
from shardstream.stream import quant_linear
print("lazy" if "shardstream.stream.quant_triton" not in sys.modules else "imported")
from shardstream.stream import quant_triton
meta, cuda = quant.quantize(torch.randn(16, 64), "4bit", 64).meta, torch.device("cuda")
for switch in ("0", "0", "1", "1"):
    os.environ["SHARDSTREAM_TRITON"] = switch
    print(quant_triton.available(cuda), quant_linear.packable(meta, cuda), quant_linear.uses_triton(1, torch.float32, cuda))
"""


def _availability(setup: str = "") -> tuple[list[str], str]:
    run = warm_python.run([sys.executable, "-c", AVAILABILITY.format(setup=setup)], capture_output=True, text=True,
                          timeout=300, env=_env())
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout.split("\n"), run.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the reasons it is off without a GPU")
def test_without_a_gpu_the_kernel_is_off_and_the_log_says_why_once():
    pytest.importorskip("triton", reason="triton is not installed: the next test covers that case")
    lines, log = _availability()
    assert lines[:5] == ["lazy", *["False False False"] * 4]   # the CPU runtime never imports the kernel
    assert log.count("quantized-weight kernel on the GPU: off (SHARDSTREAM_TRITON=0)") == 1
    assert log.count("quantized-weight kernel on the GPU: off (torch sees no CUDA GPU)") == 1


def test_without_triton_the_gpu_dequantizes_as_before_and_the_log_says_why_once():
    lines, log = _availability(setup="sys.modules['triton'] = None   # as where triton is not installed")
    assert lines[:5] == ["lazy", *["False False False"] * 4]
    assert log.count("quantized-weight kernel on the GPU: off (triton does not import") == 1
    assert "pip install shardstream[gpu]" in log
