"""OpenAI-compatible HTTP server over one streaming model.

`/v1/completions`, `/v1/chat/completions` (with server-sent events when `stream` is true) and
`/v1/models`. One model serves one request at a time (a lock): streaming reads every block per
token, so concurrent requests would only compete for the same disk. `stop` strings end generation
(transformers' `StopStringCriteria`) and, as in OpenAI's API, are not part of the returned text.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field, field_validator
from transformers import PreTrainedTokenizerBase, StoppingCriteriaList, StopStringCriteria, TextIteratorStreamer

from ..errors import ShardstreamError
from .model import StreamingModel
from .text import chat_prompt, encode, sampling_options, set_seed


class _Sampling(BaseModel):
    model: str | None = None
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = None
    stream: bool = False
    stop: str | list[str] | None = Field(None, validate_default=True)

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop: str | list[str] | None) -> list[str]:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > 4 or not all(stops):
            raise ValueError("give at most 4 stop strings, none of them empty")
        return stops


class CompletionRequest(_Sampling):
    prompt: str = Field(min_length=1)


class Message(BaseModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: str


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)


def create_app(model: StreamingModel, tokenizer: PreTrainedTokenizerBase, model_id: str) -> FastAPI:
    app = FastAPI(title="shardstream")
    lock = threading.Lock()

    @app.exception_handler(ShardstreamError)
    async def _user_error(request: Request, error: ShardstreamError) -> JSONResponse:
        return JSONResponse(status_code=400, content={"error": {"message": str(error), "type": "invalid_request_error"}})

    @app.get("/v1/models")
    def models() -> dict:
        return {"object": "list", "data": [{"id": model_id, "object": "model", "owned_by": "shardstream"}]}

    @app.post("/v1/completions")
    def completions(request: CompletionRequest):
        return _respond(request, request.prompt, chat=False)

    @app.post("/v1/chat/completions")
    def chat(request: ChatRequest):
        prompt = chat_prompt(tokenizer, [m.model_dump() for m in request.messages])
        return _respond(request, prompt, chat=True)

    def _respond(request: _Sampling, prompt: str, chat: bool):
        inputs = encode(tokenizer, prompt)
        options = sampling_options(request.max_tokens, request.temperature, request.top_p, tokenizer)
        if request.stop:
            options["stopping_criteria"] = StoppingCriteriaList([StopStringCriteria(tokenizer, request.stop)])
        model.check_length(inputs["input_ids"], request.max_tokens)
        reply = _Reply(model_id, chat)
        if request.stream:
            return StreamingResponse(_stream(inputs, options, request.seed, reply, _StopFilter(request.stop)),
                                     media_type="text/event-stream")
        with lock:
            set_seed(request.seed)
            output = model.generate(**inputs, **options)
        new = output[0, inputs["input_ids"].shape[1]:]
        stops = _StopFilter(request.stop)
        text = stops.feed(tokenizer.decode(new, skip_special_tokens=True)) + stops.flush()
        return reply.whole(text, _finish(new, tokenizer, stops), inputs["input_ids"].shape[1], len(new))

    def _stream(inputs: dict, options: dict, seed: int | None, reply: _Reply, stops: _StopFilter) -> Iterator[str]:
        streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
        failure: list[BaseException] = []
        output = []

        def run() -> None:
            with lock:
                try:
                    set_seed(seed)
                    output.append(model.generate(**inputs, **options, streamer=streamer))
                except Exception as error:  # reported in the stream; the HTTP status is already sent
                    failure.append(error)
                    streamer.end()

        worker = threading.Thread(target=run, daemon=True)
        worker.start()
        for piece in streamer:
            if piece := stops.feed(piece):
                yield _event(reply.chunk(piece, None))
        worker.join()
        if failure:
            yield _event({"error": {"message": str(failure[0]), "type": "server_error"}})
        else:
            new = output[0][0, inputs["input_ids"].shape[1]:]
            yield _event(reply.chunk(stops.flush(), _finish(new, tokenizer, stops)))
        yield "data: [DONE]\n\n"

    return app


def _finish(new_tokens, tokenizer: PreTrainedTokenizerBase, stops: _StopFilter) -> str:
    eos = len(new_tokens) and int(new_tokens[-1]) == tokenizer.eos_token_id
    return "stop" if eos or stops.stopped else "length"


class _StopFilter:
    """Generated text in, the text to send out: everything before the first stop string. Text
    that could still turn out to be the start of a stop string is held back until it cannot."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.stopped = False
        self._held = ""

    def feed(self, text: str) -> str:
        if self.stopped:
            return ""
        self._held += text
        found = [i for i in (self._held.find(stop) for stop in self.stops) if i >= 0]
        if found:
            self.stopped = True
            out, self._held = self._held[:min(found)], ""
            return out
        keep = max((len(stop) - 1 for stop in self.stops), default=0)
        cut = len(self._held) - keep
        out, self._held = self._held[:max(cut, 0)], self._held[max(cut, 0):]
        return out

    def flush(self) -> str:
        """What was held back, once generation is over without a stop string."""
        out, self._held = ("" if self.stopped else self._held), ""
        return out


def _event(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"


class _Reply:
    """OpenAI response bodies for one request: whole, or chunk by chunk."""

    def __init__(self, model_id: str, chat: bool):
        self.model_id = model_id
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def _body(self, kind: str, choice: dict) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model_id, "choices": [choice]}

    def whole(self, text: str, finish: str, prompt_tokens: int, completion_tokens: int) -> dict:
        content = {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text, "logprobs": None}
        body = self._body("chat.completion" if self.chat else "text_completion",
                          {"index": 0, **content, "finish_reason": finish})
        body["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                         "total_tokens": prompt_tokens + completion_tokens}
        return body

    def chunk(self, text: str, finish: str | None) -> dict:
        content = {"delta": {"content": text}} if self.chat else {"text": text, "logprobs": None}
        return self._body("chat.completion.chunk" if self.chat else "text_completion",
                          {"index": 0, **content, "finish_reason": finish})
