"""The coordinator's HTTP server: the packaged stages (with Range requests) for the agents, the
door by which an agent joins a running pipeline, and the OpenAI-compatible API of
`serving/server.py` over the whole pipeline.

Two secrets, two jobs: /stages/* and /v1/agents/* want the agents' `--token`; the API (/v1/*)
wants `--api-key` when one is given, else the same `--token`, so a coordinator exposed to reach
its agents never serves the model to anyone without a secret. /health is open, as on `serve`, and
says "deploying" (503) until the stages are deployed."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, ConfigDict
from transformers import PreTrainedTokenizerBase

from ..errors import InvalidOption, PipelineUnavailable
from ..listener import listening, server_config
from ..serving.openai_api import HEALTH_PATH, APIError, RequireBearer, install_errors
from ..serving.server import create_app
from .client import AgentClient
from .generation import PipelineModel

JOIN_TIMEOUT = 900.0   # seconds a joining agent waits: requests in flight finish, then it is profiled and loaded


class JoinRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str   # the agent's control plane, as the coordinator reaches it


def coordinator_app(model: PipelineModel, tokenizer: PreTrainedTokenizerBase | None, model_id: str,
                    stages: Path, token: str, *, api_key: str | None = None,
                    aliases: tuple[str, ...] = (), chat_template: str | None = None) -> FastAPI:
    """Stages under /stages/<stage id>/<file>, POST /v1/agents/join, /health; /v1/completions and
    friends when there is a tokenizer."""
    coordinator = model.coordinator

    def health() -> Response:
        route = coordinator.route
        if route is None or coordinator.deploying:
            return JSONResponse({"status": "deploying"}, status_code=503)
        if coordinator.problem:
            return JSONResponse({"status": "unavailable", "reason": coordinator.problem}, status_code=503)
        return JSONResponse({"status": "ok", "epoch": route.epoch, "agents": list(coordinator.agents),
                             "stages": [s.device for s in route.plan.stages]})

    if tokenizer is not None:
        app = create_app(model, tokenizer, model_id, engine=model.engine, aliases=aliases,
                         chat_template=chat_template, health=health)
    else:
        app = FastAPI(title="shardstream coordinator")
        install_errors(app)
        app.get(HEALTH_PATH, response_model=None)(health)

    @app.exception_handler(PipelineUnavailable)
    async def _unavailable(request: Request, error: PipelineUnavailable) -> JSONResponse:
        return APIError(503, str(error), code="pipeline_unavailable", kind="server_error").response()

    @app.post("/v1/agents/join")
    def join(body: JoinRequest) -> dict:
        """Take in the agent at `url` (`shardstream agent --join`) and re-plan; answers once its stage is loaded."""
        route = model.engine.join(AgentClient(body.url, token), JOIN_TIMEOUT)
        stages = [{"agent": s.device, "first": s.first_layer, "last": s.last_layer_exclusive} for s in route.plan.stages]
        return {"epoch": route.epoch, "stages": stages, "table": route.plan.table()}

    stages.mkdir(parents=True, exist_ok=True)
    app.mount("/stages", StaticFiles(directory=stages), name="stages")
    app.add_middleware(RequireBearer, secret_for=_secrets(token, api_key))
    return app


def _secrets(token: str, api_key: str | None):
    """/stages/* and /v1/agents/* want the --token; every other path --api-key (else the --token)."""
    agents = (f"Bearer {token}".encode(), "incorrect or missing key: the stage files and /v1/agents need the "
              "coordinator's --token; send 'Authorization: Bearer <it>'.")
    flag = "--api-key" if api_key else "--token (no --api-key was given)"
    api = (f"Bearer {api_key or token}".encode(), f"incorrect or missing key: the API needs the coordinator's "
           f"{flag}; send 'Authorization: Bearer <it>'.")
    return lambda path: agents if path.startswith(("/stages/", "/v1/agents/")) or path == "/stages" else api


class BackgroundServer:
    """uvicorn in a thread, so the coordinator can serve stages while it deploys them. The port is
    bound here, before anything slow: one in use is said at once, in one sentence."""

    def __init__(self, app: FastAPI, host: str, port: int):
        listener = listening(host, port, "the coordinator", "--serve-port")
        self.port = listener.getsockname()[1]
        self._server = uvicorn.Server(server_config(app))
        self._thread = threading.Thread(target=self._run, args=(listener,), name="coordinator-http", daemon=True)
        self._thread.start()
        while not self._server.started:
            if not self._thread.is_alive():
                raise InvalidOption(f"the coordinator could not serve on {host}:{self.port}; see the lines above.")
            time.sleep(0.02)

    def _run(self, listener: socket.socket) -> None:
        with listener:
            self._server.run(sockets=[listener])

    def wait(self) -> None:
        self._thread.join()

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join()
