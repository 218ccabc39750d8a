"""The gated MLP that multiplies in place: which modules get it, the same bits as transformers' forward,
autograd left intact, and one intermediate tensor fewer at its peak."""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap

import pytest
import torch

from shardstream.stream.gated_mlp import lean_forward, use_lean_mlps
from tiny_models import tiny_model

GATED = {"llama": "LlamaMLP", "qwen2": "Qwen2MLP", "qwen3": "Qwen3MLP", "mistral": "MistralMLP",
         "gemma": "GemmaMLP", "qwen2_moe": "Qwen2MoeMLP"}   # qwen2_moe: its shared expert


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral", "gemma", "qwen2_moe", "qwen3_moe",
                                    "gpt2", "phi3", "mixtral"])
def test_gated_mlps_get_the_in_place_forward_and_give_the_same_bits(family):
    reference = tiny_model(family)
    model = copy.deepcopy(reference)
    use_lean_mlps(model)
    lean = [name for name, module in model.named_modules() if type(module).forward is lean_forward]
    expected = [name for name, module in reference.named_modules() if type(module).__name__ == GATED.get(family)]
    assert lean == expected
    assert bool(lean) == (family in GATED)   # gpt2's, phi3's fused and the MoE blocks' experts keep their own
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)


def test_with_autograd_recording_the_product_is_a_new_tensor_and_the_gradients_are_transformers():
    reference = tiny_model("llama").model.layers[0].mlp
    lean = copy.deepcopy(reference)
    use_lean_mlps(lean)
    x = torch.randn(3, 5, 32, generator=torch.Generator().manual_seed(1))
    lean_x, reference_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    lean(lean_x).square().sum().backward()
    reference(reference_x).square().sum().backward()
    assert torch.equal(lean_x.grad, reference_x.grad)
    for (name, got), (_, wanted) in zip(lean.named_parameters(), reference.named_parameters()):
        assert torch.equal(got.grad, wanted.grad), name


PEAK = textwrap.dedent("""
    import sys, torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP
    from shardstream.serving.admission import map_large_allocations
    from shardstream.stream.gated_mlp import use_lean_mlps
    map_large_allocations()   # every tensor of 1 MiB or more mapped alone: the peak RSS is what was live
    torch.manual_seed(0)
    mlp = LlamaMLP(LlamaConfig(hidden_size=64, intermediate_size=16384, hidden_act="silu"))
    if sys.argv[1] == "lean":
        use_lean_mlps(mlp)
    x = torch.randn(512, 64)   # intermediates of 512 x 16384 floats: 32 MiB each
    def peak():
        return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM")) << 10
    with torch.no_grad():
        mlp(x[:1])
        before = peak()
        mlp(x)
    print(peak() - before)
""")


def test_the_in_place_forward_holds_one_intermediate_fewer():
    def rise(kind: str) -> int:
        run = subprocess.run([sys.executable, "-c", PEAK, kind], capture_output=True, text=True, check=True)
        return int(run.stdout)
    intermediate = 512 * 16384 * 4
    transformers_rise, lean_rise = rise("transformers"), rise("lean")
    assert transformers_rise >= 2.75 * intermediate   # activation, up projection and their product
    assert lean_rise <= 2.5 * intermediate           # activation (the product written into it), up projection
