"""Tensor parallelism in real processes: two gloo ranks on 127.0.0.1, started by torch.distributed.run.

Every model job runs in one launch (tp_worker.py), since starting the ranks is most of the time.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

from shardstream.convert import convert
from shardstream.shard import export_tp, load_index, place_experts
from shardstream.store import open_store
from tiny_models import COMMON, CONFIGS, char_tokenizer, save_checkpoint

SRC = Path(__file__).resolve().parents[1] / "src"
WORKER = Path(__file__).resolve().parent / "tp_worker.py"
FAMILIES = ["llama", "qwen2", "mistral", "qwen3", "gemma", "phi3"]
IDS = torch.tensor([[1, 5, 9, 20, 33, 40, 7]])


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _launch(*args: str) -> subprocess.CompletedProcess:
    """Two ranks on this machine, as a user starts them (torchrun is `python -m torch.distributed.run`)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
               "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)


# tiny models beside tests/tiny_models.py's: (model_type and config fields, experts saved fused as 3-D tensors)
VARIANTS = {
    # one KV head: fewer KV heads than ranks (replicated on both); its padding id is in rank 1's half of the vocabulary
    "llama-mqa": ({**CONFIGS["llama"], "num_key_value_heads": 1, "pad_token_id": 127}, False),
    # a shared expert (replicated) beside the routed ones, q/k/v biases
    "qwen2_moe": (dict(model_type="qwen2_moe", hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                       shared_expert_intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                       num_key_value_heads=2, num_experts=4, num_experts_per_tok=2), False),
    # experts stored as the model holds them (one [E, 2I, H] and one [E, H, I] tensor per block)
    "qwen3_moe-fused": (dict(model_type="qwen3_moe", hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                             num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                             num_experts=4, num_experts_per_tok=2), True),
    "mixtral-3-experts": ({**CONFIGS["mixtral"], "num_local_experts": 3}, False),
}
MOE = ["mixtral", "qwen2_moe", "qwen3_moe-fused", "mixtral-placed"]
# tensors every rank holds whole: norms, MoE routers, a shared expert
REPLICATED = re.compile(r"norm|\.gate\.weight|shared_expert")


def _checkpoint(folder: Path, name: str):
    """VARIANTS[name] with random weights, saved as transformers saves it (MoE experts one tensor per
    expert) or as the model's own state dict."""
    settings, fused = VARIANTS[name]
    settings = {**COMMON, **settings}
    model_type = settings.pop("model_type")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **settings)).eval()
    if fused:
        folder.mkdir(parents=True)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, folder / "model.safetensors")
        model.config.save_pretrained(folder)
    else:
        model.save_pretrained(folder, max_shard_size="40KB")
    return model


def _store(folder: Path, name: str) -> tuple[Path, torch.nn.Module]:
    checkpoint = folder / name / "ckpt"
    reference = _checkpoint(checkpoint, name) if name in VARIANTS else save_checkpoint(name, checkpoint)
    char_tokenizer().save_pretrained(checkpoint)
    convert(checkpoint, folder / name / "store", progress=False)
    return folder / name / "store", reference


def _split_bytes(store: Path, rank: int) -> int:
    """What a rank of 2 reads of a store read by offset: half of every split tensor (fused experts too),
    all of the replicated ones, and its own experts' tensors whole (experts 2 * rank and 2 * rank + 1 of 4)."""
    tensors = open_store(store).manifest.tensors
    replicated = sum(r.length for n, r in tensors.items() if r.expert is None and REPLICATED.search(n))
    split = sum(r.length for n, r in tensors.items() if r.expert is None and not REPLICATED.search(n))
    experts = sum(r.length for r in tensors.values() if r.expert is not None and r.expert // 2 == rank)
    return split // 2 + replicated + experts


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every store, its transformers reference, and the ranks' results: (stores, references, results)."""
    folder = tmp_path_factory.mktemp("tp")
    stores, references = {}, {}
    for name in [*FAMILIES, "llama-mqa", "mixtral", "qwen2_moe", "qwen3_moe-fused"]:
        stores[name], references[name] = _store(folder, name)
    # the same checkpoint converted again, with slices exported for 2 ranks
    convert(folder / "llama" / "ckpt", folder / "llama-sliced", progress=False)
    export_tp(open_store(folder / "llama-sliced"), 2)
    stores["llama-sliced"], references["llama-sliced"] = folder / "llama-sliced", references["llama"]
    export_tp(open_store(stores["phi3"]), 2)   # its fused slices are one block of rows: not a rank's heads
    # mixtral with its experts placed on two tiers (one outside the store), then slices exported for 2 ranks
    convert(folder / "mixtral" / "ckpt", folder / "mixtral-placed", progress=False)
    place_experts(open_store(folder / "mixtral-placed"), {"hot": ".", "cold": str(folder / "cold")},
                  placement={(0, 3): "cold", (1, 0): "cold"})
    export_tp(open_store(folder / "mixtral-placed"), 2)
    stores["mixtral-placed"], references["mixtral-placed"] = folder / "mixtral-placed", references["mixtral"]
    three_experts, _ = _store(folder, "mixtral-3-experts")
    jobs = [{"name": name, "stores": [str(store)] * 2} for name, store in stores.items()]
    jobs += [{"name": "llama-bfloat16", "stores": [str(stores["llama"])] * 2, "compute_dtype": "bfloat16"},
             {"name": "other-model", "stores": [str(stores["llama"]), str(stores["qwen2"])]},
             {"name": "other-slices", "stores": [str(stores["llama"]), str(stores["llama-sliced"])]},
             {"name": "mixtral-3-experts", "stores": [str(three_experts)] * 2}]
    out = folder / "out"
    out.mkdir()
    (folder / "jobs.json").write_text(json.dumps([{**job, "out": str(out)} for job in jobs]))
    done = _launch(str(WORKER), str(folder / "jobs.json"))
    assert done.returncode == 0, done.stderr[-3000:]
    results = {job["name"]: [json.loads((out / f"{job['name']}.{rank}.json").read_text()) for rank in (0, 1)]
               for job in jobs}
    for name in stores:
        results[name].append(torch.load(out / f"{name}.pt"))
    return stores, references, results


@pytest.mark.parametrize("name", [*FAMILIES, "llama-mqa", "llama-sliced", *MOE])
def test_two_ranks_compute_what_transformers_computes(runs, name):
    _, references, results = runs
    with torch.no_grad():
        logits = references[name](IDS).logits
        tokens = references[name].generate(IDS, max_new_tokens=8, do_sample=False)
    ranks = results[name][2]
    assert (ranks["logits"] - logits).abs().max().item() < 1e-4
    assert torch.equal(ranks["tokens"], tokens)


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral"])
def test_each_rank_reads_half_of_every_split_tensor_and_all_of_the_norms(runs, name):
    stores, _, results = runs
    manifest = open_store(stores[name]).manifest
    assert not manifest.sharding
    norms = sum(r.length for n, r in manifest.tensors.items() if "norm" in n)
    split = sum(r.length for n, r in manifest.tensors.items() if "norm" not in n)
    for rank in (0, 1):
        assert results[name][rank]["bytes_read"] == split // 2 + norms


def test_ranks_compute_in_the_compute_dtype_asked_for(runs):
    """`compute_dtype` means on the ranks what it means to one process (the fp32 store computed in bf16)."""
    _, _, results = runs
    assert [results["llama-bfloat16"][rank]["dtype"] for rank in (0, 1)] == ["torch.bfloat16"] * 2
    assert [results["llama"][rank]["dtype"] for rank in (0, 1)] == ["torch.float32"] * 2


def test_fewer_kv_heads_than_ranks_reads_the_kv_head_on_both(runs):
    stores, _, results = runs
    manifest = open_store(stores["llama-mqa"]).manifest
    replicated = sum(r.length for n, r in manifest.tensors.items() if "norm" in n or "k_proj" in n or "v_proj" in n)
    split = sum(r.length for r in manifest.tensors.values()) - replicated
    assert [results["llama-mqa"][rank]["bytes_read"] for rank in (0, 1)] == [split // 2 + replicated] * 2


def test_exported_slices_are_read_as_the_rank_files(runs):
    stores, _, results = runs
    index = load_index(open_store(stores["llama-sliced"]))
    for rank in (0, 1):
        files = {s.file for s in index.slices if s.rank == rank and s.count == 2}
        assert results["llama-sliced"][rank]["bytes_read"] == sum(index.files[f].size for f in files)


def test_fused_projections_are_read_by_heads_even_where_slices_were_exported(runs):
    stores, _, results = runs
    manifest = open_store(stores["phi3"]).manifest
    assert manifest.sharding
    norms = sum(r.length for n, r in manifest.tensors.items() if "norm" in n)
    split = sum(r.length for n, r in manifest.tensors.items() if "norm" not in n)
    assert [results["phi3"][rank]["bytes_read"] for rank in (0, 1)] == [split // 2 + norms] * 2


def test_sampling_draws_the_same_tokens_on_every_rank(runs):
    _, _, results = runs
    assert results["llama"][0]["sampled"] == results["llama"][1]["sampled"]


def test_a_rank_started_with_another_model_is_refused(runs):
    stores, _, results = runs
    for rank in (0, 1):
        message = results["other-model"][rank]["refused"]
        assert message.startswith(f"rank 1 opened {stores['qwen2']}, another model than rank 0's {stores['llama']}")
        assert "start every rank with a copy of the same store" in message


def test_a_rank_whose_store_has_other_slices_is_refused(runs):
    stores, _, results = runs
    for rank in (0, 1):
        message = results["other-slices"][rank]["refused"]
        assert message.startswith(f"{stores['llama-sliced']} holds TP slices for 2 ranks but {stores['llama']} does not")


def test_generate_command_prints_the_greedy_text_once(runs):
    stores, references, _ = runs
    tokenizer = char_tokenizer()
    ids = tokenizer("Hello", return_tensors="pt")
    expected = references["llama"].generate(**ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    text = tokenizer.decode(expected[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    done = _launch("-m", "shardstream", "generate", str(stores["llama"]), "--tensor-parallel",
                   "--prompt", "Hello", "--max-new-tokens", "8", "--no-progress")
    assert done.returncode == 0, done.stderr[-3000:]
    assert text.strip() and done.stdout.strip() == text.strip()


def test_tensor_parallel_outside_torchrun_is_one_sentence(runs):
    stores, _, _ = runs
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = str(SRC)
    done = subprocess.run([sys.executable, "-m", "shardstream", "generate", str(stores["llama"]), "--tensor-parallel",
                           "--prompt", "Hi"], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert "RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT is not set; start it with `torchrun" in " ".join(done.stderr.split())


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "qwen3_moe-fused"])
def test_each_rank_reads_only_its_half_of_the_experts(runs, name):
    stores, _, results = runs
    tensors = open_store(stores[name]).manifest.tensors
    for rank in (0, 1):
        assert results[name][rank]["bytes_read"] == _split_bytes(stores[name], rank)
    experts = [sum(r.length for r in tensors.values() if r.expert is not None and r.expert // 2 == rank) for rank in (0, 1)]
    assert experts[0] == experts[1] == sum(r.length for r in tensors.values() if r.expert is not None) // 2
    assert (experts[0] > 0) == (name != "qwen3_moe-fused")


def test_placed_experts_are_read_as_the_rank_s_expert_files_only(runs):
    """Experts on tiers (one outside the store) and the dense slices exported for 2 ranks: each rank reads
    its rank files and the files of its experts, whatever tier they are on."""
    stores, _, results = runs
    index = load_index(open_store(stores["mixtral-placed"]))
    assert {r.tier for r in index.experts.values()} == {"hot", "cold"}
    for rank in (0, 1):
        dense = {s.file for s in index.slices if s.rank == rank and s.count == 2}
        experts = {r.file for r in index.experts.values() if r.expert // 2 == rank}
        assert len(experts) == 2 * 3   # 2 experts of each of the 3 blocks
        assert results["mixtral-placed"][rank]["bytes_read"] == sum(index.files[f].size for f in dense | experts)


def test_a_rank_count_that_does_not_divide_the_experts_is_one_sentence(runs):
    _, _, results = runs
    for rank in (0, 1):
        assert results["mixtral-3-experts"][rank]["refused"] == (
            "config.json num_local_experts is 3: the experts cannot be split equally over 2 ranks; "
            "start a number of ranks that divides 3.")
