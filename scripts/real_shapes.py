"""Random checkpoints with the exact configs of real models, written shard by shard.

Every figure taken on toy shapes (fp32, vocab 512) missed what real checkpoints bring: bf16 weights
and 128k-152k vocabularies, whose embedding and head alone are 0.5-1 GB. This writes a checkpoint
with a real model's config (at a chosen depth) and random weights, the way the Hub publishes them:
safetensors shards plus `model.safetensors.index.json`, a tied head left out. Each shard's tensors
are generated, saved with `safetensors.torch.save_file` and dropped before the next shard, so building
one never takes more memory than a shard and never instantiates the model. Nothing is downloaded.

    python scripts/real_shapes.py llama-3.2-1b OUT [--layers 2] [--shard-size 1GB]

Shapes: llama-3.2-1b, qwen2.5-0.5b, qwen2.5-7b, mixtral-8x7b and qwen3-30b-a3b (MoE models: 8 experts of
Mixtral's width a block, or 128 narrow ones with 8 routed; their 32 and 48 layers are too big for one
machine: pass --layers). Tests and benchmarks import `write_checkpoint`.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
               "original_max_position_embeddings": 8192}

# config.json of each model as published (the fields that shape the weights and the computation)
SHAPES: dict[str, dict] = {
    "llama-3.2-1b": dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                         max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                         rope_scaling=LLAMA3_ROPE, tie_word_embeddings=True, bos_token_id=128000,
                         eos_token_id=128001, hidden_act="silu", attention_bias=False, mlp_bias=False),
    "qwen2.5-0.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
                         tie_word_embeddings=True, use_sliding_window=False, sliding_window=None,
                         max_window_layers=21, bos_token_id=151643, eos_token_id=151643, hidden_act="silu"),
    "qwen2.5-7b": dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
                       tie_word_embeddings=False, use_sliding_window=False, sliding_window=None,
                       max_window_layers=28, bos_token_id=151643, eos_token_id=151643, hidden_act="silu"),
    "mixtral-8x7b": dict(model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=32768,
                         rms_norm_eps=1e-5, rope_theta=1000000.0, tie_word_embeddings=False,
                         sliding_window=None, bos_token_id=1, eos_token_id=2, hidden_act="silu"),
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                          moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                          norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                          max_position_embeddings=40960, max_window_layers=48, rms_norm_eps=1e-6,
                          rope_theta=1000000.0, rope_scaling=None, tie_word_embeddings=False,
                          use_sliding_window=False, sliding_window=None, attention_bias=False,
                          router_aux_loss_coef=0.001, output_router_logits=False, bos_token_id=151643,
                          eos_token_id=151645, hidden_act="silu"),
}
STD = 0.02  # transformers' initializer_range: random logits neither flat nor saturated
# the projections whose outputs a block adds to the residual stream (attention's, the MLP's, an expert's)
WRITES_RESIDUAL = ("o_proj.weight", "down_proj.weight", "w2.weight")


def tensor_shapes(config: dict) -> list[tuple[str, list[int]]]:
    """(checkpoint name, shape) of every tensor, in the order the Hub's checkpoints hold them."""
    h, inter, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    head_dim = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    model_type = config["model_type"]
    bias = model_type == "qwen2"
    shapes = [("model.embed_tokens.weight", [v, h])]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes += [(p + "input_layernorm.weight", [h]), (p + "post_attention_layernorm.weight", [h])]
        for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            shapes.append((p + f"self_attn.{name}.weight", [rows, h]))
            if bias:
                shapes.append((p + f"self_attn.{name}.bias", [rows]))
        shapes.append((p + "self_attn.o_proj.weight", [h, q]))
        if model_type in ("qwen3", "qwen3_moe"):   # RMSNorm over each head's queries and keys
            shapes += [(p + "self_attn.q_norm.weight", [head_dim]), (p + "self_attn.k_norm.weight", [head_dim])]
        if model_type == "mixtral":
            shapes.append((p + "block_sparse_moe.gate.weight", [config["num_local_experts"], h]))
            for e in range(config["num_local_experts"]):
                x = p + f"block_sparse_moe.experts.{e}."
                shapes += [(x + "w1.weight", [inter, h]), (x + "w2.weight", [h, inter]), (x + "w3.weight", [inter, h])]
        elif model_type == "qwen3_moe" and _sparse(config, i):
            wide = config["moe_intermediate_size"]
            shapes.append((p + "mlp.gate.weight", [config["num_experts"], h]))
            for e in range(config["num_experts"]):
                x = p + f"mlp.experts.{e}."
                shapes += [(x + "gate_proj.weight", [wide, h]), (x + "up_proj.weight", [wide, h]),
                           (x + "down_proj.weight", [h, wide])]
        else:
            shapes += [(p + "mlp.gate_proj.weight", [inter, h]), (p + "mlp.up_proj.weight", [inter, h]),
                       (p + "mlp.down_proj.weight", [h, inter])]
    shapes.append(("model.norm.weight", [h]))
    if not config["tie_word_embeddings"]:
        shapes.append(("lm_head.weight", [v, h]))
    return shapes


def _sparse(config: dict, layer: int) -> bool:
    """Whether a Qwen-MoE block routes to experts (transformers' rule) or holds a dense MLP."""
    return (layer not in config.get("mlp_only_layers", []) and config["num_experts"] > 0
            and (layer + 1) % config.get("decoder_sparse_step", 1) == 0)


def shape_config(shape: str, layers: int | None = None) -> dict:
    """The published config of `shape`, at `layers` blocks when given."""
    if shape not in SHAPES:
        raise SystemExit(f"unknown shape {shape!r}; choose one of {', '.join(SHAPES)}.")
    config = dict(SHAPES[shape])
    if layers:
        config["num_hidden_layers"] = layers
        if "max_window_layers" in config:
            config["max_window_layers"] = min(config["max_window_layers"], layers)
    return config


def checkpoint_bytes(config: dict, dtype: torch.dtype = torch.bfloat16) -> int:
    return sum(math.prod(s) for _, s in tensor_shapes(config)) * torch.finfo(dtype).bits // 8


def _shards(shapes: list[tuple[str, list[int]]], limit: int, itemsize: int) -> list[list[tuple[str, list[int]]]]:
    shards: list[list[tuple[str, list[int]]]] = [[]]
    size = 0
    for name, shape in shapes:
        nbytes = math.prod(shape) * itemsize
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    return shards


def _random(name: str, shape: list[int], dtype: torch.dtype, generator: torch.Generator,
            residual_scale: float = 1.0) -> torch.Tensor:
    if len(shape) == 1 and name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype)
    scale = residual_scale if name.endswith(WRITES_RESIDUAL) else 1.0
    return torch.randn(shape, generator=generator, dtype=dtype).mul_(STD * scale)


def write_checkpoint(shape: str, out: Path, layers: int | None = None, shard_bytes: int = 1 << 30,
                     dtype: torch.dtype = torch.bfloat16, seed: int = 0, residual_scale: float = 1.0,
                     **overrides) -> Path:
    """Write the checkpoint into `out` (made if missing; left as it is when its index is already there).
    `overrides` change config fields (e.g. tie_word_embeddings=False: the same widths with a head of its own)."""
    return write_config_checkpoint({**shape_config(shape, layers), **overrides}, out, shard_bytes, dtype, seed,
                                   residual_scale)


def write_config_checkpoint(config: dict, out: Path, shard_bytes: int = 1 << 30, dtype: torch.dtype = torch.bfloat16,
                            seed: int = 0, residual_scale: float = 1.0) -> Path:
    """The same for any config of these families (fields as in SHAPES): benchmarks size their own models.
    `residual_scale` scales the projections that write to the residual stream (WRITES_RESIDUAL): below 1, each
    block changes the hidden state little, as a trained model's blocks do, where at random init each block's
    output outweighs the embedding it is added to."""
    out = Path(out)
    index_path = out / "model.safetensors.index.json"
    if index_path.exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    itemsize = torch.finfo(dtype).bits // 8
    shards = _shards(tensor_shapes(config), shard_bytes, itemsize)
    generator = torch.Generator().manual_seed(seed)
    weight_map, total = {}, 0
    for number, shard in enumerate(shards, 1):
        file_name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: _random(name, shp, dtype, generator, residual_scale) for name, shp in shard}
        save_file(tensors, str(out / file_name), metadata={"format": "pt"})
        total += sum(t.nbytes for t in tensors.values())
        weight_map.update({name: file_name for name in tensors})
        del tensors
    settings = {**config, "architectures": [_architecture(config["model_type"])],
                "torch_dtype": str(dtype).removeprefix("torch."), "initializer_range": STD}
    (out / "config.json").write_text(json.dumps(settings, indent=2) + "\n")
    index_path.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    return out


def _architecture(model_type: str) -> str:
    return {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mixtral": "MixtralForCausalLM",
            "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}[model_type]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", type=int, help="blocks (default: the model's own depth)")
    parser.add_argument("--shard-size", default="1GB", help="most bytes per safetensors shard (default 1GB)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    units = {"GB": 1 << 30, "MB": 1 << 20, "KB": 1 << 10}
    size = args.shard_size.upper()
    unit = next((u for u in units if size.endswith(u)), "")
    shard_bytes = int(float(size.removesuffix(unit)) * units.get(unit, 1))
    path = write_checkpoint(args.shape, args.out, args.layers, shard_bytes, seed=args.seed)
    print(f"{path}: {checkpoint_bytes(shape_config(args.shape, args.layers)) / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
