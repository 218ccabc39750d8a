"""Tiny random-init transformers models of every family we support, saved as sharded checkpoints.

Shared by the converter, store and streaming tests. Seeds are fixed so runs are repeatable.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

COMMON = dict(vocab_size=128, max_position_embeddings=64, bos_token_id=1, eos_token_id=2)

CONFIGS: dict[str, dict] = {
    "llama": dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    "qwen2": dict(model_type="qwen2", hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False),
    "mistral": dict(model_type="mistral", hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, sliding_window=None),
    "gemma": dict(model_type="gemma", hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8),
    "phi3": dict(model_type="phi3", hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, pad_token_id=0),
    "mixtral": dict(model_type="mixtral", hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                    num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(model_type="qwen2_moe", hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                      shared_expert_intermediate_size=32, num_experts=8, num_experts_per_tok=4,
                      decoder_sparse_step=1, norm_topk_prob=False, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=False),
    "qwen3_moe": dict(model_type="qwen3_moe", hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                      num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1, norm_topk_prob=True,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      tie_word_embeddings=False),
    "gpt2": dict(model_type="gpt2", n_embd=32, n_layer=4, n_head=4, n_positions=64, vocab_size=128),
    "gpt_neox": dict(model_type="gpt_neox", hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                     num_attention_heads=4),
    "falcon": dict(model_type="falcon", hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                   new_decoder_architecture=False, multi_query=True),
}


def tiny_config(family: str, **overrides):
    settings = {**COMMON, **CONFIGS[family], **overrides}
    model_type = settings.pop("model_type")
    return AutoConfig.for_model(model_type, **settings)


def tiny_model(family: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides), dtype=dtype)
    return model.eval()


def save_checkpoint(family: str, folder: Path, max_shard_size: str = "40KB", seed: int = 0,
                    dtype: torch.dtype = torch.float32, **overrides):
    """Save a tiny model (its config's `overrides` given) as a sharded safetensors checkpoint; returns the model."""
    model = tiny_model(family, seed, dtype, **overrides)
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    return model


def char_tokenizer():
    """One token per printable ASCII character; ids fit the tiny models' 128-entry vocabulary."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{chr(c): c - 29 for c in range(32, 127)}}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def llama_store_with_tokenizer(folder: Path):
    """A converted tiny Llama store with a char tokenizer: (store path, reference model, tokenizer)."""
    from shardstream.convert import convert

    reference = save_checkpoint("llama", folder / "ckpt")
    tokenizer = char_tokenizer()
    tokenizer.save_pretrained(folder / "ckpt")
    convert(folder / "ckpt", folder / "store", progress=False)
    return folder / "store", reference, tokenizer


def endless_llama_store(folder: Path, context: int):
    """A converted tiny Llama with a `context`-token context and a char tokenizer without an end-of-sequence
    token, so that a request runs all its max_tokens (or until memory ends it): (store path, reference model)."""
    from shardstream.convert import convert

    settings = {**COMMON, **CONFIGS["llama"], "max_position_embeddings": context, "eos_token_id": None}
    settings.pop("model_type")
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **settings)).eval()
    reference.save_pretrained(folder / "ckpt")
    tokenizer = char_tokenizer()
    tokenizer.eos_token = None
    tokenizer.save_pretrained(folder / "ckpt")
    convert(folder / "ckpt", folder / "store", progress=False)
    return folder / "store", reference


def swapped_forwards(family: str, use, forward, class_name: str | None):
    """A tiny model of `family` and a copy given `use` (the engine's forward swap): (reference, copy, names of the
    copy's modules now running `forward`), after asserting those are exactly the modules of class `class_name`."""
    import copy

    reference = tiny_model(family)
    model = copy.deepcopy(reference)
    use(model)
    swapped = [name for name, module in model.named_modules() if type(module).forward is forward]
    assert swapped == [name for name, module in reference.named_modules() if type(module).__name__ == class_name]
    return reference, model, swapped
