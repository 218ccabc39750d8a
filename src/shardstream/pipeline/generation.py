"""Generation over the deployed pipeline with the surface of a transformers model that the CLI and
the OpenAI server call: `generate(...)`, `config`, `generation_config`, and the `engine` that runs
every request (pipeline/engine.py: requests in flight, recovery and replay).
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, GenerationConfig, StoppingCriteriaList, StopStringCriteria

from ..errors import InvalidOption
from ..serving.protocol import NO_TOKEN, SamplingParams
from .coordinator import Coordinator
from .engine import PipelineEngine


class PipelineModel:
    def __init__(self, coordinator: Coordinator, reply_host: str):
        self.coordinator = coordinator
        self.store = coordinator.store
        self.reply_host = reply_host
        self.generation_config = _generation_config(self.store.root)
        context = coordinator.options.context_length
        self.config = AutoConfig.from_pretrained(self.store.root)
        # the OpenAI server checks prompts and max_tokens against this: KV memory was planned for --context-length
        self.config.max_position_embeddings = min(context, getattr(self.config, "max_position_embeddings", None) or context)
        self.engine = PipelineEngine(coordinator, reply_host, eos_token_ids=set(self.generation_config.eos_token_id or []),
                                     context_length=context, vocabulary=self.config.get_text_config().vocab_size)

    @property
    def recoveries(self) -> int:
        return self.engine.recoveries

    @property
    def last_timings(self) -> list[list]:
        return self.engine.last_timings

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int = 16, do_sample: bool = False,
                 temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, streamer=None,
                 stopping_criteria: StoppingCriteriaList | None = None, stop_strings: list[str] | None = None,
                 tokenizer=None, **ignored) -> torch.Tensor:
        """Prompt + new tokens, [1, n]; stops at an end-of-sequence token, a stop string (with
        `tokenizer`), or when `stopping_criteria` says so, like transformers does. Sampling draws its
        seed from torch's generator, so `torch.manual_seed` makes it repeatable. (`attention_mask`,
        `pad_token_id`: one unpadded sequence needs neither.)"""
        if input_ids.shape[0] != 1:
            raise InvalidOption(f"the pipeline generates one sequence per call, not a batch of {input_ids.shape[0]}; "
                                "submit each to `engine` to run them together.")
        if stop_strings:
            stopping_criteria = StoppingCriteriaList([*(stopping_criteria or []), StopStringCriteria(tokenizer, stop_strings)])
        params = SamplingParams(max_new_tokens, temperature, top_p, top_k, int(torch.randint(2**62, ()))) if do_sample \
            else SamplingParams(max_new_tokens)
        tokens = input_ids[0].tolist()
        sequence = self.engine.submit(tokens, params)
        if streamer is not None:
            streamer.put(input_ids.cpu())
        try:
            for event in sequence:
                if event.token == NO_TOKEN:
                    break
                tokens.append(event.token)
                if streamer is not None:
                    streamer.put(torch.tensor([event.token]))
                if stopping_criteria and bool(stopping_criteria(torch.tensor([tokens]), None).any()):
                    break
        finally:
            sequence.cancel()   # a no-op once it finished; else it leaves the pipeline at its next step
            if streamer is not None:
                streamer.end()
        return torch.tensor([tokens])

    def close(self) -> None:
        self.engine.close()


def _generation_config(root) -> GenerationConfig:
    try:
        config = GenerationConfig.from_pretrained(root)
    except OSError:
        config = GenerationConfig.from_model_config(AutoConfig.from_pretrained(root))
    if isinstance(config.eos_token_id, int):
        config.eos_token_id = [config.eos_token_id]
    return config
