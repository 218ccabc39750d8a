"""Text in, text out around a streaming model: tokenizer, chat prompt, sampling options, one prompt
generated and printed.

Shared by the `generate` command, the OpenAI-compatible server and the pipeline's coordinator so all
sample the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from ..errors import InvalidOption, StoreIncomplete
from ..store.manifest import MANIFEST_NAME
from .stops import stop_streamer


# the files one of which holds a tokenizer's vocabulary (without any, transformers builds an empty one)
VOCABULARY_FILES = ("tokenizer.json", "vocab.json", "vocab.txt", "tokenizer.model", "spiece.model")


def load_tokenizer(model) -> PreTrainedTokenizerBase:
    """The tokenizer files the converter copied into the store of `model` (a streaming model or a pipeline:
    anything with a `store`)."""
    root = model.store.root
    check_tokenizer_files(root)
    try:
        tokenizer = AutoTokenizer.from_pretrained(root)
    except (OSError, ValueError) as error:
        _no_tokenizer(root, str(error))
    # Prompt length is checked against the model's context by us, with a message that says what to do;
    # transformers' own "Token indices sequence length is longer..." warning would only come first.
    tokenizer.deprecation_warnings["sequence-length-is-longer-than-the-specified-maximum"] = True
    return tokenizer


def check_tokenizer_files(root: str | Path) -> None:
    """Refuse a local store folder (`root`; a URL or Hub id passes) that holds none of VOCABULARY_FILES: the
    commands that need text check this before loading the model, so that the missing files are said at once,
    not after the load."""
    root = Path(root)
    if (root / MANIFEST_NAME).is_file() and not any((root / name).is_file() for name in VOCABULARY_FILES):
        _no_tokenizer(root, f"none of {', '.join(VOCABULARY_FILES)}")


def _no_tokenizer(root, why: str) -> NoReturn:
    raise StoreIncomplete(
        f"the store at {root} has no usable tokenizer files ({why}); "
        "copy tokenizer.json and tokenizer_config.json from the checkpoint into it."
    ) from None


def check_context(config, length: int, new_tokens: int) -> None:
    """Refuse a prompt of `length` tokens (plus the tokens to generate) longer than the model's context."""
    limit = getattr(config, "max_position_embeddings", None)
    if not limit:
        return
    if length > limit:
        raise InvalidOption(
            f"the prompt has {length} tokens but the model's context (config.json max_position_embeddings) "
            f"is {limit}; shorten the prompt."
        )
    if length + new_tokens > limit:
        raise InvalidOption(
            f"the prompt ({length} tokens) plus max_new_tokens ({new_tokens}) exceeds the model's context of "
            f"{limit} (config.json max_position_embeddings); ask for at most {limit - length} new tokens."
        )


def chat_prompt(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], template: str | None = None) -> str:
    """The chat template (`template`, else the tokenizer's) applied to the messages. Without one there
    is no right way to format a chat for this model, so it is refused rather than guessed."""
    template = template or tokenizer.chat_template
    if not template:
        raise InvalidOption("this model has no chat template (chat_template in tokenizer_config.json); "
                            "start serve with --chat-template FILE, or use /v1/completions.")
    from jinja2 import TemplateError

    try:
        return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                             add_generation_prompt=True)
    except TemplateError as error:   # the template refuses these messages, or fails on them
        raise InvalidOption(f"the chat template cannot format these messages: {error}") from None


def sampling_options(max_new_tokens: int, temperature: float, top_p: float,
                     tokenizer: PreTrainedTokenizerBase, top_k: int = 0) -> dict:
    """generate() keyword arguments; temperature 0 means greedy, top_k 0 means no top-k cut."""
    if max_new_tokens < 1:
        raise InvalidOption(f"max new tokens must be at least 1, not {max_new_tokens}.")
    if temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
        raise InvalidOption(f"temperature and top_k must be >= 0 and top_p in (0, 1], not {temperature}, {top_k} and {top_p}.")
    options = dict(max_new_tokens=max_new_tokens, pad_token_id=pad_id(tokenizer))
    if temperature == 0:
        return {**options, "do_sample": False}
    return {**options, "do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": top_k}


def eos_ids(model, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """Every token that ends a sequence: the generation config's EOS ids and the tokenizer's."""
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = set(configured if isinstance(configured, list) else [configured] if configured is not None else [])
    return ids | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())


def pad_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The id that pads batches: the tokenizer's pad token, else its EOS, else 0."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return pad or 0


def set_seed(seed: int | None) -> None:
    """Sampling draws from torch's global generator; seed it right before generating."""
    if seed is not None:
        torch.manual_seed(seed)


def encode(tokenizer: PreTrainedTokenizerBase, prompt: str) -> dict[str, torch.Tensor]:
    if not prompt:
        raise InvalidOption("the prompt is empty; give some text to continue.")
    encoded = tokenizer(prompt, return_tensors="pt")
    if not encoded["input_ids"].shape[-1]:
        raise InvalidOption("the prompt gives no tokens with this model's tokenizer; give text it can encode.")
    return {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}


def generate_one(model, tokenizer: PreTrainedTokenizerBase, prompt: str, *, max_new_tokens: int, temperature: float,
                 top_p: float, top_k: int, seed: int | None, stops: list[str], prints: bool = True,
                 more_options: Callable[[], dict] | None = None) -> torch.Tensor:
    """Continue `prompt` with `model` (streaming, tensor-parallel or pipeline: anything with transformers'
    `generate`), printing the text before the first stop string as it comes where `prints` (of several
    processes running the same generation, one prints). `more_options` gives further generate() keyword
    arguments, such as a draft's; it is called once the prompt is known to encode, so a bad prompt is
    refused before a draft model is opened. Returns the new tokens, [1, n]."""
    inputs = encode(tokenizer, prompt)
    options = sampling_options(max_new_tokens, temperature, top_p, tokenizer, top_k)
    if stops:
        options.update(stop_strings=stops, tokenizer=tokenizer)
    if more_options is not None:
        options.update(more_options())
    set_seed(seed)
    out = model.generate(**inputs, **options, streamer=stop_streamer(tokenizer, stops) if prints else None)
    return out[:, inputs["input_ids"].shape[1]:]
