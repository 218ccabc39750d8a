"""OpenAI-compatible HTTP server over an engine that runs sequences: `/v1/completions`,
`/v1/chat/completions` (server-sent events when `stream` is true), `/v1/models`, `/health`.

No lock: every choice of every request (`n`, prompt lists) is one engine Sequence, and the batch
engine steps all of them together. `stop` strings are found here, in the decoded text; the sequence
is then cancelled with reason "stop" and, as in OpenAI's API, the stop string is left out. A client
that goes away cancels its sequences, so they leave the batch at the next step.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from transformers import PreTrainedTokenizerBase

from .openai_api import (DEFAULT_MAX_REQUEST_BYTES, HEALTH_PATH, APIError, BodyLimit, ChatRequest,
                         CompletionRequest, api_error, check_model, install_api_key, install_errors)
from .protocol import NO_TOKEN, SamplingParams, TokenEvent, TokenLogprob
from .stops import StopFilter
from .text import chat_prompt

DEFAULT_MAX_TOKENS = 16   # OpenAI's default for /v1/completions


def create_app(model, tokenizer: PreTrainedTokenizerBase, model_id: str, *, engine,
               aliases: tuple[str, ...] = (), api_key: str | None = None, chat_template: str | None = None,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               health: Callable[[], Response] | None = None) -> FastAPI:
    """`engine` runs the sequences: a BatchEngine (`serve`) or the pipeline's PipelineEngine; `model`
    gives the context length (`config.max_position_embeddings`) and the vocabulary (`config.vocab_size`);
    `health` answers /health where being up is not being ready (the pipeline's coordinator, while it
    deploys its stages)."""
    served = [model_id, *[alias for alias in aliases if alias != model_id]]
    config = getattr(model, "config", None)
    limit = getattr(config, "max_position_embeddings", None)
    vocabulary = min(len(tokenizer), getattr(config, "vocab_size", None) or len(tokenizer))
    longest = max(map(len, tokenizer.get_vocab()))   # characters of the longest token
    app = FastAPI(title="shardstream")
    install_errors(app)
    app.add_middleware(BodyLimit, limit=max_request_bytes)
    install_api_key(app, api_key)

    @app.get(HEALTH_PATH, response_model=None)
    def health_check() -> dict | Response:
        return health() if health is not None else {"status": "ok"}

    @app.get("/v1/models")
    def models() -> dict:
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "shardstream"}
                                           for name in served]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        body.refuse_unsupported()
        check_model(body.model, served)
        sent = body.prompts()
        for i, p in enumerate(sent):
            param = "prompt" if len(sent) == 1 else f"prompt[{i}]"
            if isinstance(p, str):
                _check_characters(len(p), param, limit, longest)
            else:
                _check_ids(p, param, vocabulary)
        prompts = [tokenizer(p)["input_ids"] if isinstance(p, str) else p for p in sent]
        if not all(prompts):
            raise APIError(400, "prompt gives no tokens (the tokenizer knows none of its characters); give some "
                           "text to continue.", "prompt")
        # what echo gives back: a text prompt as sent (decoding its ids would add the tokenizer's BOS, "<s>"),
        # token ids decoded as generated text is (special tokens left out)
        texts = [p if isinstance(p, str) else tokenizer.decode(ids, skip_special_tokens=True)
                 for p, ids in zip(sent, prompts)] if body.echo else None
        return await _respond(request, body, prompts, body.max_tokens, _Reply(served[0], chat=False, echo=body.echo),
                              logprobs=body.logprobs, texts=texts)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        body.refuse_unsupported()
        check_model(body.model, served)
        messages = [{"role": m.role, "content": m.text(i)} for i, m in enumerate(body.messages)]
        _check_characters(sum(len(m["content"]) for m in messages), "messages", limit, longest)
        prompt = chat_prompt(tokenizer, messages, chat_template)
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        max_tokens = body.max_tokens if body.max_completion_tokens is None else body.max_completion_tokens
        if max_tokens is None and limit:
            max_tokens = max(1, limit - len(ids))   # OpenAI's chat default: as much as the context holds
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        return await _respond(request, body, [ids], max_tokens, _Reply(served[0], chat=True), logprobs=logprobs)

    async def _respond(request: Request, body, prompts: list[list[int]], max_tokens: int | None, reply: _Reply,
                       logprobs: int | None, texts: list[str] | None = None):
        max_tokens = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
        # max_tokens 0 (with echo) scores the prompt: its one pass also picks a token, which is left out
        run_tokens = max(max_tokens, 1)
        for ids in prompts:
            _check_context(len(ids), run_tokens, limit)
        echo = reply.echo
        reply.logprobs = logprobs is not None
        choices = []
        try:
            for p, ids in enumerate(prompts):
                for j in range(body.n):
                    params = SamplingParams(
                        max_new_tokens=run_tokens, temperature=body.temperature, top_p=body.top_p,
                        seed=None if body.seed is None else body.seed + j,
                        presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                        logprobs=logprobs, prompt_logprobs=echo and logprobs is not None)
                    choices.append(_Choice(len(choices), ids, texts[p] if texts else "", engine.submit(ids, params),
                                           StopFilter(body.stop), keep=max_tokens > 0))
        except BaseException:
            for choice in choices:
                choice.sequence.cancel()
            raise
        usage = _Usage(sum(len(ids) for ids in prompts))
        request.state.tokens = usage.prompt
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(_stream(request, choices, reply, usage, include_usage),
                                     media_type="text/event-stream")
        async for choice, event in _events(choices, request):
            _advance(choice, event, tokenizer)
        usage.completion = sum(c.count for c in choices)
        request.state.tokens = usage.total
        return reply.whole([reply.choice(c, tokenizer) for c in choices], usage)

    async def _stream(request: Request, choices: list[_Choice], reply: _Reply, usage: _Usage,
                      include_usage: bool) -> AsyncIterator[str]:
        for choice in choices:
            yield _event(reply.chunk(reply.first_delta(choice, tokenizer)))
        try:
            async for choice, event in _events(choices, request, watch=False):
                piece, entries = _advance(choice, event, tokenizer)
                if piece or entries or choice.finish:
                    yield _event(reply.chunk(reply.delta(choice, piece, entries, tokenizer)))
        except Exception as error:  # the status is already sent: say it in the stream
            yield _event(api_error(error).body)
        finally:   # also when the client disconnected: the request log counts what was generated
            usage.completion = sum(c.count for c in choices)
            request.state.tokens = usage.total
        if include_usage:
            yield _event({**reply.head("chunk"), "choices": [], "usage": usage.body()})
        yield "data: [DONE]\n\n"

    return app


def _check_ids(ids: list[int], param: str, vocabulary: int) -> None:
    bad = next((i for i, token in enumerate(ids) if not 0 <= token < vocabulary), None)
    if bad is not None:
        raise APIError(400, f"{param} has token id {ids[bad]} at position {bad}, outside this model's vocabulary "
                       f"(ids 0 to {vocabulary - 1}); send ids the model's tokenizer gives.", param, "invalid_value")


def _check_characters(count: int, param: str, limit: int | None, longest: int) -> None:
    """Refuse text too long for the context before tokenizing it (a tokenizer takes seconds and a
    Python int per token for megabytes). No token spans more than `longest` characters, twice that
    where a normalizer composes a letter and its accent into one."""
    if limit and count > 2 * longest * limit:
        raise APIError(400, f"{param} has {count} characters, more than this model's context of {limit} tokens "
                       "can hold; shorten the prompt.", param, "context_length_exceeded")


def _check_context(length: int, max_tokens: int, limit: int | None) -> None:
    if not limit:
        return
    if length >= limit:
        raise APIError(400, f"the prompt has {length} tokens but this model's context is {limit} tokens; "
                       "shorten the prompt.", "prompt", "context_length_exceeded")
    if length + max_tokens > limit:
        raise APIError(400, f"the prompt has {length} tokens and max_tokens asks for {max_tokens} more, beyond this "
                       f"model's context of {limit} tokens; set max_tokens to at most {limit - length}.",
                       "max_tokens", "context_length_exceeded")


@dataclass
class _Choice:
    """One sequence's progress: tokens so far, text sent, stop strings, logprobs."""

    index: int
    prompt_ids: list[int]
    prompt_text: str          # what `echo` gives back
    sequence: object
    stops: StopFilter
    keep: bool = True         # False when max_tokens is 0: the token the scoring pass picked is left out
    ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    decoded: int = 0          # characters of decode(ids) already passed to the stop filter
    text: str = ""            # what the client gets (stop strings left out)
    finish: str | None = None

    @property
    def count(self) -> int:
        return len(self.ids)


@dataclass
class _Usage:
    prompt: int
    completion: int = 0

    @property
    def total(self) -> int:
        return self.prompt + self.completion

    def body(self) -> dict:
        return {"prompt_tokens": self.prompt, "completion_tokens": self.completion, "total_tokens": self.total}


async def _events(choices: list[_Choice], request: Request,
                  watch: bool = True) -> AsyncIterator[tuple[_Choice, TokenEvent]]:
    """Every choice's events as they come. Each sequence is read in its own thread; when the client
    disconnects (watched for whole replies; a streamed reply is closed by the server) or the consumer
    stops, the unfinished sequences are cancelled and leave the batch at the next step."""
    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue = asyncio.Queue()

    def pump(choice: _Choice) -> None:
        try:
            for event in choice.sequence:
                loop.call_soon_threadsafe(inbox.put_nowait, (choice, event))
            loop.call_soon_threadsafe(inbox.put_nowait, (choice, None))
        except BaseException as error:
            loop.call_soon_threadsafe(inbox.put_nowait, (choice, error))

    async def watch_disconnect() -> None:
        """The body is read, so the next message the server receives is the client going away."""
        while (await request.receive())["type"] != "http.disconnect":
            pass
        inbox.put_nowait((None, None))

    for choice in choices:
        threading.Thread(target=pump, args=(choice,), daemon=True).start()
    watcher = asyncio.create_task(watch_disconnect()) if watch else None
    pending = len(choices)
    try:
        while pending:
            choice, item = await inbox.get()
            if choice is None:
                return
            if item is None:
                pending -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield choice, item
    finally:
        if watcher is not None:
            watcher.cancel()
        for choice in choices:
            if choice.finish is None:
                choice.sequence.cancel()


def _advance(choice: _Choice, event: TokenEvent, tokenizer: PreTrainedTokenizerBase) -> tuple[str, list[TokenLogprob]]:
    """Take one event: the new text to send (stop strings held back or cut) and its logprob entries."""
    entries = []
    if event.token != NO_TOKEN and choice.keep:
        choice.ids.append(event.token)
        if event.logprob is not None:
            entries.append(event.logprob)
            choice.logprobs.append(event.logprob)
    full = tokenizer.decode(choice.ids, skip_special_tokens=True)
    ready = full if event.finish_reason or not full.endswith("\ufffd") else full[:choice.decoded]
    piece = choice.stops.feed(ready[choice.decoded:])
    choice.decoded = len(ready)
    if choice.stops.stopped and event.finish_reason is None:
        choice.sequence.cancel("stop")
    if event.finish_reason is not None:
        piece += choice.stops.flush()
        choice.finish = "stop" if choice.stops.stopped else event.finish_reason
    choice.text += piece
    return piece, entries


def _event(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"


class _Reply:
    """OpenAI response bodies for one request: whole, or chunk by chunk; logprobs in each API's shape."""

    def __init__(self, model_id: str, chat: bool, echo: bool = False):
        self.model_id, self.chat, self.echo = model_id, chat, echo
        self.logprobs = False
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def head(self, kind: str) -> dict:
        name = {"whole": "chat.completion", "chunk": "chat.completion.chunk"}[kind] if self.chat else "text_completion"
        return {"id": self.id, "object": name, "created": self.created, "model": self.model_id}

    def whole(self, choices: list[dict], usage: _Usage) -> dict:
        return {**self.head("whole"), "choices": choices, "usage": usage.body()}

    def chunk(self, choice: dict) -> dict:
        return {**self.head("chunk"), "choices": [choice]}

    def choice(self, choice: _Choice, tokenizer: PreTrainedTokenizerBase) -> dict:
        if self.chat:
            return {"index": choice.index, "message": {"role": "assistant", "content": choice.text},
                    "logprobs": self._chat_logprobs(choice.logprobs, tokenizer) if self.logprobs else None,
                    "finish_reason": choice.finish}
        prefix = choice.prompt_text if self.echo else ""
        entries, tokens, echoed = list(choice.logprobs), choice.ids, []
        if self.echo and choice.sequence.prompt_logprobs is not None:
            entries = [*choice.sequence.prompt_logprobs, *entries]
            echoed = choice.prompt_ids
        logprobs = self._completion_logprobs(entries, tokens, tokenizer, len(prefix), echoed) \
            if self.logprobs else None
        return {"index": choice.index, "text": prefix + choice.text, "logprobs": logprobs,
                "finish_reason": choice.finish}

    def first_delta(self, choice: _Choice, tokenizer: PreTrainedTokenizerBase) -> dict:
        """The first chunk of each choice: the assistant role (chat), the echoed prompt (completions)."""
        if self.chat:
            return {"index": choice.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                    "finish_reason": None}
        return {"index": choice.index, "text": choice.prompt_text if self.echo else "",
                "logprobs": None, "finish_reason": None}

    def delta(self, choice: _Choice, piece: str, entries: list[TokenLogprob], tokenizer) -> dict:
        tokens = [e.token for e in entries]
        if self.chat:
            logprobs = self._chat_logprobs(entries, tokenizer) if entries else None
            return {"index": choice.index, "delta": {"content": piece}, "logprobs": logprobs,
                    "finish_reason": choice.finish}
        start = (len(choice.prompt_text) if self.echo else 0) + len(choice.text) - len(piece)
        logprobs = self._completion_logprobs(entries, tokens, tokenizer, start) if entries else None
        return {"index": choice.index, "text": piece, "logprobs": logprobs, "finish_reason": choice.finish}

    @staticmethod
    def _completion_logprobs(entries: list[TokenLogprob | None], tokens: list[int], tokenizer, start: int,
                             echoed: Sequence[int] = ()) -> dict:
        """The legacy API's logprobs of the `echoed` prompt tokens then `tokens`. `text_offset` is where each
        starts in the choice's text: the echoed prompt's from 0 (a special token the tokenizer added, such
        as BOS, takes no characters there), the generated ones from `start`."""
        offsets = []
        for ids, at in ((echoed, 0), (tokens, start)):
            for t in ids:
                offsets.append(at)
                at += len(tokenizer.decode([t], skip_special_tokens=True))
        strings = [tokenizer.decode([t]) for t in [*echoed, *tokens]]
        return {"tokens": strings,
                "token_logprobs": [e.logprob if e else None for e in entries],
                "top_logprobs": [{tokenizer.decode([t]): lp for t, lp in e.top} if e else None for e in entries],
                "text_offset": offsets}

    @staticmethod
    def _chat_logprobs(entries: list[TokenLogprob], tokenizer) -> dict:
        def one(token: int, logprob: float) -> dict:
            text = tokenizer.decode([token])
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
                            for e in entries]}
