"""The agent: a FastAPI control plane on each device plus the ZeroMQ data plane of its stage.

Control (bearer token on every endpoint): health, capabilities, profiles (compute, disk reads),
pings, claiming the agent for a coordinator, loading and unloading a stage; health also counts the
experts an on-demand MoE stage has read, the blocks a streamed stage reads from disk and the
steps run batched. Data: one thread receives activations, runs the loaded stage and pushes the
result on; single-token steps of several sessions waiting together run as one batched pass. A stage is loaded `metadata_only`
(downloaded, verified, cached) or materialized: in memory, or streamed (`stream_budget_bytes`) when the plan
gave this agent more blocks than its memory holds.

An agent serves one coordinator at a time: the one that claimed it last. Another coordinator is
refused while that one still answers at its address, unless it asks to take the agent over; the
data plane then answers the old coordinator's steps with `StageGone`, so it re-deploys or says why not.
"""

from __future__ import annotations

import hmac
import json
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch
import zmq
from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field

from ..errors import AgentBusy, ShardstreamError, StageGone
from ..store import open_store
from ..stream.engine_options import EngineOptions
from . import measure
from .download import fetch_stage, remove_stage
from .package import STAGE_MANIFEST
from .stage import StageModel
from .transport import Answer, Inbox, Outbox, serve_stage


OWNER_TIMEOUT = 2.0   # seconds the coordinator an agent serves has to answer before another may claim it


class ClaimRequest(BaseModel):
    coordinator: str = Field(min_length=1, max_length=64)   # the claiming coordinator's id
    url: str   # where it answers /health, as this agent reaches it
    take_over: bool = False


class LoadRequest(BaseModel):
    coordinator: str   # the id of the coordinator that claimed this agent
    url: str
    stage_id: str = Field(pattern=r"^[0-9a-f]{32}$")
    epoch: int = Field(ge=0)
    metadata_only: bool = True
    stream_budget_bytes: int | None = Field(None, ge=0)   # a number: stream the blocks, keeping what fits in it


class ProfileRequest(BaseModel):
    size: int = Field(256, ge=16, le=8192)
    repeats: int = Field(10, ge=1, le=1000)


class BlockProfileRequest(BaseModel):
    hidden_size: int = Field(ge=1, le=65536)
    intermediate_size: int = Field(ge=1, le=262144)
    tokens: int = Field(1, ge=1, le=4096)
    repeats: int = Field(10, ge=1, le=1000)


class DiskProfileRequest(BaseModel):
    size: int = Field(measure.DISK_PROBE_BYTES, ge=2**20, le=measure.DISK_PROBE_LIMIT)


class PingRequest(BaseModel):
    peers: list[str]
    timeout: float = Field(2.0, gt=0, le=30)
    probe_bytes: int = Field(0, ge=0, le=measure.PROBE_LIMIT)   # > 0: also measure bandwidth with this many bytes


@dataclass
class Owner:
    """The coordinator this agent serves."""

    id: str
    url: str
    since: float


@dataclass
class Loaded:
    stage_id: str
    coordinator: str
    epoch: int
    first: int
    last: int
    model: StageModel | None


class Agent:
    """The state behind both planes: the loaded stage, swapped under a lock, and the data thread."""

    def __init__(self, name: str, token: str, cache: Path, data_port: int, max_memory: int | None = None,
                 options: EngineOptions | None = None):
        """`options`: how its stages' engine runs (their resident budget is the plan's)."""
        self.name, self.token, self.cache, self.max_memory = name, token, Path(cache), max_memory
        self.options = options or EngineOptions()
        self.loaded: Loaded | None = None
        self.owner: Owner | None = None
        self._claim_lock = threading.Lock()
        self.batched_steps = 0   # steps that shared a pass with other sessions' (health reports it)
        self._lock = threading.Lock()
        self._context = zmq.Context()
        self._inbox = Inbox(self._context, f"tcp://*:{data_port}")
        self.data_port = self._inbox.port
        self._running = True
        self._thread = threading.Thread(target=self._serve, name="data-plane", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        outbox = Outbox(self._context)
        try:
            serve_stage(self._inbox, outbox, self.compute, lambda: self._running, self.name)
        finally:
            outbox.close()
            self._inbox.close()

    def compute(self, messages: list[tuple[dict, torch.Tensor]]) -> Iterator[tuple[dict, Answer, float]]:
        """Each message's header, output (or failure) and compute seconds, in arrival order per
        session: a run of single-token steps of distinct sessions goes through the stage as one
        pass, its seconds split evenly among them; prompts and ends go one at a time."""
        group: list[tuple[dict, torch.Tensor]] = []
        for header, tensor in messages:
            position = header.get("position")
            single = header.get("kind") == "forward" and isinstance(position, int) and position > 0 \
                and tensor.dim() >= 2 and tensor.shape[1] == 1
            if not single or any(h.get("session") == header.get("session") for h, _ in group):
                yield from self._batch(group)
                group = []
            if single:
                group.append((header, tensor))
            else:
                yield self._one(header, tensor)
        yield from self._batch(group)

    def _batch(self, group: list[tuple[dict, torch.Tensor]]) -> Iterator[tuple[dict, Answer, float]]:
        """One pass for the group when the stage can batch it, else (or when it refuses) one at a time."""
        if len(group) > 1:
            started = time.perf_counter()
            try:
                model = self._model(group)
                outputs = model.forward_batch([(h["session"], h["position"], t) for h, t in group]) if model.batches \
                    else None
            except Exception:   # e.g. a stale step or an old epoch; nothing changed: each gets its own answer below
                outputs = None
            if outputs is not None:
                self.batched_steps += len(group)
                seconds = (time.perf_counter() - started) / len(group)
                yield from ((header, output, seconds) for (header, _), output in zip(group, outputs))
                return
        for header, tensor in group:
            yield self._one(header, tensor)

    def _one(self, header: dict, tensor: torch.Tensor) -> tuple[dict, Answer, float]:
        started = time.perf_counter()
        try:
            model = self._model([(header, tensor)])
            if header["kind"] == "end":
                model.end(header["session"])
                return header, None, 0.0
            output = model.forward(header["session"], header["position"], tensor, bool(header.get("all_logits")))
        except Exception as error:  # answered to the coordinator as an error
            return header, error, 0.0
        return header, output, time.perf_counter() - started

    def _model(self, messages: list[tuple[dict, torch.Tensor]]) -> StageModel:
        """The materialized stage, if every message is for its coordinator and plan epoch."""
        loaded, owner = self.loaded, self.owner
        for header, _ in messages:
            if owner is not None and header.get("coordinator") != owner.id:
                raise StageGone(f"it now serves the coordinator at {owner.url}; its stages here are gone")
            if loaded is None or loaded.model is None or header.get("coordinator") != loaded.coordinator:
                raise StageGone("it holds no stage for this coordinator (it was restarted or unloaded); re-deploy")
            if header["epoch"] != loaded.epoch:
                raise StageGone(f"it runs plan epoch {loaded.epoch}, not {header['epoch']}; re-send on the current plan")
        return loaded.model

    def claim(self, request: ClaimRequest) -> dict:
        """Serve the claiming coordinator from now on (dropping the stage loaded for another), unless
        another one serves here and still answers at its address (a coordinator started again at the
        same address replaces itself)."""
        with self._claim_lock:
            owner = self.owner
            if owner is not None and owner.id != request.coordinator and owner.url != request.url \
                    and not request.take_over and _answers(owner.url):
                raise AgentBusy(f"it serves the coordinator at {owner.url} (since "
                                f"{time.strftime('%H:%M:%S', time.localtime(owner.since))}); stop that coordinator, "
                                "or start this one with --take-over to take the agent from it.")
            if owner is None or owner.id != request.coordinator:
                self.owner = Owner(request.coordinator, request.url, time.time())
                with self._lock:   # the stage of the coordinator served before is of no use now: free its memory
                    self._drop()   # before the new one profiles what is available
            return {"name": self.name, "data_port": self.data_port}

    def load(self, request: LoadRequest, headers: dict[str, str]) -> dict:
        owner = self.owner
        if owner is None or owner.id != request.coordinator:
            raise AgentBusy(f"it serves the coordinator at {owner.url}; claim it first (POST /v1/claim)." if owner
                            else "it serves no coordinator yet; claim it first (POST /v1/claim).")
        with httpx.Client(headers=headers, timeout=60.0) as client:
            folder, downloaded = fetch_stage(request.url, request.stage_id, self.cache, client)
        stage = _stage_range(folder)
        with self._lock:  # the old stage's memory goes before the new one is built
            self._drop()
            model = None if request.metadata_only else StageModel(open_store(folder), *stage,
                                                                  stream_budget=request.stream_budget_bytes,
                                                                  options=self.options)
            self.loaded = Loaded(request.stage_id, request.coordinator, request.epoch, *stage, model)
        return {"stage_id": request.stage_id, "downloaded_bytes": downloaded, "first": stage[0], "last": stage[1],
                "materialized": model is not None, "data_port": self.data_port,
                "streamed_blocks": model.streamed_blocks if model else []}

    def _drop(self) -> Loaded | None:
        """Forget the loaded stage and stop its block reader (a streamed stage's prefetch thread)."""
        loaded, self.loaded = self.loaded, None
        if loaded and loaded.model:
            loaded.model.close()
        return loaded

    def unload(self, forget: bool) -> dict:
        with self._lock:
            loaded = self._drop()
        if loaded and forget:
            remove_stage(self.cache, loaded.stage_id)
        return {"unloaded": loaded.stage_id if loaded else None}

    def close(self) -> None:
        self._running = False
        self._thread.join()
        self._context.term()


def _answers(url: str) -> bool:
    """Whether a coordinator still answers at `url` (any HTTP status: it may still be deploying)."""
    try:
        httpx.get(url.rstrip("/") + "/health", timeout=OWNER_TIMEOUT)
    except httpx.HTTPError:
        return False
    return True


def _stage_range(folder: Path) -> tuple[int, int]:
    body = json.loads((folder / STAGE_MANIFEST).read_text())
    return body["first"], body["last"]


def create_agent_app(agent: Agent, log_requests: bool = False) -> FastAPI:
    """The control plane; with `log_requests`, one line per request on stdout (method, path, status, seconds)."""
    def authorized(request: Request) -> None:
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {agent.token}".encode()):
            raise HTTPException(401, f"agent {agent.name} needs 'Authorization: Bearer <token>' with its --token",
                                headers={"WWW-Authenticate": "Bearer"})

    app = FastAPI(title=f"shardstream agent {agent.name}", dependencies=[Depends(authorized)])

    if log_requests:
        @app.middleware("http")
        async def _log(request: Request, call_next):
            started = time.perf_counter()
            response = await call_next(request)
            print(f"{request.method} {request.url.path} {response.status_code} {time.perf_counter() - started:.3f}s",
                  flush=True)
            return response

    @app.exception_handler(ShardstreamError)
    async def _user_error(request: Request, error: ShardstreamError) -> JSONResponse:
        status = 409 if isinstance(error, AgentBusy) else 400
        return JSONResponse(status_code=status, content={"detail": f"agent {agent.name}: {error}"})

    @app.get("/v1/health")
    def health() -> dict:
        loaded, owner = agent.loaded, agent.owner
        experts = loaded.model.experts if loaded and loaded.model else None
        return {"name": agent.name, "ok": True, "coordinator": owner.url if owner else None,
                "stage_id": loaded.stage_id if loaded else None,
                "epoch": loaded.epoch if loaded else None, "expert_loads": experts.loads if experts else None,
                "streamed_blocks": loaded.model.streamed_blocks if loaded and loaded.model else None,
                "batched_steps": agent.batched_steps}

    @app.get("/v1/capabilities")
    def capabilities() -> dict:
        return {"name": agent.name, "data_port": agent.data_port, **measure.capabilities(agent.max_memory)}

    @app.post("/v1/profile/matmul")
    def profile_matmul(request: ProfileRequest) -> dict:
        return {"gflops": measure.matmul_gflops(request.size, request.repeats)}

    @app.post("/v1/profile/block")
    def profile_block(request: BlockProfileRequest) -> dict:
        gflops = measure.block_gflops(request.hidden_size, request.intermediate_size, request.tokens, request.repeats)
        return {"gflops": gflops}

    @app.post("/v1/profile/disk")
    def profile_disk(request: DiskProfileRequest) -> dict:
        """Read speed of the disk holding the stage cache, which prices a streamed stage."""
        return {"bytes_per_s": measure.disk_read_bytes_per_s(agent.cache, request.size)}

    @app.post("/v1/net/ping")
    def net_ping(request: PingRequest) -> dict:
        rtts, bandwidths = measure.ping(request.peers, {"Authorization": f"Bearer {agent.token}"}, request.timeout,
                                        request.probe_bytes)
        return {"rtt_seconds": rtts, "bandwidth_bytes_per_s": bandwidths}

    @app.get("/v1/net/blob")
    def net_blob(size: int = Query(..., ge=1, le=measure.PROBE_LIMIT)) -> Response:
        """`size` bytes for a peer's bandwidth probe (random, so no link compression flatters it)."""
        return Response(os.urandom(size), media_type="application/octet-stream")

    @app.post("/v1/claim")
    def claim(request: ClaimRequest) -> dict:
        return agent.claim(request)

    @app.post("/v1/stage/load")
    def stage_load(request: LoadRequest) -> dict:
        return agent.load(request, {"Authorization": f"Bearer {agent.token}"})

    @app.post("/v1/stage/unload")
    def stage_unload(forget: bool = False) -> dict:
        return agent.unload(forget)

    return app
