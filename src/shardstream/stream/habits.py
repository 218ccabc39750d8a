"""What code written for a transformers model, or for AirLLM's, calls on a model besides its forward
pass and `generate`: `model.tokenizer` (AirLLM's README loads it so), `eval()`, `to()`, `dtype`, and a
clear refusal once the model is closed. Shared by the streamed model and a tensor-parallel rank."""

from __future__ import annotations

from functools import cached_property

import torch
from transformers import PreTrainedTokenizerBase

from ..errors import InvalidOption
from ..serving.text import load_tokenizer


class TransformersHabits:
    """Mixed into a model that has `store`, `device`, `model` (transformers' own, on `meta` where streamed)
    and `closed`."""

    store: object
    device: torch.device
    model: torch.nn.Module
    closed: bool

    @cached_property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The tokenizer the converter copied into the store, loaded on first use (as AirLLM's `model.tokenizer`)."""
        return load_tokenizer(self)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the model computes in (the compute dtype it was opened with)."""
        return self.model.dtype

    def eval(self):
        """The model only ever runs in inference mode: nothing to switch."""
        return self

    def to(self, *args, **kwargs):
        """The device and dtype are chosen when the model is opened (its blocks are read from the store
        straight to them); asking for the ones it has is a no-op, any other is refused with what to do."""
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        if device is not None and not _same_device(torch.device(device), self.device):
            raise InvalidOption(
                f"the model runs on {self.device}, chosen when it was opened; to run it on {device}, open it "
                f"with AutoModel.from_pretrained(..., device={str(device)!r}) instead of calling .to()."
            )
        if dtype is not None and dtype != self.dtype:
            raise InvalidOption(
                f"the model computes in {self.dtype}, chosen when it was opened; to compute in {dtype}, open it "
                f"with AutoModel.from_pretrained(..., dtype={dtype}) instead of calling .to()."
            )
        return self

    def check_open(self) -> None:
        """Refuse a call on a closed model (its hooks and readers are gone, its blocks on `meta`)."""
        if self.closed:
            raise InvalidOption("the model is closed (close() or the end of its `with` block released its "
                                "weights); open it again with AutoModel.from_pretrained to run it.")


def _same_device(asked: torch.device, have: torch.device) -> bool:
    """cuda and cuda:0 name the same device when the model runs on cuda:0 (its index as torch resolved it)."""
    if asked.type != have.type:
        return False
    return asked.index is None or have.index is None or asked.index == have.index
