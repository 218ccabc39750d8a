"""Requests in flight over the deployed pipeline, behind the batch engine's interface
(`submit(prompt_ids, SamplingParams) -> Sequence`, `close()`), so the OpenAI server serves it as is.

One scheduler thread keeps every active sequence's next step on the data plane: it sends a step
without waiting, and whenever a last stage's logits come back (tagged with session, step and plan
epoch) it picks that sequence's token with its own sampling parameters and sends its next step at
once. With S stages and S or more sequences, every stage has work: stage 0 runs one sequence while
stage 1 runs another. Each agent still runs one session's step at a time (no micro-batching; why:
docs/ARCHITECTURE.md). At most `MAX_SESSIONS` sequences are active, the KV caches a stage keeps;
the rest wait in order. When an agent of the route stops answering, the coordinator re-plans and
every active sequence is replayed on the new route (one prefill of prompt + tokens so far); when an
agent answers that its stage is gone (`StageGone`: it was restarted, or another coordinator took
it over), the coordinator re-deploys and replays the same way. What cannot be recovered fails its
sequences with `PipelineUnavailable` (the API's 503). Agents that ask to join are taken in between
requests: new requests wait until those in flight are done, then the model is re-planned.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass

import torch
import zmq

from ..errors import InvalidOption, PipelineUnavailable, ShardstreamError, SourceUnreachable, StageGone
from ..serving.protocol import (NO_TOKEN, SamplingParams, Sequence, TokenEvent, cancel_all, choose_token, open_sequence,
                                prompt_scores)
from .client import AgentClient
from .coordinator import Coordinator, Route
from .stage import MAX_SESSIONS
from .transport import Inbox, Outbox

log = logging.getLogger(__name__)

POLL_SECONDS = 0.5     # without any answer for this long, the route's agents are health-checked
HEALTH_TIMEOUT = 0.5
STEP_TIMEOUT = 600.0   # a step unanswered this long, every agent healthy, fails its sequence
TICK_SECONDS = 0.02    # how often a busy scheduler looks at new and cancelled requests


class AgentLost(SourceUnreachable):
    """An agent of the current route stopped answering during a step."""

    def __init__(self, name: str, url: str):
        super().__init__(f"agent {name} at {url} stopped answering its health check during generation.")
        self.name = name


@dataclass
class _Active:
    """A sequence on the pipeline: its session on the current route and its step in flight."""

    sequence: Sequence
    session: str
    epoch: int = -1          # the plan epoch its step was sent on
    cached: int = 0          # tokens the stages' KV caches hold for this session
    sent_at: float = 0.0

    @property
    def tokens(self) -> list[int]:
        return [*self.sequence.prompt_ids, *self.sequence.generated]


class PipelineEngine:
    """The scheduler thread; counters for benchmarks and tests: `recoveries`, `tokens_generated`,
    `peak_active` (most sequences in flight at once), `busy_seconds` (compute seconds per agent, from
    the stages' timings) and `last_timings`."""

    def __init__(self, coordinator: Coordinator, reply_host: str, *, eos_token_ids: set[int], context_length: int,
                 vocabulary: int, max_active: int = MAX_SESSIONS):
        if not 1 <= max_active <= MAX_SESSIONS:
            raise InvalidOption(f"max_active must be between 1 and {MAX_SESSIONS} (the KV sessions a stage keeps), "
                                f"not {max_active}.")
        self.coordinator = coordinator
        self.eos_token_ids = set(eos_token_ids)
        self.context_length = context_length
        self.vocabulary = vocabulary
        self.max_active = max_active
        self.recoveries = 0
        self.tokens_generated = 0
        self.peak_active = 0
        self.busy_seconds: dict[str, float] = {}
        self.last_timings: list[list] = []   # [agent, seconds] per stage of the last answered step
        self._context = zmq.Context()
        self._inbox = Inbox(self._context, "tcp://*:0")
        self._outbox = Outbox(self._context)
        self._reply = f"tcp://{reply_host}:{self._inbox.port}"
        self._waiting: deque[Sequence] = deque()
        self._active: dict[str, _Active] = {}     # by session
        self._joins: deque[tuple[AgentClient, Future]] = deque()   # agents asking to join, with who waits
        self._condition = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="pipeline-engine", daemon=True)
        self._thread.start()

    # -- the engine interface ----------------------------------------------------------------

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        """Thread-safe. Refuses what the planned context cannot hold (KV memory was budgeted for
        --context-length tokens)."""
        if self.coordinator.route is None:   # the API listens while the stages are still being deployed
            raise PipelineUnavailable("the pipeline is still deploying its stages; retry in a moment.")
        sequence = open_sequence(prompt_ids, params, self.vocabulary, "cpu", self._notify)
        if len(prompt_ids) + params.max_new_tokens > self.context_length:
            raise InvalidOption(f"the prompt ({len(prompt_ids)} tokens) plus {params.max_new_tokens} new tokens exceeds "
                                f"the pipeline's --context-length of {self.context_length}; ask for fewer tokens or "
                                "re-plan with more.")
        with self._condition:
            if self._closed:
                raise InvalidOption("the pipeline engine is closed; submit to an open one.")
            self._waiting.append(sequence)
            self._condition.notify()
        return sequence

    def join(self, agent: AgentClient, timeout: float) -> Route:
        """Thread-safe: have the coordinator take in `agent` and re-plan, once no request is in
        flight (new ones wait meanwhile); the new route, or the reason it failed."""
        done: Future = Future()
        with self._condition:
            if self.coordinator.route is None:
                raise PipelineUnavailable("the pipeline is still deploying its first plan; join again in a moment.")
            if self._closed:
                raise PipelineUnavailable("the pipeline is shutting down; join another coordinator.")
            self._joins.append((agent, done))
            self._condition.notify()
        return done.result(timeout)

    def close(self) -> None:
        """Cancel every sequence, stop the thread, close the sockets."""
        with self._condition:
            self._closed = True
            self._condition.notify()
        self._thread.join()
        cancel_all([*self._waiting, *(a.sequence for a in self._active.values())])
        self._outbox.close()
        self._inbox.close()
        self._context.term()

    # -- the loop ----------------------------------------------------------------------------

    def _notify(self) -> None:
        with self._condition:
            self._condition.notify()

    def _loop(self) -> None:
        answered = time.monotonic()
        while True:
            with self._condition:
                while not (self._closed or self._waiting or self._active or self._joins):
                    self._condition.wait()
                if self._closed:
                    return
            try:
                self._admit()
                received = self._inbox.receive(TICK_SECONDS) if self._active else None
                if received is not None:
                    answered = time.monotonic()
                    self._answer(*received)
                elif self._active and time.monotonic() - answered > POLL_SECONDS:
                    answered = time.monotonic()
                    self._check_route()
            except (AgentLost, StageGone) as fault:
                self._recover(fault)
                answered = time.monotonic()
            except Exception as error:  # noqa: BLE001 - a broken loop fails every sequence, not silently
                log.exception("the pipeline scheduler failed; failing every active sequence")
                self._fail_all(error)

    def _admit(self) -> None:
        """Start waiting sequences while fewer than `max_active` run; drop cancelled ones. While an
        agent waits to join, nothing new starts: it is taken in once the requests in flight are done."""
        started: list[Sequence] = []
        with self._condition:
            for sequence in [s for s in self._waiting if s.cancel_reason]:
                self._waiting.remove(sequence)
                sequence.emit(TokenEvent(NO_TOKEN, None, sequence.cancel_reason))
            if self._joins and self._active:
                return
            joins = list(self._joins)
            self._joins.clear()
            while self._waiting and len(self._active) + len(started) < self.max_active:
                started.append(self._waiting.popleft())
        for agent, done in joins:
            try:
                done.set_result(self.coordinator.join(agent))
            except Exception as error:  # noqa: BLE001 - whoever asked is told why
                done.set_exception(error)
        if not started:
            return
        if not self._active:   # lost agents that answer again rejoin while nothing is in flight
            try:
                self.coordinator.readmit()
            except Exception as error:  # noqa: BLE001 - no plan to run on: these requests say why
                for sequence in started:
                    sequence.fail(_unavailable(error))
                return
        pending = [_Active(sequence, uuid.uuid4().hex) for sequence in started]
        self._active.update((active.session, active) for active in pending)
        self.peak_active = max(self.peak_active, len(self._active))
        for active in pending:
            self._send(active)

    def _answer(self, header: dict, tensor: torch.Tensor) -> None:
        active = self._active.get(header["session"])
        if active is None or (header["epoch"], header["step"]) != (active.epoch, len(active.tokens)):
            return   # a late answer for a finished, cancelled or replayed session
        if header["kind"] == "error":
            lost = self._lost()
            if lost:
                raise lost
            if header.get("error") == StageGone.__name__:
                raise StageGone(header["message"])
            self._finish(active, error=ShardstreamError(header["message"]))
            return
        self.last_timings = header["timings"]
        for name, seconds in self.last_timings:
            self.busy_seconds[name] = self.busy_seconds.get(name, 0.0) + seconds
        sequence = active.sequence
        active.cached = len(active.tokens)
        if sequence.cancel_reason:
            self._finish(active, TokenEvent(NO_TOKEN, None, sequence.cancel_reason))
            return
        logits = tensor[0]
        if logits.dim() == 2:   # every position's (asked for the prompt's scores): the last one picks the token
            top = sequence.params.logprobs or 0
            sequence.prompt_logprobs = prompt_scores(torch.log_softmax(logits.float(), -1), sequence.prompt_ids, top)
            logits = logits[-1]
        token, logprob = choose_token(sequence, logits)
        sequence.generated.append(token)
        self.tokens_generated += 1
        finish = ("stop" if token in self.eos_token_ids
                  else "length" if len(sequence.generated) >= sequence.params.max_new_tokens else None)
        if finish:
            self._finish(active, TokenEvent(token, logprob, finish))
        else:
            sequence.emit(TokenEvent(token, logprob, None))
            self._send(active)

    def _check_route(self) -> None:
        """No answer for a while: a dead agent is lost; one that no longer holds its stage for this
        coordinator (started again, perhaps on another data port; taken over) makes it re-deploy; a
        step unanswered too long fails its sequence."""
        lost = self._lost()
        if lost:
            raise lost
        route = self.coordinator.route
        for agent, stage_id in zip(route.agents, route.stage_ids):
            try:
                health = agent.get("/v1/health", timeout=HEALTH_TIMEOUT)
            except ShardstreamError:
                raise AgentLost(agent.name, agent.url) from None
            if (health.get("stage_id"), health.get("coordinator")) != (stage_id, self.coordinator.url):
                raise StageGone(f"agent {agent.name} no longer holds its stage for this coordinator (it was started "
                                "again, or serves another coordinator)")
        for active in list(self._active.values()):
            if time.monotonic() - active.sent_at > STEP_TIMEOUT:
                self._finish(active, error=ShardstreamError(
                    f"no answer from the pipeline in {STEP_TIMEOUT:.0f} s though every agent is healthy; "
                    "check the agents' logs."))

    # -- the data plane ----------------------------------------------------------------------

    def _send(self, active: _Active) -> None:
        """The sequence's next step: the tokens its session's caches do not hold yet."""
        route = self.coordinator.route
        tokens = active.tokens
        header = {"session": active.session, "coordinator": self.coordinator.id, "step": len(tokens),
                  "epoch": route.epoch, "position": active.cached,
                  "kind": "forward", "route": route.endpoints[1:], "reply": self._reply}
        sequence = active.sequence
        if sequence.params.prompt_logprobs and sequence.prompt_logprobs is None:
            header["all_logits"] = True   # the last stage answers every position's logits: the prompt's scores
        active.epoch, active.sent_at = route.epoch, time.monotonic()
        try:
            self._outbox.send(route.endpoints[0], header, torch.tensor([tokens[active.cached:]]))
        except zmq.ZMQError:
            raise self._lost() or SourceUnreachable(f"the first stage at {route.endpoints[0]} took no data; "
                                                    "check the agent's data port.") from None

    def _end(self, active: _Active) -> None:
        """Free the session's KV caches; best effort, a dead stage has nothing to free."""
        route = self.coordinator.route
        if route is None or active.epoch != route.epoch:
            return   # that plan's stages were reloaded: their caches are gone
        header = {"session": active.session, "coordinator": self.coordinator.id, "step": -1, "epoch": route.epoch,
                  "position": 0, "kind": "end",
                  "route": [], "reply": self._reply}
        for endpoint in route.endpoints:
            try:
                self._outbox.send(endpoint, header, torch.empty(0))
            except zmq.ZMQError:
                pass

    def _finish(self, active: _Active, event: TokenEvent | None = None, error: BaseException | None = None) -> None:
        del self._active[active.session]
        if error is not None:
            active.sequence.fail(error)
        elif not active.sequence.done:
            active.sequence.emit(event)
        self._end(active)

    def _fail_all(self, error: BaseException) -> None:
        for active in list(self._active.values()):
            self._finish(active, error=error)

    # -- faults ------------------------------------------------------------------------------

    def _lost(self) -> AgentLost | None:
        for agent in self.coordinator.route.agents:
            if not agent.alive(HEALTH_TIMEOUT):
                return AgentLost(agent.name, agent.url)
        return None

    def _recover(self, fault: AgentLost | StageGone) -> None:
        """Re-plan without a lost agent, or re-deploy where a stage is gone, then replay every active
        sequence on the new route; an agent lost during the replay is recovered from the same way."""
        sequences = [active.sequence for active in self._active.values()]
        while True:
            self._active = {}
            try:
                if isinstance(fault, AgentLost):
                    self.coordinator.recover(fault.name)
                else:
                    log.warning("%s; re-deploying", fault)
                    self.coordinator.deploy()
            except Exception as error:  # noqa: BLE001 - nothing left to run on: every sequence says why
                for sequence in sequences:
                    sequence.fail(_unavailable(error))
                return
            self.recoveries += 1
            try:
                for sequence in sequences:
                    if sequence.cancel_reason and not sequence.done:
                        sequence.emit(TokenEvent(NO_TOKEN, None, sequence.cancel_reason))
                    if sequence.done:
                        continue
                    active = _Active(sequence, uuid.uuid4().hex)
                    self._active[active.session] = active
                    self._send(active)
                return
            except AgentLost as again:
                fault = again


def _unavailable(error: Exception) -> PipelineUnavailable:
    """Why the pipeline cannot run a request now: the server's fault (503), not the client's."""
    return error if isinstance(error, PipelineUnavailable) else PipelineUnavailable(str(error))
