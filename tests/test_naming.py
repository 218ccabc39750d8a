"""Tensor name -> store part, checked against the real state_dict names of tiny transformers models.

The expected block of a tensor comes from transformers' module tree (which block module owns the
tensor), not from name patterns, so the routing table is checked against an independent answer.
"""

import functools
import random

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM

from shardstream.errors import CorruptShard, InvalidOption, UnsupportedModel
from shardstream.naming import END, START, Part, Route, mid, router_for

_SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=128)
_DECODER = {**_SMALL, "num_key_value_heads": 2, "intermediate_size": 64, "head_dim": 8}
_IN_VOCAB_TOKENS = dict(bos_token_id=0, eos_token_id=0)  # the families' default ids lie outside a 128 vocabulary
_MIXTRAL = dict(num_local_experts=4, num_experts_per_tok=2)
_QWEN_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
_QWEN2_MOE = {**_QWEN_MOE, "shared_expert_intermediate_size": 16}


def _decoder(**options) -> tuple:
    start, end = {"model.embed_tokens.weight"}, {"model.norm.weight", "lm_head.weight"}
    return {**_DECODER, **options}, "model.layers", start, end


# model_type -> (config options, block ModuleList path, expected start names, expected end names)
FAMILY_CASES = {
    "llama": _decoder(),
    "qwen2": _decoder(),
    "qwen3": _decoder(),
    "mistral": _decoder(),
    "gemma": _decoder(),
    "gemma2": _decoder(),
    "gemma3_text": _decoder(),
    "phi3": _decoder(pad_token_id=0, **_IN_VOCAB_TOKENS),
    "mixtral": _decoder(**_MIXTRAL),
    "qwen2_moe": _decoder(**_QWEN2_MOE),
    "qwen3_moe": _decoder(**_QWEN_MOE),
    "gpt2": (
        {**_SMALL, **_IN_VOCAB_TOKENS, "n_positions": 64},
        "transformer.h",
        {"transformer.wte.weight", "transformer.wpe.weight"},
        {"transformer.ln_f.weight", "transformer.ln_f.bias", "lm_head.weight"},
    ),
    "gpt_neox": (
        {**_SMALL, **_IN_VOCAB_TOKENS, "intermediate_size": 64},
        "gpt_neox.layers",
        {"gpt_neox.embed_in.weight"},
        {"gpt_neox.final_layer_norm.weight", "gpt_neox.final_layer_norm.bias", "lm_head.weight"},
    ),
    "falcon": (
        _SMALL,
        "transformer.h",
        {"transformer.word_embeddings.weight"},
        {"transformer.ln_f.weight", "transformer.ln_f.bias", "lm_head.weight"},
    ),
}


@functools.cache
def tiny_model(model_type: str) -> tuple[dict, dict[str, Part]]:
    """(config dict, expected part of every state_dict name) for a meta-device model of the family."""
    options, blocks_path, start, end = FAMILY_CASES[model_type]
    config = AutoConfig.for_model(model_type, **options)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    owner = {
        id(tensor): mid(i)
        for i, block in enumerate(model.get_submodule(blocks_path))
        for tensor in block.state_dict(keep_vars=True).values()
    }
    expected = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in owner:
            expected[name] = owner[id(tensor)]
        elif name in start or name in end:
            expected[name] = START if name in start else END
        else:
            raise AssertionError(f"{model_type}: {name!r} is in no block and in neither expected list; add it to FAMILY_CASES")
    return config.to_dict(), expected


@pytest.mark.parametrize("model_type", FAMILY_CASES)
def test_every_state_dict_name_routes_to_its_part(model_type):
    config, expected = tiny_model(model_type)
    router = router_for(config, expected)
    assert router.family == model_type
    assert router.num_layers == 2
    assert {name: router.route(name).part for name in expected} == expected
    assert router.parts() == [START, mid(0), mid(1), END]


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_fused_expert_tensors_of_transformers_models_carry_no_expert_id(model_type):
    config, expected = tiny_model(model_type)
    router = router_for(config, expected)
    fused = [name for name in expected if ".experts." in name]
    assert fused, "transformers no longer fuses the experts in memory; update the streaming notes"
    assert all(name.split(".experts.")[1] in ("gate_up_proj", "down_proj") for name in fused)
    assert {router.route(name).expert for name in fused} == {None}


@pytest.mark.parametrize(
    ("model_type", "config_options", "expert_marker"),
    [
        ("mixtral", _MIXTRAL, ".block_sparse_moe.experts."),
        ("qwen2_moe", _QWEN2_MOE, ".mlp.experts."),
    ],
)
def test_saved_checkpoints_use_per_expert_names_with_expert_ids(tmp_path, model_type, config_options, expert_marker):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **{**_DECODER, **config_options}))
    model.save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as checkpoint:
        names = list(checkpoint.keys())
    router = router_for(model.config.to_dict(), names)
    routes = {router.route(name) for name in names if expert_marker in name}
    assert routes == {Route(mid(block), expert) for block in range(2) for expert in range(4)}


@pytest.mark.parametrize(
    ("model_type", "name", "route"),
    [
        ("mixtral", "model.layers.1.block_sparse_moe.experts.7.w2.weight", Route(mid(1), 7)),
        ("mixtral", "model.layers.1.block_sparse_moe.gate.weight", Route(mid(1))),
        ("qwen2_moe", "model.layers.0.mlp.experts.3.gate_proj.weight", Route(mid(0), 3)),
        ("qwen2_moe", "model.layers.0.mlp.shared_expert.gate_proj.weight", Route(mid(0))),
        ("qwen3_moe", "model.layers.1.mlp.experts.12.down_proj.weight", Route(mid(1), 12)),
        ("unknown_moe", "model.layers.1.mlp.experts.5.up_proj.weight", Route(mid(1), 5)),
        ("unknown_moe", "model.layers.1.mlp.shared_experts.up_proj.weight", Route(mid(1))),
    ],
)
def test_hub_expert_names_carry_their_expert_id(model_type, name, route):
    router = router_for({"model_type": model_type, "num_hidden_layers": 2}, [name])
    assert router.route(name) == route


def test_gpt2_hub_names_without_transformer_prefix():
    names = ["wte.weight", "wpe.weight", "h.0.attn.bias", "h.0.attn.c_attn.weight", "h.1.mlp.c_proj.bias", "ln_f.weight"]
    router = router_for({"model_type": "gpt2", "n_layer": 2}, names)
    assert [router.route(name).part for name in names] == [START, START, mid(0), mid(0), mid(1), END]
    assert router.tied_head() == ("lm_head.weight", "wte.weight")


def test_tied_head_follows_the_config():
    qwen_config, qwen_names = tiny_model("qwen2")
    gpt2_config, gpt2_names = tiny_model("gpt2")
    llama_config, llama_names = tiny_model("llama")
    assert router_for({**qwen_config, "tie_word_embeddings": True}, qwen_names).tied_head() == (
        "lm_head.weight",
        "model.embed_tokens.weight",
    )
    assert router_for(gpt2_config, gpt2_names).tied_head() == ("lm_head.weight", "transformer.wte.weight")
    assert router_for(llama_config, llama_names).tied_head() is None


@pytest.mark.parametrize("model_type", FAMILY_CASES)
def test_tied_head_default_matches_the_transformers_family_default(model_type):
    router = router_for({"model_type": model_type, "num_hidden_layers": 2}, [])
    assert (router.tied_head() is not None) == AutoConfig.for_model(model_type).tie_word_embeddings


def test_unknown_model_type_with_llama_names_routes_like_llama():
    config, expected = tiny_model("llama")
    router = router_for({**config, "model_type": "my_llama"}, expected)
    assert router.family == "pattern"
    assert {name: router.route(name).part for name in expected} == expected
    assert router.tied_head() is None


@pytest.mark.parametrize(
    ("names", "parts"),
    [
        (  # Meta's original Llama layout
            ["tok_embeddings.weight", "layers.0.attention.wq.weight", "layers.1.feed_forward.w1.weight",
             "norm.weight", "output.weight"],
            [START, mid(0), mid(1), END, END],
        ),
        (  # BLOOM-style embedding norm, Pythia-style head named embed_out
            ["transformer.word_embeddings.weight", "transformer.word_embeddings_layernorm.weight",
             "transformer.h.0.self_attention.dense.weight", "transformer.ln_f.weight", "embed_out.weight"],
            [START, START, mid(0), END, END],
        ),
        (  # BERT-style encoder
            ["bert.embeddings.word_embeddings.weight", "bert.embeddings.LayerNorm.weight",
             "bert.encoder.layer.0.attention.self.query.weight", "bert.pooler.dense.weight"],
            [START, START, mid(0), END],
        ),
    ],
)  # fmt: skip
def test_pattern_fallback_without_model_type(names, parts):
    router = router_for({}, names)
    assert router.family == "pattern"
    assert router.num_layers == max(part.index for part in parts if part.kind == "mid") + 1
    assert [router.route(name).part for name in names] == parts


def test_pattern_fallback_ties_when_the_head_tensor_is_missing():
    names = ["transformer.word_embeddings.weight", "transformer.h.0.mlp.weight", "transformer.ln_f.weight"]
    assert router_for({}, names).tied_head() == ("lm_head.weight", "transformer.word_embeddings.weight")
    assert router_for({"tie_word_embeddings": False}, names).tied_head() is None
    assert router_for({}, [*names, "lm_head.weight"]).tied_head() is None


def test_no_block_structure_stores_one_tensor_per_part_and_warns():
    names = ["wq", "wk", "encoder/dense/kernel"]
    with pytest.warns(UserWarning, match="storing one tensor per part"):
        router = router_for({"model_type": "mystery", "num_hidden_layers": 2}, names)
    assert (router.family, router.num_layers, router.tied_head()) == ("per-tensor", 0, None)
    assert router.route("encoder/dense/kernel") == Route(Part("tensor", tensor="encoder/dense/kernel"))
    assert [part.path for part in router.parts()] == ["tensor/encoder%2Fdense%2Fkernel", "tensor/wk", "tensor/wq"]


def test_block_index_beyond_config_is_a_corrupt_checkpoint():
    config, expected = tiny_model("llama")
    message = r"Tensor 'model\.layers\.2\.mlp\.up_proj\.weight' belongs to block 2 but config\.json gives 2 layers; use the config\.json"
    with pytest.raises(CorruptShard, match=message):
        router_for(config, [*expected, "model.layers.2.mlp.up_proj.weight"])
    with pytest.raises(ValueError, match=message):
        router_for(config, expected).route("model.layers.2.mlp.up_proj.weight")


def test_config_that_does_not_fit_the_names_is_refused():
    _, gpt2_names = tiny_model("gpt2")
    with pytest.raises(UnsupportedModel, match=r"model_type 'llama' expects block tensors .* but no tensor name matches"):
        router_for({"model_type": "llama", "num_hidden_layers": 2}, gpt2_names)
    with pytest.raises(UnsupportedModel, match=r"config\.json num_hidden_layers must be a non-negative integer, got '2'"):
        router_for({"model_type": "llama", "num_hidden_layers": "2"}, gpt2_names)


@pytest.mark.parametrize(
    ("part", "path"),
    [
        (START, "start"),
        (mid(0), "mid/0"),
        (mid(12), "mid/12"),
        (END, "end"),
        (Part("tensor", tensor="model.norm.weight"), "tensor/model.norm.weight"),
        (Part("tensor", tensor="a/b%c"), "tensor/a%2Fb%25c"),
        (Part("tensor", tensor=".."), "tensor/%2E%2E"),
        (Part("tensor", tensor="."), "tensor/%2E"),
    ],
)
def test_part_path_round_trip(part, path):
    assert part.path == path
    assert Part.parse(path) == part


@pytest.mark.parametrize(
    "path",
    ["", "mid", "mid/", "mid/x", "mid/-1", "mid/03", "mid/ 3", "start/", "start/1", "END", "middle/1", "tensor", "tensor/", "tensor/a/b", "tensor/..", "tensor/."],
)
def test_part_parse_refuses_junk(path):
    with pytest.raises(InvalidOption, match=rf"Store part path '{path}' is not valid; use 'start', 'mid/<block number>'"):
        Part.parse(path)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"kind": "mid"}, "Part 'mid' needs a block index >= 0, got None"),
        ({"kind": "start", "index": 1}, "Part 'start' takes no block index, got 1"),
        ({"kind": "tensor"}, "Part 'tensor' needs a tensor name, got None"),
        ({"kind": "end", "tensor": "x"}, "Part 'end' takes no tensor name, got 'x'"),
        ({"kind": "block"}, "Part kind 'block' is unknown"),
    ],
)
def test_part_refuses_inconsistent_fields(arguments, message):
    with pytest.raises(InvalidOption, match=message):
        Part(**arguments)


def test_parts_sort_in_model_order():
    ordered = [START, mid(0), mid(2), mid(10), END, Part("tensor", tensor="a"), Part("tensor", tensor="b")]
    shuffled = ordered[:]
    random.Random(0).shuffle(shuffled)
    assert sorted(shuffled, key=Part.sort_key) == ordered
