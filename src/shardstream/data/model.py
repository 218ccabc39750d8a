"""Load a causal LM (random init from config.json, or a full checkpoint) and its tokenizer; save it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from shardstream.errors import InvalidOption

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def has_weights(path: Path) -> bool:
    return any((path / name).exists() for name in WEIGHT_FILES)


def check_model_folder(model_path: str) -> Path:
    """The --model folder, checked before anything starts: its config.json, and every shard its weight index names."""
    path = Path(model_path)
    if not (path / "config.json").is_file():
        raise InvalidOption(f"model folder {model_path} has no config.json; pass --model a folder with config.json or a checkpoint.")
    for index in (path / name for name in WEIGHT_FILES if name.endswith(".index.json")):
        if index.is_file():
            try:
                shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (ValueError, KeyError, AttributeError, TypeError):
                raise InvalidOption(f"{index} is not a weight index (a JSON object with a weight_map); restore it "
                                    "from the checkpoint.") from None
            missing = [shard for shard in shards if not (path / shard).is_file()]
            if missing:
                raise InvalidOption(f"model folder {model_path} lacks {len(missing)} of the {len(shards)} weight files "
                                    f"its {index.name} names (first: {missing[0]}); download them, or pass a folder "
                                    "with config.json alone for a random init.")
    return path


def load_model(model_path: str, seed: int) -> PreTrainedModel:
    """Weights when the folder has them, else a random init that is the same for every worker (same seed)."""
    path = check_model_folder(model_path)
    if has_weights(path):
        with _no_progress_bar():   # one bar per worker, drawn over each other and over the run's own lines
            return AutoModelForCausalLM.from_pretrained(path)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))


@contextmanager
def _no_progress_bar() -> Iterator[None]:
    """transformers' progress bars off (its weight-loading bar), as they were after."""
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def load_tokenizer(model_path: str, tokenizer_path: str | None) -> PreTrainedTokenizerBase:
    """The tokenizer from --tokenizer or the model folder, with a pad token so batches can be padded."""
    path = tokenizer_path or model_path
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise InvalidOption(f"no tokenizer could be loaded from {path} ({e}); put tokenizer files there or pass --tokenizer.") from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    return tokenizer


def average_state_dicts(state_dicts: list[dict[str, torch.Tensor]], weights: list[float]) -> dict[str, torch.Tensor]:
    """Weighted parameter average of independently trained replicas (same init), the checkpoint of a
    parallel run; weights by steps trained, so a replica that trained less moves the result less."""
    if len(state_dicts) == 1:
        return state_dicts[0]
    w = torch.tensor(weights, dtype=torch.float64) / sum(weights)
    return {name: (torch.stack([sd[name].double() * wi for sd, wi in zip(state_dicts, w)]).sum(0).to(t.dtype) if t.is_floating_point() else t)
            for name, t in state_dicts[0].items()}
