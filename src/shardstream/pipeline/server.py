"""The coordinator's HTTP server: the packaged stages (with Range requests) for the agents, and the
OpenAI-compatible API of `stream/server.py` over the whole pipeline. Every path needs the token."""

from __future__ import annotations

import hmac
import threading
import time
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.staticfiles import StaticFiles
from transformers import PreTrainedTokenizerBase

from ..stream.server import create_app
from .generation import PipelineModel


def coordinator_app(model: PipelineModel, tokenizer: PreTrainedTokenizerBase | None, model_id: str,
                    stages: Path, token: str) -> FastAPI:
    """Stages under /stages/<stage id>/<file>; /v1/completions and friends when there is a tokenizer."""
    app = create_app(model, tokenizer, model_id) if tokenizer is not None else FastAPI(title="shardstream coordinator")
    stages.mkdir(parents=True, exist_ok=True)
    app.mount("/stages", StaticFiles(directory=stages), name="stages")
    expected = f"Bearer {token}".encode()

    @app.middleware("http")
    async def _authorized(request: Request, call_next):
        if not hmac.compare_digest(request.headers.get("authorization", "").encode(), expected):
            return JSONResponse(status_code=401, headers={"WWW-Authenticate": "Bearer"},
                                content={"detail": "the coordinator needs 'Authorization: Bearer <token>' with its --token"})
        return await call_next(request)

    return app


class BackgroundServer:
    """uvicorn in a thread, so the coordinator can serve stages while it deploys them."""

    def __init__(self, app: FastAPI, host: str, port: int):
        self._server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, name="coordinator-http", daemon=True)
        self._thread.start()
        while not self._server.started:
            if not self._thread.is_alive():
                raise OSError(f"the coordinator could not listen on {host}:{port}; choose another --serve-port.")
            time.sleep(0.02)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]

    def wait(self) -> None:
        self._thread.join()

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join()
