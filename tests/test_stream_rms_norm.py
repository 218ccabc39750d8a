"""The engine's RMSNorm: which modules get it, transformers' values within float32 rounding from the kernel, and
transformers' own forward (the same bits) for every input the kernel does not take; the switch in a real process."""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from avx2_build import needs_avx2, run_as_avx2
from shardstream.stream import rms_norm
from shardstream.stream.rms_norm import lean_forward, use_lean_norms
from tiny_models import swapped_forwards

pytestmark = pytest.mark.skipif(rms_norm._library() is None, reason="the kernel needs a C++ compiler")

COPIES = {"llama": "LlamaRMSNorm", "qwen2": "Qwen2RMSNorm", "qwen3": "Qwen3RMSNorm", "mistral": "MistralRMSNorm",
          "mixtral": "MixtralRMSNorm", "qwen3_moe": "Qwen3MoeRMSNorm", "phi3": "Phi3RMSNorm"}


@pytest.mark.parametrize("family", [*COPIES, "gemma", "gpt2"])
def test_norms_running_llamas_code_get_the_kernel_and_transformers_values(family):
    reference, model, lean = swapped_forwards(family, use_lean_norms, lean_forward, COPIES.get(family))
    assert bool(lean) == (family in COPIES)   # gemma's adds 1 to its weight; gpt2 has LayerNorm
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("shape", [(1, 1, 2048), (3, 5, 2047), (2, 8, 1, 64), (7,)])
def test_the_kernel_gives_transformers_values(shape):
    norm = LlamaRMSNorm(shape[-1], eps=1e-6)
    generator = torch.Generator().manual_seed(1)
    norm.weight.data = torch.randn(shape[-1], generator=generator)
    x = torch.randn(*shape, generator=generator) * 3
    with torch.no_grad():
        got = lean_forward(norm, x)
        torch.testing.assert_close(got, LlamaRMSNorm.forward(norm, x), rtol=1e-6, atol=1e-6)
        rows = torch.randn(4, 10, generator=generator)[:, :7]   # rows 10 floats apart
        short = LlamaRMSNorm(7)
        torch.testing.assert_close(lean_forward(short, rows), LlamaRMSNorm.forward(short, rows), rtol=1e-6, atol=1e-6)
    assert got.shape == x.shape and got.dtype == torch.float32


def _refused():
    norm = LlamaRMSNorm(16)
    norm.weight.data = torch.randn(16, generator=torch.Generator().manual_seed(2))
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(3))
    yield "bfloat16 rows", norm, x.bfloat16()
    yield "a bfloat16 weight", copy.deepcopy(norm).bfloat16(), x
    yield "rows to differentiate", norm, x.clone().requires_grad_()
    yield "columns apart", norm, x.t().contiguous().t()


@pytest.mark.parametrize("case", list(_refused()), ids=lambda case: case[0])
def test_inputs_the_kernel_does_not_take_run_transformers_forward(case):
    _, norm, x = case
    assert torch.equal(lean_forward(norm, x), LlamaRMSNorm.forward(norm, x))


def test_gradients_flow_through_transformers_forward():
    norm = LlamaRMSNorm(16)
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(4), requires_grad=True)
    lean_forward(norm, x).sum().backward()
    assert x.grad is not None and norm.weight.grad is not None


SWITCHED = """
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from shardstream.stream import rms_norm
norm, x = LlamaRMSNorm(2048), torch.randn(1, 2048)
with torch.no_grad():
    print(rms_norm._library() is None, torch.equal(rms_norm.lean_forward(norm, x), LlamaRMSNorm.forward(norm, x)))
"""


def test_switched_off_every_call_runs_transformers_forward():
    env = {**os.environ, "SHARDSTREAM_NORM_KERNEL": "0"}
    done = subprocess.run([sys.executable, "-c", SWITCHED], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "True"]


AVX2_CHECK = """
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from shardstream.stream import rms_norm
assert torch.backends.cpu.get_cpu_capability() == "AVX2" and rms_norm._library() is not None
for size in (2048, 2047, 7):
    norm = LlamaRMSNorm(size)
    norm.weight.data = torch.randn(size)
    x = torch.randn(3, size)
    with torch.no_grad():
        torch.testing.assert_close(rms_norm.lean_forward(norm, x), LlamaRMSNorm.forward(norm, x), rtol=1e-6, atol=1e-6)
print("ok")
"""


@needs_avx2
def test_the_avx2_build_gives_transformers_values(tmp_path):
    """Where torch reports AVX2 (forced with ATEN_CPU_CAPABILITY on an AVX-512 machine), the same values."""
    assert run_as_avx2(AVX2_CHECK, tmp_path) == "ok"
