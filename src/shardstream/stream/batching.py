"""Continuous batching over one streaming model: every block read serves every running sequence.

INTERFACE CONTRACT (the server, offline batches and the tests code against this; the engine
helper fills in the bodies and may add private helpers, but keeps these names and meanings):

    engine = BatchEngine(model, eos_token_ids={2}, pad_token_id=0, max_batch_size=32)
    seq = engine.submit(prompt_ids, SamplingParams(max_new_tokens=16, temperature=0.0))
    for event in seq:            # blocks; one TokenEvent per generated token
        ...                      # event.finish_reason is set on the last one
    seq.cancel()                 # from any thread: leaves the batch at the next step
    engine.close()

A sequence's greedy tokens equal the tokens it gets alone (`model.generate`, greedy).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    """Per-sequence sampling; each sequence keeps its own, whatever else is in the batch."""

    max_new_tokens: int
    temperature: float = 0.0          # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0                    # 0 = off
    seed: int | None = None           # a per-sequence torch.Generator: same seed, same tokens
    presence_penalty: float = 0.0     # OpenAI semantics, applied to the logits before sampling
    frequency_penalty: float = 0.0
    logprobs: int | None = None       # None: no logprobs; k >= 0: the chosen token's + top k alternatives
    prompt_logprobs: bool = False     # also the logprob of every prompt token (for OpenAI `echo`)


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float                                 # log-softmax of the raw logits (before sampling transforms)
    top: tuple[tuple[int, float], ...] = ()        # the k most likely (token, logprob), best first


@dataclass(frozen=True)
class TokenEvent:
    token: int
    logprob: TokenLogprob | None                   # set when SamplingParams.logprobs is not None
    finish_reason: str | None                      # None until the last event: "stop" (EOS), "length", "cancelled"


class Sequence:
    """One submitted request. Iterate it (from one consumer thread) for its TokenEvents."""

    prompt_tokens: int
    prompt_logprobs: list[TokenLogprob | None] | None   # filled after prefill when asked (first is None)

    def __iter__(self) -> Iterator[TokenEvent]:
        raise NotImplementedError

    def cancel(self, reason: str = "cancelled") -> None:
        """Leave the batch at the next step (a disconnect, or a stop string the caller found);
        the iterator ends with a last event whose finish_reason is `reason`."""
        raise NotImplementedError


class BatchEngine:
    """A background thread that steps all running sequences together, admitting new ones between steps."""

    def __init__(self, model, *, eos_token_ids: set[int], pad_token_id: int, max_batch_size: int = 32,
                 kv_cache_budget: int | str | None = "auto"):
        raise NotImplementedError

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        """Thread-safe. Raises InvalidOption for an empty prompt or one beyond the model's context."""
        raise NotImplementedError

    def close(self) -> None:
        """Finish (cancel) every sequence and stop the thread."""
        raise NotImplementedError
