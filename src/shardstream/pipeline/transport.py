"""The data plane: activations between stages over ZeroMQ, as raw bytes with dtype and shape.

A message is two frames: a JSON header (session, step, plan epoch, position, the route still to
go, where to reply; plus dtype and shape) and the tensor's bytes. Nothing is ever unpickled. Each
stage computes and pushes its output to the next endpoint on the route; the last one pushes the
logits (or an error) back to the coordinator.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

import torch
import zmq

SEND_TIMEOUT_MS = 2000
Answer = torch.Tensor | Exception | None   # a message's output, its failure, or nothing to send


def pack(header: dict, tensor: torch.Tensor) -> list[bytes]:
    tensor = tensor.detach().to("cpu").contiguous()
    header = {**header, "dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape)}
    return [json.dumps(header).encode(), tensor.view(-1).view(torch.uint8).numpy().tobytes()]


def unpack(frames: list[bytes]) -> tuple[dict, torch.Tensor]:
    """Header and tensor; a header that does not describe the bytes exactly is refused."""
    if len(frames) != 2:
        raise ValueError(f"a data-plane message has 2 frames, not {len(frames)}")
    header = json.loads(frames[0])
    dtype = getattr(torch, str(header.get("dtype")), None)
    shape = header.get("shape")
    if not isinstance(dtype, torch.dtype) or not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise ValueError(f"a data-plane header has dtype {header.get('dtype')!r} and shape {shape!r}")
    count = torch.Size(shape).numel()
    if count * dtype.itemsize != len(frames[1]):
        raise ValueError(f"a data-plane message of shape {shape} {dtype} carries {len(frames[1])} bytes")
    data = torch.frombuffer(bytearray(frames[1]), dtype=torch.uint8) if count else torch.empty(0, dtype=torch.uint8)
    return header, data.view(dtype).reshape(shape)


class Outbox:
    """PUSH sockets by endpoint, created on first use; owned by one thread (zmq sockets are not shared)."""

    def __init__(self, context: zmq.Context):
        self._context = context
        self._sockets: dict[str, zmq.Socket] = {}

    def send(self, endpoint: str, header: dict, tensor: torch.Tensor) -> None:
        socket = self._sockets.get(endpoint)
        if socket is None:
            socket = self._context.socket(zmq.PUSH)
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
            socket.connect(endpoint)
            self._sockets[endpoint] = socket
        socket.send_multipart(pack(header, tensor), copy=False)

    def close(self) -> None:
        for socket in self._sockets.values():
            socket.close(0)
        self._sockets.clear()


class Inbox:
    """A bound PULL socket; `receive` waits at most `timeout` seconds (None when nothing came)."""

    def __init__(self, context: zmq.Context, endpoint: str):
        self.socket = context.socket(zmq.PULL)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(endpoint)
        self.port = int(self.socket.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1])

    def receive(self, timeout: float) -> tuple[dict, torch.Tensor] | None:
        if not self.socket.poll(int(timeout * 1000)):
            return None
        return unpack(self.socket.recv_multipart())

    def close(self) -> None:
        self.socket.close(0)


def serve_stage(inbox: Inbox, outbox: Outbox,
                compute: Callable[[list[tuple[dict, torch.Tensor]]], Iterator[tuple[dict, Answer, float]]],
                running: Callable[[], bool], name: str) -> None:
    """A stage's loop: receive what is waiting, compute, push each output on along its route (or
    back to the coordinator).

    `compute` gets every message waiting (one received, then the rest without waiting, so that it
    can batch them) and yields each one's header, its output (None for messages that need no
    answer, such as ending a session; the exception when it failed) and its compute seconds. A
    failure goes back to the coordinator as an error message naming this agent and the error's
    class (`StageGone`: re-deploy), so it need not wait to find out.
    """
    while running():
        waiting = []
        while (received := _receive(inbox, 0.0 if waiting else 0.2)) is not None:
            waiting.append(received)
        if not waiting:
            continue
        for header, output, seconds in compute(waiting):
            _answer(outbox, header, output, seconds, name)


def _receive(inbox: Inbox, timeout: float) -> tuple[dict, torch.Tensor] | None:
    while True:
        try:
            return inbox.receive(timeout)
        except ValueError:
            continue  # a malformed message has no header to answer to


def _answer(outbox: Outbox, header: dict, output: Answer, seconds: float, name: str) -> None:
    try:
        if isinstance(output, Exception):
            raise output
        if output is None:
            return
        timings = [*header.get("timings", []), [name, seconds]]
        route = header["route"]
        target, rest = (route[0], route[1:]) if route else (header["reply"], [])
        kind = header["kind"] if route else "result"
        outbox.send(target, {**header, "route": rest, "kind": kind, "timings": timings}, output)
    except Exception as error:  # reported to the coordinator, which decides what to do
        message = f"agent {name}: {error}"
        try:
            outbox.send(header["reply"], {**header, "kind": "error", "message": message, "error": type(error).__name__},
                        torch.empty(0))
        except zmq.ZMQError:
            pass  # the coordinator is gone too; nobody to tell
