"""What an engine runs and what it sends back: a request's sampling parameters, its sequence (iterated by the
caller for its token events), and the choice of each token. The batch engine (batching.py) and the
pipeline's engine (pipeline/engine.py) run these same sequences, and the server turns their events into
OpenAI replies."""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from ..errors import InvalidOption

NO_TOKEN = -1          # the token of a cancelled sequence's last event: no token was generated


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
    finish_reason: str | None                      # None until the last event: "stop" (EOS), "length" (max_new_tokens,
                                                   # or no memory left for more), "cancelled"


class Sequence:
    """One submitted request. Iterate it (from one consumer thread) for its TokenEvents.

    A cancelled sequence's last event carries no new token: its `token` is NO_TOKEN (skip it).
    """

    prompt_tokens: int
    prompt_logprobs: list[TokenLogprob | None] | None   # filled after prefill when asked (first is None)

    def __init__(self, prompt_ids: list[int], params: SamplingParams, generator: torch.Generator,
                 wake: Callable[[], None]):
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.prompt_tokens = len(self.prompt_ids)
        self.prompt_logprobs = None
        self.generated: list[int] = []
        self.done = False
        self.cancel_reason: str | None = None
        self.generator = generator
        self._wake = wake
        self._events: queue.Queue = queue.Queue()
        self._ended = False

    def __iter__(self) -> Iterator[TokenEvent]:
        while not self._ended:
            item = self._events.get()
            if item is _END:
                self._ended = True
            elif isinstance(item, BaseException):
                self._ended = True
                raise item
            else:
                yield item

    def cancel(self, reason: str = "cancelled") -> None:
        """Leave the batch at the next step (a disconnect, or a stop string the caller found);
        the iterator ends with a last event whose finish_reason is `reason`."""
        if self.cancel_reason is None:
            self.cancel_reason = reason
            self._wake()

    # -- engine side (engine thread only) ----------------------------------------------------

    def emit(self, event: TokenEvent) -> None:
        self._events.put(event)
        if event.finish_reason is not None:
            self.done = True
            self._events.put(_END)

    def fail(self, error: BaseException) -> None:
        if not self.done:
            self.done = True
            self._events.put(error)


_END = object()


def _logprob(logprobs: torch.Tensor, token: int, top: int) -> TokenLogprob:
    best = torch.topk(logprobs, min(top, logprobs.shape[-1])) if top else None
    alternatives = tuple(zip(best.indices.tolist(), best.values.tolist())) if best is not None else ()
    return TokenLogprob(token, logprobs[token].item(), alternatives)


def prompt_scores(logprobs: torch.Tensor, prompt_ids: list[int], top: int) -> list[TokenLogprob | None]:
    """OpenAI's echo scores: None for the first prompt token, then each token's logprob under the
    position before it (`logprobs` [len(prompt_ids), vocab], row i predicting token i + 1)."""
    return [None] + [_logprob(logprobs[i - 1], prompt_ids[i], top) for i in range(1, len(prompt_ids))]


def open_sequence(prompt_ids: list[int], params: SamplingParams, vocabulary: int, device,
                  notify: Callable[[], None]) -> Sequence:
    """A sequence with its own generator, after the checks every engine makes of a request."""
    if not prompt_ids:
        raise InvalidOption("the prompt is empty; give at least one token.")
    if params.max_new_tokens < 1:
        raise InvalidOption(f"max_new_tokens must be at least 1, not {params.max_new_tokens}.")
    if params.temperature < 0 or not 0 < params.top_p <= 1 or params.top_k < 0 or (params.logprobs or 0) < 0:
        raise InvalidOption(f"sampling parameters out of range ({params}); use temperature >= 0, "
                            "0 < top_p <= 1, top_k >= 0 and logprobs >= 0.")
    outside = [t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < vocabulary]
    if outside:
        raise InvalidOption(f"prompt token {outside[0]!r} is not an id of the model's vocabulary "
                            f"(0 to {vocabulary - 1}); tokenize with the model's tokenizer.")
    generator = torch.Generator(device)
    if params.seed is None:
        generator.seed()
    else:
        generator.manual_seed(params.seed)
    return Sequence(prompt_ids, params, generator, notify)


def cancel_all(sequences) -> None:
    """What an engine's close() does to every sequence it still holds."""
    for sequence in sequences:
        if not sequence.done:
            sequence.emit(TokenEvent(NO_TOKEN, None, "cancelled"))


def choose_token(sequence: Sequence, logits: torch.Tensor) -> tuple[int, TokenLogprob | None]:
    """One token for one sequence from its raw logits row, with its own sampling parameters."""
    params = sequence.params
    raw = logits.float()
    scores = raw
    if (params.presence_penalty or params.frequency_penalty) and sequence.generated:
        counts = torch.bincount(torch.tensor(sequence.generated, device=raw.device), minlength=raw.shape[-1])
        counts = counts[: raw.shape[-1]].to(raw.dtype)
        scores = scores - counts * params.frequency_penalty - (counts > 0).to(raw.dtype) * params.presence_penalty
    if params.temperature == 0:
        token = int(torch.argmax(scores))
    else:
        scores = scores / params.temperature
        if params.top_k:
            kth = torch.topk(scores, min(params.top_k, scores.shape[-1])).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if params.top_p < 1.0:
            ordered, order = torch.sort(scores, descending=True)
            probs = torch.softmax(ordered, -1)
            outside = torch.cumsum(probs, -1) - probs > params.top_p  # the first token always stays
            scores = scores.index_fill(0, order[outside], float("-inf"))
        token = int(torch.multinomial(torch.softmax(scores, -1), 1, generator=sequence.generator))
    if params.logprobs is None:
        return token, None
    return token, _logprob(torch.log_softmax(raw, -1), token, params.logprobs)
