"""Where and how serve's HTTP side listens, shared by one process's `serve`, rank 0 of `serve
--tensor-parallel` and the pipeline's coordinator: the port bound before the model loads (a port in
use is said at once), the uvicorn server that leaves the signals to serve, the OpenAI app over an engine,
and how serve stops on a signal."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import InvalidOption
from ..listener import listening


@dataclass(frozen=True)
class Endpoint:
    """What serve's HTTP side is told: where it listens and how it answers (one process or TP's rank 0)."""

    host: str
    port: int
    names: list[str]
    max_batch_size: int
    api_key: str | None
    template: str | None
    max_request_bytes: int
    quiet: bool

    def app(self, model, tokenizer, engine):
        """The OpenAI API over `engine`, logging a line per request unless quiet; with MoE experts read on
        demand, /health also says what they read and what their cache saved."""
        from ..serving.server import create_app

        experts = getattr(model, "experts", None)
        health = (lambda: {"status": "ok", "experts": experts.report()}) if experts is not None else None
        return create_app(model, tokenizer, self.names[0], engine=engine, aliases=tuple(self.names[1:]),
                          api_key=self.api_key, chat_template=self.template, max_request_bytes=self.max_request_bytes,
                          health=health)

    def listening(self, port: int, more: str = "") -> str:
        return (f"shardstream serve: listening on http://{self.host}:{port} (model {', '.join(self.names)}; "
                f"batches of up to {self.max_batch_size}{more})")


def log_batch_bounds() -> None:
    """The engine's INFO lines (which bound limits the batch: --max-batch-size or memory) go to stderr,
    even with --quiet."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("shardstream serve: %(message)s"))
    engine_log = logging.getLogger("shardstream.batching")
    engine_log.addHandler(handler)
    engine_log.setLevel(logging.INFO)


def say_resident(model, who: str = "the model") -> None:
    """One line at start: how many blocks stay in memory between passes and the budget they were chosen
    within, so that an operator sees what `--max-resident-memory` came to (`auto`: a share of the memory)."""
    blocks = len(model.resident_blocks)
    say(f"shardstream serve: {who} keeps {blocks} block{'' if blocks == 1 else 's'} in memory between passes "
        f"(resident budget {model.resident_budget >> 20} MiB)")


def server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn re-raises SIGTERM after shutting down, which would kill the process before the engine
        closes and the shutdown line prints; serve handles the signals itself."""

        @contextlib.contextmanager
        def capture_signals(self):
            yield

    return Server


def stop_on_signals(stop: Callable[[signal.Signals], None]) -> None:
    """SIGINT and SIGTERM (Ctrl-C, `kill`): the first calls `stop` with it, in a thread of its own (a signal
    handler may have interrupted a lock's holder), which answers the requests in flight with an error and
    ends the server, without waiting for them; a second ends the process at once, with 128 + its number."""
    stopping = False

    def handle(number: int, frame) -> None:
        nonlocal stopping
        if stopping:
            say(f"shardstream serve: {signal.Signals(number).name} again; stopped at once")
            os._exit(128 + number)
        stopping = True
        threading.Thread(target=stop, args=(signal.Signals(number),), name="shardstream-stop", daemon=True).start()

    for number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(number, handle)


def bind(host: str, port: int) -> socket.socket:
    listener = listening(host, port, "the server", "--port")
    listener.listen(2048)
    return listener


def read_template(path: Path | None) -> str | None:
    """The --chat-template file's text, refused before the server starts where it is not a template."""
    if path is None:
        return None
    try:
        text = path.read_text()
    except OSError as error:
        raise InvalidOption(f"cannot read --chat-template {path} ({error.strerror}); give a readable Jinja file.") from None
    except UnicodeDecodeError:
        raise InvalidOption(f"--chat-template {path} is not UTF-8 text; give a Jinja template file.") from None
    from jinja2 import TemplateSyntaxError
    from transformers.utils.chat_template_utils import _compile_jinja_template   # as apply_chat_template compiles

    try:
        _compile_jinja_template(text)
    except TemplateSyntaxError as error:
        raise InvalidOption(f"--chat-template {path} line {error.lineno}: {error.message}; "
                            "fix the Jinja template.") from None
    return text


def say(line: str) -> None:
    """`line` to stderr in one write: tensor-parallel ranks share their launcher's stderr, and a line
    written apart from its newline (print's two writes, unbuffered) can run into another rank's."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
