"""Tensor parallelism in real processes: two gloo ranks on 127.0.0.1, started by torch.distributed.run.

Every model job runs in one launch (tp_worker.py), since starting the ranks is most of the time.
"""

from __future__ import annotations

import json
import os
import shutil
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import warm_python
import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

from shardstream.convert import convert
from shardstream.errors import InvalidOption
from shardstream.shard import export_tp, load_index, place_experts
from shardstream.sizes import format_size
from shardstream.store import open_store
from shardstream.stream.meta import build_meta_model
from shardstream.stream import StreamingModel
from shardstream.tp.rankstore import RankLayout, exported_view, rank_folder, rank_layout
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
    # every rank share is whole 4-bit blocks of 64 (o_proj's 64 of 128 columns, down_proj's 128 of 256), so
    # that its ranks keep all of their block weights packed
    "llama-wide": ({**CONFIGS["llama"], "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2}, False),
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


def _store(folder: Path, name: str, compression: str | None = None) -> tuple[Path, torch.nn.Module]:
    checkpoint = folder / name / "ckpt"
    reference = _checkpoint(checkpoint, name) if name in VARIANTS else save_checkpoint(name, checkpoint)
    char_tokenizer().save_pretrained(checkpoint)
    convert(checkpoint, folder / name / "store", compression=compression, progress=False)
    return folder / name / "store", reference


def _block_bytes(store: Path) -> int:
    """The stored bytes of the store's blocks (codes and scales of quantized tensors)."""
    return sum(r.length + (r.quant["absmax"]["length"] if r.quant else 0)
               for r in open_store(store).manifest.tensors.values() if r.part.startswith("mid/"))


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
    phi3 = folder / "phi3-sliced"
    convert(folder / "phi3" / "ckpt", phi3, progress=False)
    export_tp(open_store(phi3), 2)   # each rank file holds the rank's heads and halves of the fused projections
    stores["phi3-sliced"], references["phi3-sliced"] = phi3, references["phi3"]
    for name, compression in (("llama-4bit", "4bit"), ("llama-8bit", "8bit")):
        convert(folder / "llama" / "ckpt", folder / name, compression=compression, progress=False)
        stores[name], references[name] = folder / name, None
    stores["llama-wide-4bit"], _ = _store(folder, "llama-wide", "4bit")
    references["llama-wide-4bit"] = None
    # mixtral with its experts placed on two tiers (one outside the store), then slices exported for 2 ranks
    convert(folder / "mixtral" / "ckpt", folder / "mixtral-placed", progress=False)
    place_experts(open_store(folder / "mixtral-placed"), {"hot": ".", "cold": str(folder / "cold")},
                  placement={(0, 3): "cold", (1, 0): "cold"})
    export_tp(open_store(folder / "mixtral-placed"), 2)
    stores["mixtral-placed"], references["mixtral-placed"] = folder / "mixtral-placed", references["mixtral"]
    three_experts, _ = _store(folder, "mixtral-3-experts")
    jobs = [{"name": name, "stores": [str(store)] * 2} for name, store in stores.items()]
    streaming = {"max_resident_memory": 0}
    jobs += [{"name": f"{name}-streamed", "stores": [str(stores[name])] * 2, "options": streaming}
             for name in ("llama", "phi3", "phi3-sliced", "llama-4bit", "llama-8bit", "llama-wide-4bit", "mixtral",
                          "qwen3_moe-fused", "mixtral-placed")]
    jobs += [{"name": "llama-bfloat16", "stores": [str(stores["llama"])] * 2, "compute_dtype": "bfloat16"},
             {"name": "llama-tp-cache", "stores": [str(stores["llama"])] * 2, "options": {"tp_cache": str(folder / "cache")}},
             {"name": "other-model", "stores": [str(stores["llama"]), str(stores["qwen2"])]},
             {"name": "other-slices", "stores": [str(stores["llama"]), str(stores["llama-sliced"])]},
             {"name": "mixtral-3-experts", "stores": [str(three_experts)] * 2},
             {"name": "mixtral-on-demand", "stores": [str(stores["mixtral-placed"])] * 2,
              "options": {"experts": "on_demand", "max_expert_memory": None}},   # an explicit budget: read on routing
             {"name": "mixtral-on-demand-unplaced", "stores": [str(stores["mixtral"])] * 2,
              "options": {"experts": "on_demand"}}]
    references["mixtral-on-demand"] = references["mixtral"]
    out = folder / "out"
    out.mkdir()
    (folder / "jobs.json").write_text(json.dumps([{**job, "out": str(out)} for job in jobs]))
    done = _launch(str(WORKER), str(folder / "jobs.json"))
    assert done.returncode == 0, done.stderr[-3000:]
    results = {job["name"]: [json.loads((out / f"{job['name']}.{rank}.json").read_text()) for rank in (0, 1)]
               for job in jobs}
    for job in jobs:
        if (out / f"{job['name']}.pt").exists():
            results[job["name"]].append(torch.load(out / f"{job['name']}.pt"))
    return stores, references, results


def _streamed(name: str) -> str:
    return name.removesuffix("-streamed")


@pytest.mark.parametrize("name", [*FAMILIES, "llama-mqa", "llama-sliced", "phi3-sliced", "llama-streamed",
                                  "phi3-streamed", "phi3-sliced-streamed", *MOE,
                                  "mixtral-streamed", "qwen3_moe-fused-streamed", "mixtral-placed-streamed",
                                  "mixtral-on-demand"])
def test_two_ranks_compute_what_transformers_computes(runs, name):
    _, references, results = runs
    with torch.no_grad():
        logits = references[_streamed(name)](IDS).logits
        tokens = references[_streamed(name)].generate(IDS, max_new_tokens=8, do_sample=False)
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
        assert results[name][rank]["share_bytes_read"] == split // 2 + norms


@pytest.mark.parametrize("name", ["llama-streamed", "phi3-streamed", "phi3-sliced-streamed", "llama-wide-4bit-streamed",
                                  "mixtral-streamed", "qwen3_moe-fused-streamed"])
def test_streaming_ranks_read_half_of_every_block_per_pass(runs, name):
    """max_resident_memory=0: no block stays in memory, and each rank reads its half of every block on every
    pass (its shares plus the replicated norms). The count starts and stops while the reader may have read
    ahead into the next pass (a block of a two-block model, either end), hence one block's share over the
    passes counted beside 5%."""
    stores, _, results = runs
    store = open_store(stores[_streamed(name)])
    blocks = _block_bytes(stores[_streamed(name)])
    largest = max(store.part_nbytes(p) for p in store.parts if p.startswith("mid/"))
    for rank in (0, 1):
        result = results[name][rank]
        assert result["resident_blocks"] == 0
        assert abs(result["per_pass"] - blocks / 2) <= 0.05 * blocks + largest / 2 / result["passes"]


def test_ranks_within_the_default_budget_keep_every_block(runs):
    _, _, results = runs
    assert [results["llama"][rank]["resident_blocks"] for rank in (0, 1)] == [4, 4]
    assert [results["llama"][rank]["per_pass"] for rank in (0, 1)] == [0, 0]


@pytest.mark.parametrize("name", ["llama-4bit", "llama-8bit", "llama-wide-4bit", "llama-4bit-streamed",
                                  "llama-8bit-streamed", "llama-wide-4bit-streamed"])
def test_quantized_ranks_compute_what_one_process_streaming_the_store_computes(runs, name):
    stores, _, results = runs
    with StreamingModel(open_store(stores[_streamed(name)])) as one:
        logits = one(IDS).logits
        tokens = one.generate(IDS, max_new_tokens=8, do_sample=False)
    ranks = results[name][2]
    assert (ranks["logits"] - logits).abs().max().item() < 1e-4
    assert torch.equal(ranks["tokens"], tokens)


def test_quantized_shares_on_block_boundaries_stay_packed(runs):
    """Every quantized block weight of the wide 4-bit store is still its codes in each rank's own store (half
    of them); the tiny llama's o_proj and down_proj columns (16 and 32 of blocks of 64) are dequantized."""
    stores, _, results = runs
    store = open_store(stores["llama-wide-4bit"]).manifest.tensors
    for rank in (0, 1):
        mine = open_store(results["llama-wide-4bit"][rank]["rank_store"]).manifest.tensors
        quantized = [n for n, r in store.items() if r.quant and r.part.startswith("mid/")]
        assert quantized and all(mine[n].quant and mine[n].length * 2 == store[n].length for n in quantized)
        tiny = open_store(results["llama-4bit"][rank]["rank_store"]).manifest.tensors
        assert tiny["model.layers.0.self_attn.q_proj.weight"].quant
        assert not tiny["model.layers.0.self_attn.o_proj.weight"].quant


def test_a_rank_writes_its_shares_once_into_its_own_folder(runs):
    """Beside the store by default, under tp_cache when given; a second opening reads none of the store."""
    stores, _, results = runs
    assert [results["llama"][rank]["rank_store"] for rank in (0, 1)] == [
        str(stores["llama"] / "tp" / f"rank_{rank}_of_2") for rank in (0, 1)]
    assert [results["llama-streamed"][rank]["share_bytes_read"] for rank in (0, 1)] == [0, 0]
    cached = [Path(results["llama-tp-cache"][rank]["rank_store"]) for rank in (0, 1)]
    assert [p.name for p in cached] == ["rank_0_of_2", "rank_1_of_2"]
    assert cached[0].parent.parent == stores["llama"].parent.parent / "cache"
    assert results["llama-tp-cache"][0]["share_bytes_read"] == results["llama"][0]["share_bytes_read"]


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
    assert [results["llama-mqa"][rank]["share_bytes_read"] for rank in (0, 1)] == [split // 2 + replicated] * 2


def test_exported_slices_are_read_as_the_rank_files(runs):
    stores, _, results = runs
    index = load_index(open_store(stores["llama-sliced"]))
    for rank in (0, 1):
        mine = sum(s.length for s in index.slices if s.rank == rank and s.count == 2)
        assert results["llama-sliced"][rank]["share_bytes_read"] == 0
        assert results["llama-sliced"][rank]["bytes_read"] == mine   # every block resident: read once
        assert results["llama-sliced"][rank]["rank_store"] == str(stores["llama-sliced"])


def test_exported_fused_projections_are_read_from_the_rank_files(runs):
    """`shard --tp 2` wrote each phi3 rank its heads and halves: the ranks stream those files."""
    stores, _, results = runs
    for name in ("phi3-sliced", "phi3-sliced-streamed"):
        assert [results[name][rank]["share_bytes_read"] for rank in (0, 1)] == [0, 0]
        assert [results[name][rank]["rank_store"] for rank in (0, 1)] == [str(stores["phi3-sliced"])] * 2


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


def test_generate_command_streams_the_ranks_and_prints_the_greedy_text_once(runs):
    stores, references, _ = runs
    tokenizer = char_tokenizer()
    ids = tokenizer("Hello", return_tensors="pt")
    expected = references["llama"].generate(**ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    text = tokenizer.decode(expected[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    done = _launch("-m", "shardstream", "generate", str(stores["llama"]), "--tensor-parallel",
                   "--prompt", "Hello", "--max-new-tokens", "8", "--no-progress", "--max-resident-memory", "0")
    assert done.returncode == 0, done.stderr[-3000:]
    assert text.strip() and done.stdout.strip() == text.strip()
    assert "is writing its share" not in done.stderr   # the ranks' folders were written by an earlier run


def test_two_machines_each_with_its_own_copy_of_the_store(runs, tmp_path):
    """Two torchrun agents, as on two machines (`--nnodes 2 --node-rank R --rdzv-endpoint HOST:PORT`, the
    two-machine example of docs/TENSOR_PARALLEL.md), each rank streaming from its own folder: rank 0 prints
    transformers' greedy text, the other prints nothing."""
    stores, references, _ = runs
    tokenizer = char_tokenizer()
    ids = tokenizer("Hello", return_tensors="pt")
    expected = references["llama"].generate(**ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    text = tokenizer.decode(expected[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    port = _free_port()
    agents = []
    for node in (0, 1):
        copy = shutil.copytree(stores["llama"], tmp_path / f"machine{node}" / "store", ignore=shutil.ignore_patterns("tp"))
        agents.append(subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
             "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}", "-m", "shardstream", "generate",
             str(copy), "--tensor-parallel", "--prompt", "Hello", "--max-new-tokens", "8", "--no-progress",
             "--max-resident-memory", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    (out0, err0), (out1, err1) = (agent.communicate(timeout=600) for agent in agents)
    assert agents[0].returncode == agents[1].returncode == 0, (err0 + err1)[-3000:]
    assert text.strip() and out0.strip() == text.strip() and out1.strip() == ""
    assert all((tmp_path / f"machine{node}" / "store" / "tp").is_dir() for node in (0, 1))   # each wrote its shares


def test_tensor_parallel_outside_torchrun_is_one_sentence(runs):
    stores, _, _ = runs
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = str(SRC)
    done = warm_python.run([sys.executable, "-m", "shardstream", "generate", str(stores["llama"]), "--tensor-parallel",
                            "--prompt", "Hi"], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert "RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT is not set; start it with `torchrun" in " ".join(done.stderr.split())


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "qwen3_moe-fused"])
def test_each_rank_reads_only_its_half_of_the_experts(runs, name):
    stores, _, results = runs
    tensors = open_store(stores[name]).manifest.tensors
    for rank in (0, 1):
        assert results[name][rank]["share_bytes_read"] == _split_bytes(stores[name], rank)
    experts = [sum(r.length for r in tensors.values() if r.expert is not None and r.expert // 2 == rank) for rank in (0, 1)]
    assert experts[0] == experts[1] == sum(r.length for r in tensors.values() if r.expert is not None) // 2
    assert (experts[0] > 0) == (name != "qwen3_moe-fused")


def test_placed_experts_are_read_as_the_rank_s_experts_only(runs):
    """Experts on tiers (one outside the store), dense slices exported for 2 ranks: each rank writes its own
    store from its shares of the dense part files and the bytes of its experts in their containers, whatever
    tier they are on (exported slices do not hold a rank's experts)."""
    stores, _, results = runs
    index = load_index(open_store(stores["mixtral-placed"]))
    assert {r.tier for r in index.experts.values()} == {"hot", "cold"}
    for rank in (0, 1):
        experts = [r for r in index.experts.values() if r.expert // 2 == rank]
        assert len(experts) == 2 * 3   # 2 experts of each of the 3 blocks
        expected = _split_bytes(stores["mixtral-placed"], rank) + sum(r.length for r in experts)
        assert results["mixtral-placed"][rank]["share_bytes_read"] == expected
        assert results["mixtral-placed"][rank]["rank_store"] == str(stores["mixtral-placed"] / "tp" / f"rank_{rank}_of_2")


def test_ranks_read_the_experts_the_router_picks_from_the_store_s_expert_files(runs):
    """experts='on_demand' in a rank: its folder holds its dense shares and no expert; the experts stay in the
    store's files on their tiers, and each rank reads those of its own (two of each block's four) that the
    router picks, each expert's bytes whole. (Its tokens equal transformers': the test above.)"""
    stores, _, results = runs
    index = load_index(open_store(stores["mixtral-placed"]))
    for rank in (0, 1):
        result = results["mixtral-on-demand"][rank]
        assert result["rank_store"] == str(stores["mixtral-placed"] / "tp" / f"rank_{rank}_of_2_experts_apart")
        folder = open_store(result["rank_store"])
        assert not load_index(folder).experts
        assert not any(r.expert is not None or ".experts." in name for name, r in folder.manifest.tensors.items())
        assert result["share_bytes_read"] == _split_bytes(stores["mixtral-placed"], rank)
        lengths = {r.length for r in index.experts.values() if r.expert // 2 == rank}
        experts = result["experts"]
        assert experts["loads"] > 0 and experts["bytes_read"] == experts["loads"] * lengths.pop() and not lengths


def test_experts_on_demand_in_a_rank_need_them_placed(runs):
    stores, _, results = runs
    root = stores["mixtral"]
    for rank in (0, 1):
        assert results["mixtral-on-demand-unplaced"][rank]["refused"] == (
            f"experts='on_demand' needs every expert placed on a tier, but {root} has no placed expert 0:{2 * rank}; "
            f"run `shardstream shard {root} --experts` first.")
        assert not (root / "tp" / f"rank_{rank}_of_2_experts_apart").exists()   # refused before writing anything


def test_a_rank_count_that_does_not_divide_the_experts_is_one_sentence(runs):
    _, _, results = runs
    for rank in (0, 1):
        assert results["mixtral-3-experts"][rank]["refused"] == (
            "config.json num_local_experts is 3: the experts cannot be split equally over 2 ranks; "
            "start a number of ranks that divides 3.")


def _exported(tmp_path: Path, family: str) -> Path:
    save_checkpoint(family, tmp_path / family / "ckpt")
    convert(tmp_path / family / "ckpt", tmp_path / family / "store", progress=False)
    export_tp(open_store(tmp_path / family / "store"), 2)
    return tmp_path / family / "store"


def _layout(root: Path, rank: int) -> RankLayout:
    store = open_store(root)
    return rank_layout(store, build_meta_model(store, None), rank, 2)


def test_an_export_without_ranges_is_read_only_where_its_blocks_are_the_shares(tmp_path):
    """An index written before slices had `ranges` holds one equal block of rows per rank: a llama's are
    its ranks' shares; phi3's fused projections are not (its ranks then write their own shares)."""
    for family, usable in (("llama", True), ("phi3", False)):
        root = _exported(tmp_path, family)
        store = open_store(root)
        index = load_index(store, for_update=True)
        for record in index.slices:
            record.ranges = None
        index.save(store)
        assert (exported_view(open_store(root), _layout(root, 1), 1, 2) is not None) == usable


def test_a_rank_folder_that_cannot_be_written_is_one_sentence(tmp_path):
    root = _exported(tmp_path, "llama")
    (tmp_path / "file").write_text("")
    with pytest.raises(InvalidOption) as refused:
        rank_folder(open_store(root), _layout(root, 0), 0, 2, "f" * 32, tmp_path / "file" / "cache")
    assert str(refused.value) == (
        f"rank 0 cannot write its shares to {tmp_path}/file/cache/{'f' * 16}/rank_0_of_2 (Not a directory); pass a "
        f"writable folder as tp_cache (--tp-cache), or export the shares once with `shardstream shard {root} --tp 2`.")


KILLED_WRITER = """
import os, signal, sys
from shardstream.store import open_store
from shardstream.stream.meta import build_meta_model
from shardstream.tp import rankstore
written = []
def write_then_die(path, encoded, original=rankstore.write_encoded):
    if len(written) == 3:
        os.kill(os.getpid(), signal.SIGKILL)   # after the third part's file, before its manifest entry
    written.append(path)
    return original(path, encoded)
rankstore.write_encoded = write_then_die
store = open_store(sys.argv[1])
layout = rankstore.rank_layout(store, build_meta_model(store, None), 0, 2)
rankstore.rank_folder(store, layout, 0, 2, "f" * 32, sys.argv[2])
"""


def test_a_rank_killed_while_writing_its_shares_resumes(tmp_path):
    """SIGKILLed after three parts' files, a rank's folder keeps them; the next start writes the rest only,
    and ends with the files of a run never killed."""
    root = _exported(tmp_path, "llama")
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    killed = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(root), str(tmp_path / "cache")], env=env,
                            capture_output=True, timeout=300)
    assert killed.returncode == -9
    store = open_store(root)
    resumed, read = rank_folder(store, _layout(root, 0), 0, 2, "f" * 32, tmp_path / "cache")
    fresh, everything = rank_folder(store, _layout(root, 0), 0, 2, "e" * 32, tmp_path / "cache")
    assert 0 < read < everything
    assert resumed.manifest.files == fresh.manifest.files and resumed.manifest.tensors == fresh.manifest.tensors


def test_tp_cache_without_tensor_parallel_is_one_sentence(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    done = warm_python.run([sys.executable, "-m", "shardstream", "generate", str(tmp_path), "--prompt", "Hi",
                            "--tp-cache", str(tmp_path / "cache")], capture_output=True, text=True, env=env,
                           timeout=600)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "--tp-cache goes with --tensor-parallel; leave it out." in " ".join(done.stderr.split())


def test_the_first_run_says_where_it_writes_the_rank_folders(tmp_path):
    """The first run wrote the ranks' shares into the store without a word (hundreds of MB for a real model)."""
    root, _ = _store(tmp_path, "llama")
    command = ("-m", "shardstream", "generate", str(root), "--tensor-parallel", "--prompt", "Hi", "--max-new-tokens", "2",
               "--no-progress")
    first = _launch(*command)
    assert first.returncode == 0, first.stderr[-3000:]
    for rank in (0, 1):
        folder = root / "tp" / f"rank_{rank}_of_2"
        assert (f"rank {rank} of 2 is writing its share of the store (about {format_size(_store_bytes(root) // 2)}, "
                f"once: later runs read it) to {folder}; pass --tp-cache DIR (tp_cache= in Python) to keep it "
                "elsewhere") in " ".join(first.stderr.split())
        assert folder.is_dir()


def _store_bytes(root: Path) -> int:
    return sum(f.size for f in open_store(root).manifest.files.values())
