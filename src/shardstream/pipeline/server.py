"""The coordinator's HTTP server: the packaged stages (with Range requests) for the agents, and the
OpenAI-compatible API of `serving/server.py` over the whole pipeline.

Two secrets, two jobs: /stages/* wants the agents' `--token`; the API (/v1/*) wants `--api-key`
when one is given, else the same `--token`, so a coordinator exposed to reach its agents never
serves the model to anyone without a secret. /health is open, as on `serve`."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import uvicorn
from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles
from transformers import PreTrainedTokenizerBase

from ..serving.openai_api import RequireBearer, install_errors
from ..serving.server import create_app
from .generation import PipelineModel


def coordinator_app(model: PipelineModel, tokenizer: PreTrainedTokenizerBase | None, model_id: str,
                    stages: Path, token: str, *, api_key: str | None = None,
                    aliases: tuple[str, ...] = (), chat_template: str | None = None) -> FastAPI:
    """Stages under /stages/<stage id>/<file>; /v1/completions and friends when there is a tokenizer."""
    if tokenizer is not None:
        app = create_app(model, tokenizer, model_id, engine=model.engine, aliases=aliases,
                         chat_template=chat_template)
    else:
        app = FastAPI(title="shardstream coordinator")
        install_errors(app)
    stages.mkdir(parents=True, exist_ok=True)
    app.mount("/stages", StaticFiles(directory=stages), name="stages")
    app.add_middleware(RequireBearer, secret_for=_secrets(token, api_key))
    return app


def _secrets(token: str, api_key: str | None):
    """/stages/* wants the --token; every other path --api-key (else the --token)."""
    stages = (f"Bearer {token}".encode(), "incorrect or missing key: the stage files need the coordinator's "
              "--token; send 'Authorization: Bearer <it>'.")
    flag = "--api-key" if api_key else "--token (no --api-key was given)"
    api = (f"Bearer {api_key or token}".encode(), f"incorrect or missing key: the API needs the coordinator's "
           f"{flag}; send 'Authorization: Bearer <it>'.")
    return lambda path: stages if path == "/stages" or path.startswith("/stages/") else api


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
