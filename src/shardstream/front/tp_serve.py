"""`shardstream serve --tensor-parallel`: run by torchrun on every rank; rank 0 serves the OpenAI API.

Rank 0 binds the port at once and answers from the start: /health says "starting" (503) while the
ranks join and load, "ok" once they serve, "unavailable" (503) once the group is lost. The batch
engine runs on rank 0; its model calls and cache operations are replayed on the other ranks
(serving.py). When the group fails (a rank gone, a collective timed out) or torchrun stops the rank
(SIGTERM, which it sends to every rank when one fails), the requests in flight get a 503 (an error
event when streamed) and rank 0 exits non-zero, so that `torchrun --max-restarts N` starts the group
again, on the same port.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING

import torch.distributed as dist
from starlette.responses import JSONResponse

from ..errors import GroupLost, ShardstreamError
from ..listener import server_config
from ..serving.openai_api import HEALTH_PATH, APIError, RequestLog
from ..serving.endpoint import Endpoint, bind, log_batch_bounds, say, say_resident, server_class, stop_on_signals
from .tp_generate import open_rank
from ..tp.group import check_torchrun, join_group
from ..tp.serving import GroupCalls, error_gist, follow

if TYPE_CHECKING:
    from ..options import ConversionOptions
    from ..stream.engine_options import EngineOptions

CLOSE_S = 10.0   # how long the last replies and a clean stop may take (the engine's last step, the ranks leaving)


def serve_tp(source: str, endpoint: Endpoint, device: str, options: EngineOptions, conversion: ConversionOptions,
             progress: bool, timeout_s: float, tp_cache: str | None) -> None:
    """One rank of `torchrun ... -m shardstream serve STORE --tensor-parallel`, with the command's `options`
    (checked before the ranks join, for one sequence); each rank streams its shares within the memory
    serve's one process takes for the same batches (EngineOptions.for_batch), out of the rank's share of
    the machine."""
    check_torchrun()

    def open_model():
        rank_device = join_group(device, timedelta(seconds=timeout_s))   # before the model joins it: with this timeout
        # `auto` measured on the rank's own device, as it opens
        model = open_rank(source, conversion, device, progress, options.for_batch(endpoint.max_batch_size, rank_device),
                          tp_cache)
        say_resident(model, f"rank {dist.get_rank()} of {dist.get_world_size()}")
        return model

    rank = dist.get_rank() if dist.is_initialized() else int(os.environ["RANK"])
    if rank != 0:
        with open_model() as model:
            follow(model)
        return
    _RankZero(open_model, endpoint, heartbeat_s=min(5.0, timeout_s / 4)).run()


class Gate:
    """The ASGI app rank 0 serves from the start: 503 until the group has loaded, then the API, and 503
    again once the group is lost or stopping (requests already inside get their own answer)."""

    def __init__(self):
        self.app = None
        self.problem: str | None = None
        self._lock = threading.Lock()

    def open(self, app) -> bool:
        """Serve `app` from now on, unless the group was lost meanwhile."""
        with self._lock:
            if self.problem is None:
                self.app = app
            return self.problem is None

    def close(self, problem: str) -> None:
        with self._lock:
            self.problem = self.problem or problem

    async def __call__(self, scope, receive, send):
        app, problem = self.app, self.problem
        if app is not None and problem is None:
            return await app(scope, receive, send)
        if scope["type"] != "http":
            return
        if scope["path"] == HEALTH_PATH:
            body = {"status": "starting"} if problem is None else {"status": "unavailable", "reason": problem}
            response = JSONResponse(body, status_code=503)
        else:
            message = problem or ("the tensor-parallel group is starting (its ranks join and load the model); "
                                  "retry once /health answers 200.")
            response = APIError(503, message, code="tensor_parallel_unavailable", kind="server_error").response()
        await response(scope, receive, send)


class _RankZero:
    """Rank 0's life: the HTTP server in the main thread (so signals are handled at once), the group
    joined and loaded in another, the engine and the group torn down at the end."""

    def __init__(self, open_model: Callable, endpoint: Endpoint, heartbeat_s: float):
        self.open_model, self.endpoint, self.heartbeat_s = open_model, endpoint, heartbeat_s
        self.listener = bind(endpoint.host, endpoint.port)
        self.gate = Gate()
        app = self.gate if endpoint.quiet else RequestLog(self.gate)
        self.server = server_class()(server_config(app, lifespan="off", timeout_graceful_shutdown=CLOSE_S))
        self.model = self.calls = self.engine = None
        self.failure: BaseException | None = None   # why loading failed
        self.problem: GroupLost | None = None       # why the group cannot go on

    def run(self) -> None:
        log_batch_bounds()
        stop_on_signals(self._signalled)
        loading = threading.Thread(target=self._load, name="shardstream-tp-load", daemon=True)
        loading.start()
        with self.listener:
            self.server.run(sockets=[self.listener])
        if self.failure is not None:
            raise self.failure
        if self.problem is None and not loading.is_alive():
            closing = threading.Thread(target=self._close, daemon=True)
            closing.start()
            closing.join(CLOSE_S)
            if not closing.is_alive() and self.problem is None:
                say("shardstream serve: stopped")
                return
        why = str(self.problem or "the tensor-parallel group did not stop in time").rstrip(".")
        say(f"shardstream serve: {why}; exiting with code 1")
        os._exit(1)   # a thread may wait in a collective for a rank that is gone: do not wait for it

    def _load(self) -> None:
        from ..serving.batching import BatchEngine
        from ..serving.text import eos_ids, load_tokenizer, pad_id

        try:
            self.model = self.open_model()
            tokenizer = load_tokenizer(self.model)
            self.calls = GroupCalls(self.model, self.heartbeat_s, self._lose)
            self.engine = BatchEngine(self.calls, eos_token_ids=eos_ids(self.model, tokenizer),
                                      pad_token_id=pad_id(tokenizer), max_batch_size=self.endpoint.max_batch_size,
                                      cache_ops=self.calls)
            app = self.endpoint.app(self.calls, tokenizer, self.engine)
        except ShardstreamError as error:
            self.failure = error
        except Exception as error:  # noqa: BLE001 - a rank that failed while the group loaded
            self.failure = GroupLost(f"the tensor-parallel group failed while loading ({type(error).__name__}: "
                                     f"{error_gist(error)}); check every rank's output.")
        if self.failure is not None:
            self.server.should_exit = True
        elif self.gate.open(app):
            say(self.endpoint.listening(self.listener.getsockname()[1], f"; tensor-parallel over "
                                         f"{dist.get_world_size()} ranks"))

    def _lose(self, error: GroupLost) -> None:
        """The group failed: no more requests, the ones in flight get `error` (503), the server stops."""
        self.problem = self.problem or error
        self._stop(error)

    def _signalled(self, number: signal.Signals) -> None:
        self._stop(GroupLost(f"this server is stopping ({number.name}; torchrun stops every rank when one fails); "
                             "retry once /health answers 200."))

    def _stop(self, error: GroupLost) -> None:
        self.gate.close(str(error))
        if self.engine is not None:
            self.engine.abort(error)
        self.server.should_exit = True

    def _close(self) -> None:
        """A stop without a fault: the engine's thread ends, the other ranks leave, then this one."""
        self.engine.close()
        try:
            self.calls.stop()
        except GroupLost:
            return
        self.model.close()
