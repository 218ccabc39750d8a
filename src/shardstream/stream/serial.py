"""One request at a time through a model's own `generate()`, behind the batch engine's interface.

For models the batch engine cannot step (the pipeline coordinator's `PipelineModel`, which decodes
one sequence over the network): the OpenAI server then serves them with the same code. What needs
per-step logits (logprobs, echo scores, penalties) is refused by name.
"""

from __future__ import annotations

import queue
import threading

import torch
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from ..errors import InvalidOption
from .batching import NO_TOKEN, SamplingParams, TokenEvent


class _Cancelled(StoppingCriteria):
    def __init__(self, sequence: SerialSequence):
        self.sequence = sequence

    def __call__(self, input_ids, scores, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.sequence.cancel_reason is not None, dtype=torch.bool)


class SerialSequence(BaseStreamer):
    """A `generate()` streamer turned into the engine's Sequence: iterate it for TokenEvents."""

    prompt_logprobs = None

    def __init__(self, prompt_ids: list[int]):
        self.prompt_tokens = len(prompt_ids)
        self.cancel_reason: str | None = None
        self._events: queue.Queue = queue.Queue()
        self._skipped_prompt = False

    def put(self, value: torch.Tensor) -> None:
        if not self._skipped_prompt:
            self._skipped_prompt = True
            return
        for token in value.reshape(-1).tolist():
            self._events.put(int(token))

    def end(self) -> None:
        pass

    def cancel(self, reason: str = "cancelled") -> None:
        if self.cancel_reason is None:
            self.cancel_reason = reason

    def __iter__(self):
        previous = None
        while True:
            item = self._events.get()
            if isinstance(item, BaseException):
                raise item
            if isinstance(item, str):   # the finish reason: the last token carries it
                yield TokenEvent(previous if previous is not None else NO_TOKEN, None, item)
                return
            if previous is not None:
                yield TokenEvent(previous, None, None)
            previous = item


class SerialEngine:
    """A lock around `model.generate()`; requests wait for the one before them."""

    def __init__(self, model, *, eos_token_ids: set[int], pad_token_id: int):
        self.model = model
        self.eos_token_ids = eos_token_ids
        self.pad_token_id = pad_token_id
        self._lock = threading.Lock()

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> SerialSequence:
        if params.logprobs is not None or params.prompt_logprobs or params.presence_penalty or params.frequency_penalty:
            raise InvalidOption("this model generates through generate() one request at a time and cannot give "
                                "logprobs, echo scores or presence/frequency penalties; leave them out.")
        sequence = SerialSequence(prompt_ids)
        threading.Thread(target=self._run, args=(sequence, prompt_ids, params), daemon=True).start()
        return sequence

    def _run(self, sequence: SerialSequence, prompt_ids: list[int], params: SamplingParams) -> None:
        options = dict(max_new_tokens=params.max_new_tokens, pad_token_id=self.pad_token_id, streamer=sequence,
                       stopping_criteria=StoppingCriteriaList([_Cancelled(sequence)]))
        if params.temperature == 0:
            options["do_sample"] = False
        else:
            options.update(do_sample=True, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k)
        with self._lock:
            try:
                if params.seed is not None:
                    torch.manual_seed(params.seed)
                output = self.model.generate(torch.tensor([prompt_ids]), **options)
            except Exception as error:  # the server reports it in the reply
                sequence._events.put(error)
                return
        new = output[0, len(prompt_ids):].tolist()
        finish = ("stop" if new and new[-1] in self.eos_token_ids else
                  sequence.cancel_reason or "length")
        sequence._events.put(finish)

    def close(self) -> None:
        pass
