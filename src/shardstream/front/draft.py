"""The draft model of speculative decoding: opened like the target, checked against its tokenizer.

transformers' assisted generation does the work (the draft proposes, one pass over the streamed
blocks verifies, the standard acceptance rule keeps greedy output identical and sampling unbiased);
this module only opens the draft, sets how many tokens it proposes and reports what a pass bought.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from transformers import PreTrainedTokenizerBase

from ..errors import DraftMismatch, InvalidOption
from ..options import ConversionOptions
from .cli import open_model
from ..stream.engine_options import EngineOptions
from ..stream.model import StreamingModel
from ..serving.text import load_tokenizer


STREAMED_DRAFT_TOKENS = 8   # against the adaptive schedule: benchmarks/stream.py's speculative section (docs/BENCHMARKS.md)


def open_draft(source: str, device: str, draft_tokens: int | None, progress: bool,
               target: StreamingModel | None = None,
               conversion: ConversionOptions = ConversionOptions()) -> StreamingModel:
    """The draft is small: 'auto' keeps all of its blocks in memory when they fit. It is opened with the
    target's options: its compute dtype and checksums (its memory budgets are its own), and `conversion`'s
    token, compression and --sequential when it is a checkpoint or a Hub id (not its store folder nor its
    revision, which name the model's).

    `draft_tokens` N = always propose N. None: when the target streams blocks, every pass costs a
    read of them, which a longer guess shares, so a fixed STREAMED_DRAFT_TOKENS; when all its blocks
    are resident a pass costs compute per token and transformers' adaptive schedule fits better (+2
    after a pass that accepted every draft token, -1 otherwise, starting from 5)."""
    if draft_tokens is not None and draft_tokens < 1:
        raise InvalidOption(f"--draft-tokens must be at least 1, not {draft_tokens}.")
    if draft_tokens is None and target is not None and streams_blocks(target):
        draft_tokens = STREAMED_DRAFT_TOKENS
    given = target.options if target is not None else EngineOptions()
    engine = EngineOptions(compute_dtype=given.compute_dtype, verify_checksums=given.verify_checksums)
    draft = open_model(source, replace(conversion, store_path=None, revision=None), engine, device, progress,
                       role="draft")
    config = draft.generation_config
    config.num_assistant_tokens = draft_tokens or 5
    config.num_assistant_tokens_schedule = "constant" if draft_tokens else "heuristic"
    config.assistant_confidence_threshold = 0.0 if draft_tokens else config.assistant_confidence_threshold
    return draft


def streams_blocks(model: StreamingModel) -> bool:
    return len(model.resident_blocks) < model.config.get_text_config().num_hidden_layers


def draft_options(target_tokenizer: PreTrainedTokenizerBase, target: StreamingModel, draft: StreamingModel) -> dict:
    """generate() keyword arguments for the draft. A draft with another tokenizer goes through
    transformers' universal assisted decoding, which re-encodes text between the two vocabularies;
    transformers tells tokenizers apart by vocabulary size only, so one of the same size is refused."""
    draft_tokenizer = load_tokenizer(draft)
    if draft_tokenizer.get_vocab() == target_tokenizer.get_vocab():
        return {"assistant_model": draft}
    if draft.config.get_text_config().vocab_size == target.config.get_text_config().vocab_size:
        raise DraftMismatch(
            f"the draft at {draft.store.root} has another tokenizer than the model but a vocabulary of the same "
            "size, which transformers' universal assisted decoding cannot tell apart; use a draft with the "
            "model's tokenizer."
        )
    return {"assistant_model": draft, "tokenizer": target_tokenizer, "assistant_tokenizer": draft_tokenizer}


@dataclass(frozen=True)
class PassReport:
    """New tokens per pass over the target's blocks (each pass reads every streamed block once)."""

    new_tokens: int
    target_passes: int

    def line(self) -> str:
        per_pass = self.new_tokens / self.target_passes if self.target_passes else 0.0
        return (f"{self.new_tokens} new tokens in {self.target_passes} target passes (weight reads): "
                f"{per_pass:.2f} tokens per pass, {max(self.new_tokens - self.target_passes, 0)} draft tokens accepted")
