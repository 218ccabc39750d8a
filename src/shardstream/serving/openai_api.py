"""The OpenAI API surface shared by every server (`serve`, the pipeline coordinator): request models
with OpenAI's ranges, OpenAI-shaped errors, the API-key check and the per-request log line.

What clients send is answered or refused by name, never silently ignored: unknown fields are
refused (`extra="forbid"`), as OpenAI does.
"""

from __future__ import annotations

import hmac
import sys
import time
from collections.abc import Callable
from typing import Annotated, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import GroupLost, InsufficientMemory, PipelineUnavailable, ServerStopping, ShardstreamError

HEALTH_PATH = "/health"
# our errors that say the server cannot answer now (a 503, with this code), not that the request is wrong
UNAVAILABLE = {GroupLost: "tensor_parallel_unavailable", PipelineUnavailable: "pipeline_unavailable",
               InsufficientMemory: "insufficient_memory", ServerStopping: "server_stopping"}
DEFAULT_MAX_REQUEST_BYTES = 8 * 10**6   # `serve --max-request-size`: a whole context of token ids is under 1 MB


class APIError(Exception):
    """An error answered as OpenAI does: a status and `{"error": {message, type, param, code}}`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    @property
    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(status_code=self.status, content=self.body, headers=headers)


def api_error(error: Exception) -> APIError:
    """How any error out of a request is answered, whole (its status) or streamed (an error event, the same
    body): ours are a 400 saying what to change, or a 503 for those in UNAVAILABLE; anything else a 500."""
    if isinstance(error, APIError):
        return error
    code = next((code for kind, code in UNAVAILABLE.items() if isinstance(error, kind)), None)
    if code is not None:
        return APIError(503, str(error), code=code, kind="server_error")
    if isinstance(error, ShardstreamError):
        return APIError(400, str(error))
    return APIError(500, f"the server failed: {error}", kind="server_error")


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1, le=128)
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = Field(None, validate_default=True)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop: str | list[str] | None) -> list[str]:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > 4 or not all(stops):
            raise ValueError("give at most 4 stop strings, none of them empty")
        return stops

    def refuse_unsupported(self) -> None:
        """Fields OpenAI accepts that this server does not implement: refused by name."""
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported by this server; leave it out.", "logit_bias",
                           "unsupported_parameter")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed when stream is true.", "stream_options")
        if self.max_tokens == 0 and not getattr(self, "echo", False):   # only completions have echo
            raise APIError(400, "max_tokens is 0, which asks for nothing; give at least 1 (0 is allowed only with "
                           "echo, to score a prompt on /v1/completions).", "max_tokens", "invalid_value")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


TokenIds = Annotated[list[int], Field(min_length=1)]   # checked against the vocabulary by the server


class CompletionRequest(_Request):
    prompt: str | list[str] | TokenIds | list[TokenIds]
    suffix: str | None = None
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=5)
    best_of: int | None = Field(None, ge=1, le=128)

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.suffix:
            raise APIError(400, "suffix (insertion) is not supported by this server; put all the text in prompt.",
                           "suffix", "unsupported_parameter")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, "best_of other than n is not supported by this server; ask for n choices instead.",
                           "best_of", "unsupported_parameter")

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts, each text or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt or any(len(p) == 0 for p in prompt):
            raise APIError(400, "prompt is empty; give some text (or token ids) to continue.", "prompt")
        for i, p in enumerate(prompt):
            if isinstance(p, str):
                check_text(p, "prompt" if len(prompt) == 1 else f"prompt[{i}]")
        return list(prompt)


def check_text(text: str, param: str) -> None:
    """JSON may carry a lone surrogate ("\\ud800"), which is no Unicode text and no tokenizer takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise APIError(400, f"{param} has a lone surrogate (U+{ord(text[error.start]):04X}) at character "
                       f"{error.start}, which is not Unicode text; send valid UTF-8.", param, "invalid_value") from None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: str
    text: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self, index: int) -> str:
        if isinstance(self.content, list):
            for part in self.content:
                if part.type != "text" or part.text is None:
                    raise APIError(400, f"messages[{index}].content has a part of type '{part.type}'; this server "
                                   "takes only text parts.", f"messages[{index}].content", "unsupported_content")
            text = "".join(part.text for part in self.content)
        else:
            text = self.content or ""
        check_text(text, f"messages[{index}].content")
        check_text(self.name or "", f"messages[{index}].name")
        return text


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: str
    json_schema: dict | None = None


class ChatRequest(_Request):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs set to true.", "top_logprobs")
        if self.response_format is not None and self.response_format.type != "text":
            raise APIError(400, f"response_format type '{self.response_format.type}' is not supported by this "
                           "server (it does not constrain output to JSON); leave response_format out or send "
                           "{\"type\": \"text\"}.", "response_format", "unsupported_parameter")


def _validation_error(error: RequestValidationError) -> APIError:
    """FastAPI's 422 list, said as OpenAI says it: one 400 sentence naming the field."""
    first = error.errors()[0]
    kind = first.get("type", "")
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    # Drop pydantic's union-branch labels ("str", "list[int]", ...) so the param is the field path.
    path = [part for part in loc if not any(c in part for c in "[]-") and part not in ("str", "int", "function-after")]
    param = ".".join(path) or None
    if kind == "json_invalid":
        return APIError(400, "the request body is not valid JSON; send a JSON object.", None, "invalid_json")
    if kind == "missing" and param is None:
        return APIError(400, "the request body is empty; send a JSON object.", None, "invalid_json")
    if param is None and kind in ("model_attributes_type", "dict_type"):   # a list, a string, or not sent as JSON
        return APIError(400, "the request body is not a JSON object; send one, with Content-Type: application/json.",
                        None, "invalid_json")
    if kind == "missing":
        return APIError(400, f"you must provide a '{param}' parameter.", param, "missing_required_parameter")
    if kind == "extra_forbidden":
        return APIError(400, f"unrecognized request argument supplied: {param}; this server does not support it.",
                        param, "unsupported_parameter")
    message = first.get("msg", "invalid value").removeprefix("Value error, ")
    return APIError(400, f"{param}: {message}." if param else f"{message}.", param, "invalid_value")


def install_errors(app: FastAPI) -> None:
    """Every error out of `app` is OpenAI-shaped: validation, bad JSON, unknown paths, our own, crashes."""

    @app.exception_handler(APIError)
    async def _api(request: Request, error: APIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        return _validation_error(error).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, error: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if error.status_code < 500 else "server_error"
        return APIError(error.status_code, f"{request.method} {request.url.path}: {error.detail}", kind=kind).response()

    async def _answer(request: Request, error: Exception) -> JSONResponse:
        return api_error(error).response()

    app.add_exception_handler(ShardstreamError, _answer)   # ours: answered, not logged as a crash
    app.add_exception_handler(Exception, _answer)


def install_api_key(app: FastAPI, api_key: str | None) -> None:
    """With a key, every path but the health check wants `Authorization: Bearer KEY` (else 401)."""
    if api_key:
        secret = (f"Bearer {api_key}".encode(),
                  "incorrect or missing API key; send 'Authorization: Bearer <key>' with the server's --api-key.")
        app.add_middleware(RequireBearer, secret_for=lambda path: secret)


class RequireBearer:
    """Every path but the health check wants the bearer secret `secret_for(path)` names, with the
    sentence a 401 says without it. A plain ASGI middleware: Starlette's `@app.middleware("http")`
    wraps `receive`, after which the handlers can no longer see a client disconnect."""

    def __init__(self, app, secret_for: Callable[[str], tuple[bytes, str]]):
        self.app, self.secret_for = app, secret_for

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != HEALTH_PATH:
            expected, message = self.secret_for(scope["path"])
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, expected):
                return await APIError(401, message, None, "invalid_api_key").response()(scope, receive, send)
        await self.app(scope, receive, send)


class BodyLimit:
    """A request body over `limit` bytes is a 413 before anything reads or parses it: a declared
    Content-Length is refused at once (the server discards the unread body as it arrives, holding none
    of it); a body sent without one (chunked) is read here up to the limit, then handed on."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            if int(declared) > self.limit:
                return await self._refuse(f"is {int(declared)} bytes, over", scope, receive, send)
            return await self.app(scope, receive, send)
        messages, size = [], 0
        while not messages or (messages[-1]["type"] == "http.request" and messages[-1].get("more_body")):
            messages.append(await receive())
            size += len(messages[-1].get("body", b""))
            if size > self.limit:
                return await self._refuse("is over", scope, receive, send)

        async def replay():
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, size: str, scope, receive, send) -> None:
        error = APIError(413, f"the request body {size} this server's limit of {self.limit} bytes "
                         "(serve --max-request-size); send a shorter prompt or fewer prompts at once.",
                         None, "request_too_large")
        await error.response()(scope, receive, send)


def check_model(requested: str | None, served: list[str]) -> None:
    """OpenAI answers an unknown model with 404 model_not_found; so do we (no model = the served one)."""
    if requested is not None and requested not in served:
        raise APIError(404, f"the model '{requested}' does not exist on this server; it serves "
                       f"{', '.join(served)}.", "model", "model_not_found")


class RequestLog:
    """ASGI middleware printing one line per request: method, path, status, tokens, seconds.

    Handlers report tokens in `request.state.tokens`; the line is printed when the body is done,
    so a streamed reply is logged when its last event is sent, or, when its client disconnected
    first, once the handler stops, marked "(client disconnected)"."""

    def __init__(self, app, print_line: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)):
        self.app = app
        self.print_line = print_line

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status, logged = time.monotonic(), 0, False
        scope.setdefault("state", {})

        def log_line(note: str = "") -> None:
            nonlocal logged
            logged = True
            self.print_line(f"{scope['method']} {scope['path']} {status} {scope['state'].get('tokens', 0)} tokens "
                            f"{time.monotonic() - start:.2f}s{note}")

        async def logged_send(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                log_line()

        try:
            await self.app(scope, receive, logged_send)
        finally:
            if not logged:
                log_line(" (client disconnected)")


_Request.model_rebuild()
CompletionRequest.model_rebuild()
ChatRequest.model_rebuild()
