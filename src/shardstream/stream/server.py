"""OpenAI-compatible HTTP server over one streaming model.

`/v1/completions`, `/v1/chat/completions` (with server-sent events when `stream` is true) and
`/v1/models`. One model serves one request at a time (a lock): streaming reads every block per
token, so concurrent requests would only compete for the same disk.
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
from pydantic import BaseModel, Field
from transformers import PreTrainedTokenizerBase, TextIteratorStreamer

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
        model.check_length(inputs["input_ids"], request.max_tokens)
        reply = _Reply(model_id, chat)
        if request.stream:
            return StreamingResponse(_stream(inputs, options, request.seed, reply), media_type="text/event-stream")
        with lock:
            set_seed(request.seed)
            output = model.generate(**inputs, **options)
        new = output[0, inputs["input_ids"].shape[1]:]
        text = tokenizer.decode(new, skip_special_tokens=True)
        return reply.whole(text, _finish(new, tokenizer), inputs["input_ids"].shape[1], len(new))

    def _stream(inputs: dict, options: dict, seed: int | None, reply: _Reply) -> Iterator[str]:
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
            if piece:
                yield _event(reply.chunk(piece, None))
        worker.join()
        if failure:
            yield _event({"error": {"message": str(failure[0]), "type": "server_error"}})
        else:
            new = output[0][0, inputs["input_ids"].shape[1]:]
            yield _event(reply.chunk("", _finish(new, tokenizer)))
        yield "data: [DONE]\n\n"

    return app


def _finish(new_tokens, tokenizer: PreTrainedTokenizerBase) -> str:
    return "stop" if len(new_tokens) and int(new_tokens[-1]) == tokenizer.eos_token_id else "length"


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
