"""Chunks of text into token batches, tokenized on the fly (nothing tokenized is stored)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from transformers import PreTrainedTokenizerBase


def batches(texts: list[str], batch_size: int) -> Iterator[list[str]]:
    for start in range(0, len(texts), batch_size):
        yield texts[start:start + batch_size]


def rank_slice(texts: list[str], rank: int, world: int) -> list[str]:
    """This rank's share of a global batch; never empty, so every DDP rank joins every step."""
    return texts[rank::world] or texts[rank % len(texts):][:1]


def encode(tokenizer: PreTrainedTokenizerBase, texts: list[str], seq_len: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Padded input ids and mask, with labels that ignore the padding."""
    enc = tokenizer(texts, truncation=True, max_length=seq_len, padding=True, return_tensors="pt")
    labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
    return {"input_ids": enc["input_ids"].to(device), "attention_mask": enc["attention_mask"].to(device), "labels": labels.to(device)}
