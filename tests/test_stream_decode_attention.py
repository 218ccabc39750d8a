"""The decode step's attention kernel: SDPA's outputs within float32 rounding for every head layout, cache view
and length; every call it does not take handed to transformers' SDPA unchanged; the same bits on one thread
or two; the engine's models running it in place of SDPA's call (counted by torch's profiler), and not where
the switch is off."""

from __future__ import annotations

import copy
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from avx2_build import needs_avx2, run_as_avx2
from shardstream.convert import convert
from shardstream.stream import decode_attention
from shardstream.stream.decode_attention import NAME, attention, takes, use_decode_attention
from tiny_models import save_checkpoint, tiny_model

pytestmark = pytest.mark.skipif(decode_attention._library() is None, reason="the kernel needs a C++ compiler")


class Module:   # what transformers' SDPA function reads from an attention module
    layer_idx, is_causal = 0, True

    def __init__(self, groups: int):
        self.num_key_value_groups = groups


def _inputs(batch: int, heads: int, kv_heads: int, length: int, dim: int, seed: int = 0, sharp: float = 1.0):
    """A decode step's query [B, heads, 1, D] as transformers makes it (a transposed view), and keys and values
    as views of a cache reserved wider than `length`."""
    generator = torch.Generator().manual_seed(seed)
    query = (torch.randn(batch, 1, heads, dim, generator=generator) * sharp).transpose(1, 2)
    keys = torch.randn(batch, kv_heads, length + 17, dim, generator=generator)[:, :, :length]
    values = torch.randn(batch, kv_heads, length + 17, dim, generator=generator)[:, :, :length]
    return query, keys, values


@pytest.mark.parametrize("batch,heads,kv_heads", [(1, 32, 8), (3, 12, 12), (2, 16, 2)])
@pytest.mark.parametrize("length", [1, 7, 64, 513])
@pytest.mark.parametrize("dim", [64, 80, 128])
def test_the_kernel_gives_sdpas_outputs(batch, heads, kv_heads, length, dim):
    query, keys, values = _inputs(batch, heads, kv_heads, length, dim)
    assert takes(query, keys, values, None, 0.0, {})
    got, weights = attention(Module(heads // kv_heads), query, keys, values, None, scaling=dim ** -0.5)
    expected, _ = sdpa_attention_forward(Module(heads // kv_heads), query, keys, values, None, scaling=dim ** -0.5)
    assert weights is None and got.shape == expected.shape and got.is_contiguous()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_peaked_scores_and_the_default_scale():
    # scores of several hundred: a softmax that overflows unless the largest is taken off first
    query, keys, values = _inputs(1, 8, 2, 300, 64, seed=1, sharp=40.0)
    got, _ = attention(Module(4), query, keys, values, None)
    expected, _ = sdpa_attention_forward(Module(4), query, keys, values, None)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_one_thread_or_two_give_the_same_bits():
    query, keys, values = _inputs(2, 32, 8, 200, 64, seed=2)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = [attention(Module(4), query, keys, values, None)[0] for _ in range(5)]
        torch.set_num_threads(1)
        one = attention(Module(4), query, keys, values, None)[0]
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(out, one) for out in two)


def _refused():
    query, keys, values = _inputs(1, 8, 2, 20, 64, seed=3)
    mask = torch.ones(1, 1, 1, 20, dtype=torch.bool)
    rows = torch.randn(1, 2, 8, 64, generator=torch.Generator().manual_seed(4)).transpose(1, 2)   # two query rows
    yield "a mask", (query, keys, values, mask), {}
    yield "two query rows", (rows, keys, values, None), {}
    yield "bfloat16", (query.bfloat16(), keys.bfloat16(), values.bfloat16(), None), {}
    yield "a gradient to record", (query.clone().requires_grad_(), keys, values, None), {}
    yield "dropout", (query, keys, values, None), {"dropout": 0.5}
    yield "a position bias", (query, keys, values, None), {"position_bias": torch.zeros(1, 8, 1, 20)}
    yield "keys not contiguous in the head", (query, keys.transpose(2, 3).contiguous().transpose(2, 3), values, None), {}


@pytest.mark.parametrize("case", list(_refused()), ids=lambda case: case[0])
def test_calls_the_kernel_does_not_take_go_to_sdpa_unchanged(case):
    _, (query, keys, values, mask), options = case
    torch.manual_seed(0)   # the same dropout in both
    got, _ = attention(Module(4), query, keys, values, mask, **options)
    torch.manual_seed(0)
    expected, _ = sdpa_attention_forward(Module(4), query, keys, values, mask, **options)
    assert torch.equal(got, expected)


def test_only_models_running_sdpa_through_the_interface_run_under_the_engines_name(caplog):
    sdpa, eager, own = tiny_model("llama"), tiny_model("llama", attn_implementation="eager"), tiny_model("falcon")
    with caplog.at_level(logging.WARNING):
        for model in (sdpa, eager, own):
            use_decode_attention(model)
    assert [model.config._attn_implementation for model in (sdpa, eager, own)] == [NAME, "eager", "sdpa"]
    assert not caplog.records   # falcon calls SDPA itself: transformers would warn that it cannot be switched


@pytest.mark.parametrize("family,overrides", [("llama", {}), ("qwen2", {}), ("qwen3", {}), ("mistral", {}),
                                               ("gpt2", {}), ("mixtral", {}), ("mistral", {"sliding_window": 4})],
                         ids=["llama", "qwen2", "qwen3", "mistral", "gpt2", "mixtral", "mistral-window-4"])
def test_a_models_decode_steps_give_transformers_logits(family, overrides):
    # a sliding window of 4 keys, shorter than the cache: transformers then masks, and the call goes to SDPA
    reference = tiny_model(family, **overrides)
    model = copy.deepcopy(reference)
    use_decode_attention(model)
    ids = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ours, theirs = model(ids, use_cache=True), reference(ids, use_cache=True)
        for _ in range(4):
            step = theirs.logits[:, -1:].argmax(-1)
            ours = model(step, past_key_values=ours.past_key_values, use_cache=True)
            theirs = reference(step, past_key_values=theirs.past_key_values, use_cache=True)
            torch.testing.assert_close(ours.logits, theirs.logits, rtol=0, atol=1e-5)


AVX2_CHECK = textwrap.dedent("""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from shardstream.stream import decode_attention
    assert torch.backends.cpu.get_cpu_capability() == "AVX2" and decode_attention._library() is not None

    class Module:
        layer_idx, is_causal, num_key_value_groups = 0, True, 4

    for length, dim in ((1, 64), (70, 64), (300, 128), (33, 80)):
        query = torch.randn(2, 1, 32, dim).transpose(1, 2)
        keys, values = (torch.randn(2, 8, length + 5, dim)[:, :, :length] for _ in range(2))
        got, _ = decode_attention.attention(Module(), query, keys, values, None)
        expected, _ = sdpa_attention_forward(Module(), query, keys, values, None)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    print("ok")
""")


@needs_avx2
def test_the_avx2_build_gives_sdpas_outputs(tmp_path):
    """Where torch reports AVX2 (forced here with ATEN_CPU_CAPABILITY on an AVX-512 machine), the kernel is built
    for AVX2's vectors, with the same outputs."""
    assert run_as_avx2(AVX2_CHECK, tmp_path) == "ok"


STEP = textwrap.dedent("""
    import sys, torch
    from torch.profiler import profile, ProfilerActivity
    from shardstream import AutoModel
    with AutoModel.from_pretrained(sys.argv[1], compute_dtype=torch.float32, progress=False) as model:
        out = model(torch.tensor([[5, 6, 7]]), use_cache=True)
        with profile(activities=[ProfilerActivity.CPU]) as profiled:
            model(torch.tensor([[8]]), past_key_values=out.past_key_values, use_cache=True)
    print(model.config._attn_implementation, sum(event.count for event in profiled.key_averages()
                                                 if event.key == "aten::scaled_dot_product_attention"))
""")


@pytest.mark.parametrize("switch", ["1", "0"])
def test_the_engines_decode_step_runs_the_kernel_unless_switched_off(tmp_path, switch):
    save_checkpoint("llama", tmp_path / "ckpt")   # 4 blocks
    convert(tmp_path / "ckpt", tmp_path / "store", progress=False)
    env = {**os.environ, "SHARDSTREAM_ATTENTION_KERNEL": switch}
    done = subprocess.run([sys.executable, "-c", STEP, str(tmp_path / "store")], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    name, sdpa_calls = done.stdout.split()
    assert name == NAME and int(sdpa_calls) == (0 if switch == "1" else 4)
