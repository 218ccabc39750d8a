"""The engine's gated MLP: which modules get it, the same bits as transformers' forward, autograd left
intact, row pieces through the engine's kernels where no hook counts the projections' calls (a streamed
block's), and what it holds at its peak: one intermediate tensor fewer in place, two pieces' worth in
pieces."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import AutoModelForCausalLM

from shardstream import AutoModel
from shardstream.convert import convert
from shardstream.stream import gated_mlp, half_linear
from shardstream.stream.gated_mlp import lean_forward, use_lean_mlps
from shardstream.stream.linear import FewRowsLinear
from tiny_models import swapped_forwards, tiny_config, tiny_model

GATED = {"llama": "LlamaMLP", "qwen2": "Qwen2MLP", "qwen3": "Qwen3MLP", "mistral": "MistralMLP",
         "gemma": "GemmaMLP", "qwen2_moe": "Qwen2MoeMLP"}   # qwen2_moe: its shared expert


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral", "gemma", "qwen2_moe", "qwen3_moe",
                                    "gpt2", "phi3", "mixtral"])
def test_gated_mlps_get_the_in_place_forward_and_give_the_same_bits(family):
    reference, model, lean = swapped_forwards(family, use_lean_mlps, lean_forward, GATED.get(family))
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


def _bf16_kernel_mlp() -> torch.nn.Module:
    """A Llama MLP whose projections multiply bf16 weights held as stored, in float32 (half_linear's kernel:
    a row's bits do not depend on the rows beside it)."""
    mlp = tiny_model("llama").model.layers[0].mlp
    for projection in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
        projection.__class__ = FewRowsLinear
        projection.packed = projection.weight.detach().to(torch.bfloat16)
    use_lean_mlps(mlp)
    return mlp


@pytest.mark.skipif(not half_linear.available(), reason="the half-precision kernel needs a C++ compiler")
def test_row_pieces_give_the_bits_of_one_pass_through_the_engine_kernels(monkeypatch):
    mlp = _bf16_kernel_mlp()
    x = torch.randn(2, 37, 32, generator=torch.Generator().manual_seed(2))
    calls = []
    mlp.down_proj.forward = lambda h, forward=mlp.down_proj.forward: calls.append(h.shape[:-1].numel()) or forward(h)
    with torch.no_grad():
        whole = mlp(x)
        assert calls == [74]
        monkeypatch.setattr(gated_mlp, "PIECE_BYTES", 64 * 4 * 16)   # 16 rows of the 64-wide intermediate
        pieces = mlp(x)
    assert calls[1:] == [16, 16, 16, 16, 10]
    assert torch.equal(pieces, whole)


@pytest.mark.skipif(not half_linear.available(), reason="the half-precision kernel needs a C++ compiler")
def test_projections_watched_by_hooks_run_once_a_pass(monkeypatch):
    monkeypatch.setattr(gated_mlp, "PIECE_BYTES", 64 * 4)   # one row a piece, were it pieced
    mlp = _bf16_kernel_mlp()
    calls = []
    mlp.up_proj.register_forward_hook(lambda module, args, out: calls.append(len(args[0])))
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        mlp(x)
    assert calls == [5]


@pytest.mark.skipif(not half_linear.available(), reason="the half-precision kernel needs a C++ compiler")
def test_a_streamed_and_a_resident_model_give_transformers_logits_with_pieces_on(tmp_path, monkeypatch):
    # A bf16 store computed in float32: the projections multiply the bf16 weights through the kernel. They
    # are 512 KiB (256 x 1024) as stored: a streamed block holds each MLP projection in a piece whose hooks
    # fill and empty it, so there the MLP runs whole (pieces would read it again); resident, in pieces of 3 rows.
    monkeypatch.setattr(gated_mlp, "PIECE_BYTES", 1024 * 4 * 3)
    monkeypatch.setattr("shardstream.stream.pieces.MIN_PIECE_BYTES", 256 << 10)
    torch.manual_seed(0)
    config = tiny_config("llama", hidden_size=256, intermediate_size=1024)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(tmp_path / "ckpt")
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.float32).eval()
    convert(tmp_path / "ckpt", tmp_path / "store", progress=False)
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = reference(ids).logits
        for resident in (0, None):   # every block streamed, every block in memory
            with AutoModel.from_pretrained(tmp_path / "store", max_resident_memory=resident, compute_dtype=torch.float32,
                                           progress=False) as model:
                mlp = model.model.model.layers[1].mlp
                assert type(mlp).forward is lean_forward and mlp.up_proj.packed is not None or resident == 0
                calls = []
                mlp.down_proj.forward = lambda h, forward=mlp.down_proj.forward: calls.append(h.shape[:-1].numel()) or forward(h)
                for _ in range(3):   # the first pass, and later ones (the reader then reads ahead in learned order)
                    torch.testing.assert_close(model(ids).logits, expected, rtol=0, atol=1e-4)
                assert calls == ([18] if resident == 0 else [3] * 6) * 3


PEAKS = textwrap.dedent("""
    import json, torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP
    from shardstream.serving.admission import map_large_allocations
    from shardstream.stream import gated_mlp
    from shardstream.stream.linear import FewRowsLinear
    map_large_allocations()   # every tensor of 1 MiB or more mapped alone: the peak RSS is what was live
    torch.manual_seed(0)
    mlp = LlamaMLP(LlamaConfig(hidden_size=64, intermediate_size=16384, hidden_act="silu"))
    for projection in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):   # bf16 weights through the kernel
        projection.__class__ = FewRowsLinear
        projection.packed = projection.weight.detach().to(torch.bfloat16)
    x = torch.randn(512, 64)   # intermediates of 512 x 16384 floats: 32 MiB each (pieces: 8 MiB)
    def rise():
        def peak():
            return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM")) << 10
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")   # the peak back to what is resident now
        before = peak()
        mlp(x)
        return peak() - before
    rises = {}
    with torch.no_grad():
        mlp(x[:1])
        rises["transformers"] = rise()
        gated_mlp.use_lean_mlps(mlp)
        rises["pieces"] = rise()
        gated_mlp.PIECE_BYTES = 1 << 40
        rises["in place"] = rise()
    print(json.dumps(rises))
""")


@pytest.mark.skipif(not half_linear.available(), reason="the half-precision kernel needs a C++ compiler")
def test_the_engine_mlp_holds_one_intermediate_fewer_in_place_and_two_pieces_in_pieces():
    run = subprocess.run([sys.executable, "-c", PEAKS], capture_output=True, text=True, check=True)
    rises = {kind: rise / (512 * 16384 * 4) for kind, rise in json.loads(run.stdout).items()}   # in intermediates
    assert rises["transformers"] >= 2.75, rises   # activation, up projection and their product
    assert rises["in place"] <= 2.5, rises        # activation (the product written into it), up projection
    assert rises["pieces"] <= 0.75, rises         # the same for a piece of a quarter of the rows
