"""Generation over the deployed pipeline, with the surface of a transformers model that the
OpenAI-compatible server (`stream/server.py`) and the CLI call: `generate(...)`, `check_length(...)`.

The coordinator holds the tokens; each step sends the new ones to the first stage and waits for
the last stage's logits. While it waits it checks the stages' health, so a dead agent is noticed
within about a second; then the coordinator re-plans and the request is replayed on the new plan
(one prefill of prompt + tokens generated so far), which rebuilds every KV cache.
"""

from __future__ import annotations

import threading
import time
import uuid

import torch
import zmq
from transformers import (AutoConfig, GenerationConfig, LogitsProcessorList, StoppingCriteriaList, StopStringCriteria,
                          TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from ..errors import InvalidOption, ShardstreamError, SourceUnreachable
from .coordinator import Coordinator, Route
from .transport import Inbox, Outbox

POLL_SECONDS = 0.5
HEALTH_TIMEOUT = 0.5
STEP_TIMEOUT = 600.0


class AgentLost(SourceUnreachable):
    """An agent of the current route stopped answering during a step."""

    def __init__(self, name: str, url: str):
        super().__init__(f"agent {name} at {url} stopped answering its health check during generation.")
        self.name = name


class PipelineModel:
    def __init__(self, coordinator: Coordinator, reply_host: str):
        self.coordinator = coordinator
        self.store = coordinator.store
        self.generation_config = _generation_config(self.store.root)
        self._context = zmq.Context()
        self._inbox = Inbox(self._context, "tcp://*:0")
        self._outbox = Outbox(self._context)
        self.reply_host = reply_host
        self._reply = f"tcp://{reply_host}:{self._inbox.port}"
        self._lock = threading.Lock()
        self.recoveries = 0
        self.last_timings: list[list] = []  # [agent, seconds] per stage of the last step

    # -- the transformers surface ------------------------------------------------------------

    def check_length(self, input_ids: torch.Tensor | None, new_tokens: int) -> None:
        """Refuse what the planned context cannot hold: KV memory was budgeted for that many tokens."""
        limit = self.coordinator.options.context_length
        if input_ids is not None and input_ids.shape[-1] + new_tokens > limit:
            raise InvalidOption(f"the prompt ({input_ids.shape[-1]} tokens) plus {new_tokens} new tokens exceeds the "
                                f"pipeline's --context-length of {limit}; ask for fewer tokens or re-plan with more.")

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int = 16, do_sample: bool = False,
                 temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, streamer=None,
                 stopping_criteria: StoppingCriteriaList | None = None, stop_strings: list[str] | None = None,
                 tokenizer=None, **ignored) -> torch.Tensor:
        """Prompt + new tokens, [1, n]; stops at an end-of-sequence token, a stop string (with
        `tokenizer`), or when `stopping_criteria` says so, like transformers does. (`attention_mask`,
        `pad_token_id`: one unpadded sequence needs neither.)"""
        if input_ids.shape[0] != 1:
            raise InvalidOption(f"the pipeline generates one sequence at a time, not a batch of {input_ids.shape[0]}.")
        self.check_length(input_ids, max_new_tokens)
        if stop_strings:
            stopping_criteria = StoppingCriteriaList([*(stopping_criteria or []), StopStringCriteria(tokenizer, stop_strings)])
        warpers = [TemperatureLogitsWarper(temperature), TopPLogitsWarper(top_p)] + ([TopKLogitsWarper(top_k)] if top_k else [])
        warp = LogitsProcessorList(warpers if do_sample else [])
        tokens = input_ids[0].tolist()
        if streamer is not None:
            streamer.put(input_ids.cpu())
        with self._lock:
            try:
                self.coordinator.readmit()   # lost agents that answer again rejoin before the request starts
                self._decode(tokens, max_new_tokens, warp, do_sample, streamer, stopping_criteria)
            finally:
                if streamer is not None:
                    streamer.end()
        return torch.tensor([tokens])

    def _decode(self, tokens: list[int], new: int, warp: LogitsProcessorList, sample: bool, streamer,
                stop: StoppingCriteriaList | None) -> None:
        session, cached, eos = uuid.uuid4().hex, 0, set(self.generation_config.eos_token_id or [])
        route = self.coordinator.route
        target = len(tokens) + new
        try:
            while len(tokens) < target:
                try:
                    logits = self._step(route, session, len(tokens), cached, torch.tensor([tokens[cached:]]))
                except AgentLost as lost:
                    route = self.coordinator.recover(lost.name)
                    self.recoveries += 1
                    session, cached = uuid.uuid4().hex, 0  # replay: prefill everything on the new plan
                    continue
                cached = len(tokens)
                scores = warp(torch.tensor([tokens]), logits.float())
                token = int(torch.multinomial(scores.softmax(-1), 1)) if sample else int(scores.argmax(-1))
                tokens.append(token)
                if streamer is not None:
                    streamer.put(torch.tensor([token]))
                if token in eos or (stop and bool(stop(torch.tensor([tokens]), None).any())):
                    break
        finally:
            self._end(route, session)

    # -- one step over the data plane -------------------------------------------------------

    def _step(self, route: Route, session: str, step: int, position: int, ids: torch.Tensor) -> torch.Tensor:
        header = {"session": session, "step": step, "epoch": route.epoch, "position": position,
                  "kind": "forward", "route": route.endpoints[1:], "reply": self._reply}
        try:
            self._outbox.send(route.endpoints[0], header, ids)
        except zmq.ZMQError:
            raise self._lost(route) or SourceUnreachable(f"the first stage at {route.endpoints[0]} took no data; "
                                                         "check the agent's data port.") from None
        deadline = time.monotonic() + STEP_TIMEOUT
        while time.monotonic() < deadline:
            received = self._inbox.receive(POLL_SECONDS)
            if received is None:
                lost = self._lost(route)
                if lost:
                    raise lost
                continue
            answer, tensor = received
            if (answer["session"], answer["step"], answer["epoch"]) != (session, step, route.epoch):
                continue  # a late answer to a step of an abandoned session or plan
            if answer["kind"] == "error":
                raise self._lost(route) or ShardstreamError(answer["message"])
            self.last_timings = answer["timings"]
            return tensor
        raise ShardstreamError(f"no answer from the pipeline in {STEP_TIMEOUT:.0f} s though every agent is healthy; "
                               "check the agents' logs.")

    def _lost(self, route: Route) -> AgentLost | None:
        for agent in route.agents:
            if not agent.alive(HEALTH_TIMEOUT):
                return AgentLost(agent.name, agent.url)
        return None

    def _end(self, route: Route, session: str) -> None:
        """Free the session's KV caches; best effort, a dead stage has nothing to free."""
        header = {"session": session, "step": -1, "epoch": route.epoch, "position": 0, "kind": "end",
                  "route": [], "reply": self._reply}
        for endpoint in route.endpoints:
            try:
                self._outbox.send(endpoint, header, torch.empty(0))
            except zmq.ZMQError:
                pass

    def close(self) -> None:
        self._outbox.close()
        self._inbox.close()
        self._context.term()


def _generation_config(root) -> GenerationConfig:
    try:
        config = GenerationConfig.from_pretrained(root)
    except OSError:
        config = GenerationConfig.from_model_config(AutoConfig.from_pretrained(root))
    if isinstance(config.eos_token_id, int):
        config.eos_token_id = [config.eos_token_id]
    return config
