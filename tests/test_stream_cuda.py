"""The CUDA path against transformers' own model on the same GPU: blocks read on the CPU, copied
through pinned memory on a side stream, computed on the GPU.

Skipped where torch sees no GPU (CI); run on a machine with one (see CONTRIBUTING, "GPU checks").
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest_data import tiny_model as tiny_training_model  # noqa: F401  (fixture)
from conftest_data import write_txt

from shardstream.convert import convert
from shardstream.memory import gpu_free_bytes
from shardstream.quant import QuantizedTensor
from shardstream.shard import place_experts
from shardstream.store import open_store
from shardstream import AutoModel
from shardstream.stream import StreamingModel, quant_linear
from shardstream.serving.admission import room
from shardstream.serving.batching import BatchEngine
from shardstream.serving.protocol import NO_TOKEN, SamplingParams
from shardstream.stream.residency import AUTO_SHARE, auto_budget
from tiny_models import char_tokenizer, save_checkpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "gemma", "phi3", "mixtral", "qwen2_moe", "qwen3_moe", "gpt2",
            "gpt_neox", "falcon"]
TOLERANCE = 1e-5
EOS = 2


def _prompts(batch: int = 2, length: int = 9) -> torch.Tensor:
    return torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(1)).cuda()


def _make(tmp: Path, family: str, compression: str | None = None):
    reference = save_checkpoint(family, tmp / "ckpt")
    convert(tmp / "ckpt", tmp / "store", compression=compression, progress=False)
    return reference.cuda(), tmp / "store"


def _check_against(reference, model, ids: torch.Tensor) -> None:
    mask = torch.ones_like(ids)
    with torch.no_grad():
        expected = reference(ids, attention_mask=mask).logits
    got = model(ids, attention_mask=mask).logits
    assert got.device.type == "cuda"
    assert (got - expected).abs().max().item() <= TOLERANCE
    options = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, **options), reference.generate(ids, **options))


@pytest.mark.parametrize("family", FAMILIES)
def test_streamed_blocks_on_the_gpu_match_transformers_on_the_gpu(tmp_path, family):
    reference, store = _make(tmp_path, family)
    with AutoModel.from_pretrained(store, device="cuda", max_resident_memory=0, progress=False) as model:
        assert model.resident_blocks == []
        _check_against(reference, model, _prompts())


def test_decode_steps_on_the_gpu_run_without_cudnn_attention(tmp_path):
    """cuDNN plans its attention for each new key length: one plan per block per decode step, on the host."""
    _, store = _make(tmp_path, "llama")
    seen = []
    with AutoModel.from_pretrained(store, device="cuda", max_resident_memory=0, progress=False) as model:
        model.model.model.layers[0].register_forward_pre_hook(
            lambda *_: seen.append(torch.backends.cuda.cudnn_sdp_enabled()))
        model.generate(_prompts(), max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert seen and not any(seen)
    assert torch.backends.cuda.cudnn_sdp_enabled()


def _piece_keys(model) -> set[tuple[int, int]]:
    """(block, piece) of every streamed piece."""
    return {(block, i) for block, pieces in model.pieces.items() for i in range(len(pieces))}


def _kept_tensors(model) -> list:
    """The host tensors of the pieces kept in host RAM: the report counts them, only they say whether they are
    page-locked and packed."""
    return [t for piece in model._loader._kept.values() for t in piece.values()]


@pytest.mark.parametrize("options", [dict(prefetching=False), dict(prefetch_depth=3), dict(max_resident_memory=None),
                                     dict(piece_bytes=4096), dict(max_host_memory=0), dict(max_host_memory=None)])
def test_prefetch_residency_pieces_and_host_tier_give_the_same_logits_on_the_gpu(tmp_path, options):
    reference, store = _make(tmp_path, "llama")
    with AutoModel.from_pretrained(store, device="cuda", progress=False, **{"max_resident_memory": 0, **options}) as model:
        _check_against(reference, model, _prompts())
        report = model.report()
        if model.resident_blocks:
            assert model.resident_blocks == [0, 1, 2, 3] and report.read_buffers == 0
        elif options.get("max_host_memory", "auto") == 0:  # read every token into page-locked buffers, copied from there
            assert not report.host_kept and report.read_buffers
            assert all(torch.frombuffer(b, dtype=torch.uint8).is_pinned() for b in model._loader.pool._free)
        else:   # every streamed piece was read once and stays page-locked in host RAM, copied ahead by the computing thread
            assert report.host_kept == _piece_keys(model)
            assert all(t.is_pinned() for t in _kept_tensors(model))
            assert (report.read_ahead == "copy ahead") == options.get("prefetching", True)


def test_a_host_budget_keeps_the_first_pieces_and_reads_the_others(tmp_path):
    reference, store = _make(tmp_path, "llama")
    with AutoModel.from_pretrained(store, device="cuda", max_resident_memory=0, max_host_memory=None,
                                   progress=False) as model:
        model(_prompts())
        everything = model.report().host_kept_bytes
    with AutoModel.from_pretrained(store, device="cuda", max_resident_memory=0, max_host_memory=everything // 2,
                                   progress=False) as model:
        _check_against(reference, model, _prompts())
        report = model.report()
        assert 0 < len(report.host_kept) < len(_piece_keys(model)) and min(_piece_keys(model)) in report.host_kept
        assert report.host_kept_bytes <= everything // 2


@pytest.mark.parametrize("host", [0, "auto"])
def test_a_4bit_store_on_the_gpu_matches_its_dequantized_weights(tmp_path, host):
    _, store_path = _make(tmp_path, "llama", "4bit")
    store = open_store(store_path)
    with StreamingModel(store, max_resident_memory=0) as on_cpu, \
         StreamingModel(store, device="cuda", max_resident_memory=0, max_host_memory=host) as on_gpu:
        ids = _prompts()
        want = on_cpu(ids.cpu()).logits
        for _ in range(2):   # the second pass copies what the first one kept, when it kept
            assert (on_gpu(ids).logits.cpu() - want).abs().max().item() <= TOLERANCE
        report = on_gpu.report()
        assert bool(report.host_kept) == (host == "auto")
        # the codes cross the bus and stay in host RAM packed: no dequantization buffer on the host
        assert not any(on_gpu._loader._decoded.values())
        if host == "auto":
            quantized = sum(1 for r in store.manifest.tensors.values() if r.quant and r.part.startswith("mid/"))
            assert sum(isinstance(t, QuantizedTensor) for t in _kept_tensors(on_gpu)) == quantized > 0
            # the streamed blocks' parameters (on meta between passes) in the model's dtype
            streamed = sum(p.nbytes for k in on_gpu.pieces for p in on_gpu.block_modules[k].parameters())
            assert report.host_kept_bytes < streamed / 4


@pytest.mark.parametrize("host", [0, "auto"])
def test_a_4bit_store_on_the_gpu_multiplies_decode_steps_from_its_codes_with_the_triton_kernel(tmp_path, monkeypatch, host):
    """With triton, a streamed block's Linear weights cross the bus and stay on the GPU as codes and scales
    (kept page-locked on the host as such), a decode step's rows are multiplied from them by the kernel
    (stream/quant_triton.py) and a prefill's dequantized there; SHARDSTREAM_TRITON=0 is the runtime that
    dequantizes every weight: the same logits, within rounding."""
    pytest.importorskip("triton", reason="triton is not installed")
    _, store_path = _make(tmp_path, "llama", "4bit")
    store = open_store(store_path)
    prompt = _prompts()   # 2 x 9: a prefill of 18 rows, then decode steps of 2
    steps = torch.randint(3, 128, (3, 2, 1), generator=torch.Generator().manual_seed(2)).cuda()
    logits = {}
    for switch in ("0", "1"):
        monkeypatch.setenv("SHARDSTREAM_TRITON", switch)
        with StreamingModel(store, device="cuda", max_resident_memory=0, max_host_memory=host) as model:
            q_proj = next(m for name, m in model.model.named_modules() if name.endswith("layers.0.self_attn.q_proj"))
            seen = []
            q_proj.register_forward_pre_hook(lambda module, args: seen.append(module.packed))
            out = model(prompt, use_cache=True)
            logits[switch] = [out.logits]
            for token in steps:
                out = model(token, past_key_values=out.past_key_values, use_cache=True)
                logits[switch].append(out.logits)
            packed = model.packed_weights
        if switch == "0":
            assert not packed and seen == [None] * 4
        else:
            linears = {k for k, r in store.manifest.tensors.items() if r.quant and r.part.startswith("mid/") and "proj" in k}
            assert packed == linears and len(linears) == 7 * store.num_layers
            assert all(isinstance(t, QuantizedTensor) and t.data.is_cuda and t.absmax.is_cuda for t in seen)
            assert quant_linear.uses_triton(2, torch.float32, torch.device("cuda"))   # a decode step: the kernel
            assert not quant_linear.uses_triton(18, torch.float32, torch.device("cuda"))   # the prefill: dequantized
    for plain, from_codes in zip(logits["0"], logits["1"]):
        assert (plain - from_codes).abs().max().item() <= TOLERANCE


def test_experts_read_on_demand_from_two_tiers_on_the_gpu(tmp_path):
    reference, store = _make(tmp_path, "mixtral")
    place_experts(open_store(store), {"hot": ".", "cold": str(tmp_path / "cold")}, placement={(0, 1): "cold", (2, 2): "cold"})
    with AutoModel.from_pretrained(store, device="cuda", max_resident_memory=0, experts="on_demand",
                                   progress=False) as model:
        _check_against(reference, model, _prompts())
        assert model.experts.loads > 0


def test_auto_residency_and_batch_admission_count_the_gpu_memory_not_the_host_memory():
    device = torch.device("cuda")
    before, room_before = auto_budget(0, device), room(device)
    assert before == pytest.approx(gpu_free_bytes(device) * AUTO_SHARE, rel=0.01)
    held = torch.empty(2 << 30, dtype=torch.uint8, device=device)
    assert before - auto_budget(0, device) == pytest.approx((2 << 30) * AUTO_SHARE, rel=0.05)
    assert room_before - room(device) == pytest.approx(2 << 30, rel=0.05)
    del held


def test_a_batch_on_the_gpu_gives_each_request_its_tokens_alone(tmp_path):
    reference, store = _make(tmp_path, "qwen2")
    prompts = [torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 11, 3, 14)]
    with AutoModel.from_pretrained(store, device="cuda", max_resident_memory=0, progress=False) as model, \
         BatchEngine(model, eos_token_ids={EOS}, pad_token_id=0, max_batch_size=4, prefill_chunk_tokens=8) as engine:
        sequences = [engine.submit(p, SamplingParams(max_new_tokens=7)) for p in prompts]
        for prompt, sequence in zip(prompts, sequences):
            ids = torch.tensor([prompt], device="cuda")
            alone = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=7, do_sample=False,
                                       pad_token_id=0, eos_token_id=EOS)[0, len(prompt):].tolist()
            assert [e.token for e in sequence if e.token != NO_TOKEN] == alone


def test_speculative_decoding_on_the_gpu_gives_the_target_alone(tmp_path):
    reference, store = _make(tmp_path, "llama")
    save_checkpoint("llama", tmp_path / "draft", seed=1)
    ids = _prompts(batch=1, length=6)
    options = dict(max_new_tokens=24, do_sample=False, pad_token_id=0)
    with AutoModel.from_pretrained(store, device="cuda", max_resident_memory=0, progress=False) as target, \
         AutoModel.from_pretrained(tmp_path / "draft", layer_shards_saving_path=tmp_path / "draft-store", device="cuda",
                                   max_resident_memory=None, progress=False) as draft:
        expected = reference.generate(ids, **options)
        assert torch.equal(target.generate(ids, assistant_model=draft, **options), expected)
        assert target.forward_passes < 24 + 1


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "shardstream", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def test_generate_command_on_the_gpu_prints_the_cpu_text(tmp_path):
    save_checkpoint("llama", tmp_path / "ckpt")
    char_tokenizer().save_pretrained(tmp_path / "ckpt")
    convert(tmp_path / "ckpt", tmp_path / "store", progress=False)
    outputs = []
    for options in (["--device", "cpu"], ["--device", "cuda"], ["--device", "cuda", "--max-host-memory", "0"]):
        done = _cli("generate", str(tmp_path / "store"), "--prompt", "ROMEO:", "--max-new-tokens", "12",
                    "--max-resident-memory", "0", "--no-progress", *options, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        outputs.append(done.stdout)
    assert outputs[0].strip() and outputs == [outputs[0]] * 3


def test_training_on_cuda_ids_runs_on_the_gpu(tmp_path, tiny_training_model):
    from shardstream.data.config import TrainConfig
    from shardstream.data.launch import train

    source = write_txt(tmp_path / "corpus.txt", 200)
    cfg = TrainConfig(model=str(tiny_training_model), dataset=str(source), output=tmp_path / "out",
                      cache_dir=tmp_path / "cache", samples_per_block=64, chunk_size=8, batch_size=4, seq_len=16,
                      log_file=tmp_path / "metrics.jsonl", steps=10, cuda_ids=(0,))
    stats = train(cfg)
    assert (stats["steps_this_run"], stats["total_steps"]) == (10, 10)
    assert train(replace(cfg, model=str(cfg.output), output=tmp_path / "out2"))["total_steps"] == 20
