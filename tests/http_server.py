"""Real HTTP servers for tests, on 127.0.0.1 in a background thread, with Range support.

`serve_directory(path)` serves a folder's files at `/<name>`; `serve_hub({repo_id: path})` answers
the Hub's `/{repo_id}/resolve/{revision}/{filename}` URLs with the headers huggingface_hub expects
(ETag, X-Repo-Commit, X-Error-Code), so the real client can download from it via HF_ENDPOINT.
Both yield `(base_url, request_log)`; the log records every request and how many body bytes it got.
"""

from __future__ import annotations

import hashlib
import re
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

HUB_COMMIT = "0123456789abcdef0123456789abcdef01234567"


@dataclass(frozen=True)
class LoggedRequest:
    method: str
    path: str
    range: str | None
    status: int
    body_bytes: int


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, handler: type[BaseHTTPRequestHandler], ranges: bool) -> None:
        super().__init__(("127.0.0.1", 0), handler)
        self.ranges = ranges
        self.log: list[LoggedRequest] = []


class _FileHandler(BaseHTTPRequestHandler):
    """Serves whatever `locate` maps the URL to, honouring `Range: bytes=a-` and `bytes=a-b`."""

    protocol_version = "HTTP/1.1"
    server: _Server

    def locate(self, url_path: str) -> tuple[Path | None, dict[str, str]]:
        """The file for this URL (None for a 404) and extra headers for the answer."""
        raise NotImplementedError

    def do_HEAD(self) -> None:
        self._serve(send_body=False)

    def do_GET(self) -> None:
        self._serve(send_body=True)

    def log_message(self, format: str, *args: object) -> None:  # keep test output clean
        pass

    def _serve(self, send_body: bool) -> None:
        path, headers = self.locate(unquote(urlsplit(self.path).path))
        if path is None or not path.is_file():
            return self._reply(404, headers, b"", send_body)
        data = path.read_bytes()
        start, end, status = 0, len(data), 200
        match = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        if match and self.server.ranges:
            start = int(match[1])
            end = min(int(match[2]) + 1, len(data)) if match[2] else len(data)
            if start >= len(data):
                return self._reply(416, {**headers, "Content-Range": f"bytes */{len(data)}"}, b"", send_body)
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{len(data)}"
        self._reply(status, {**headers, "Accept-Ranges": "bytes"}, data[start:end], send_body)

    def _reply(self, status: int, headers: dict[str, str], body: bytes, send_body: bool) -> None:
        # Logged before the reply goes out: a client that has its answer must find the request in the log.
        self.server.log.append(
            LoggedRequest(self.command, self.path, self.headers.get("Range"), status, len(body) if send_body else 0)
        )
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if send_body:
            self.wfile.write(body)


@contextmanager
def _serving(handler: type[_FileHandler], ranges: bool) -> Iterator[tuple[str, list[LoggedRequest]]]:
    server = _Server(handler, ranges)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/", server.log
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@contextmanager
def serve_directory(root: Path, *, ranges: bool = True) -> Iterator[tuple[str, list[LoggedRequest]]]:
    """Serve `root` at the base URL; `ranges=False` mimics a server that ignores Range."""

    class Handler(_FileHandler):
        def locate(self, url_path: str) -> tuple[Path | None, dict[str, str]]:
            return Path(root) / url_path.lstrip("/"), {}

    with _serving(Handler, ranges) as served:
        yield served


@contextmanager
def serve_hub(
    repos: dict[str, Path], *, published: dict[str, str] | None = None, token: str | None = None,
    revision: str | None = None,
) -> Iterator[tuple[str, list[LoggedRequest]]]:
    """Answer Hub resolve URLs for each repo id (any revision, or only `revision`) from its folder;
    the ETag is the file's sha256, as the Hub's is for LFS files, unless `published` gives another
    for a file name. With `token`, the repos are private: other requests are told they do not exist."""

    class Handler(_FileHandler):
        def locate(self, url_path: str) -> tuple[Path | None, dict[str, str]]:
            match = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", url_path)
            private = token is not None and self.headers.get("Authorization") != f"Bearer {token}"
            if match is None or match[1] not in repos or private:
                return None, {"X-Error-Code": "RepoNotFound"}
            if revision is not None and unquote(match[2]) != revision:
                return None, {"X-Error-Code": "RevisionNotFound"}
            path = Path(repos[match[1]]) / match[3]
            if not path.is_file():
                return None, {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": HUB_COMMIT}
            etag = (published or {}).get(match[3]) or hashlib.sha256(path.read_bytes()).hexdigest()
            return path, {"ETag": f'"{etag}"', "X-Repo-Commit": HUB_COMMIT}

    with _serving(Handler, ranges=True) as served:
        yield served


def unused_port() -> int:
    """A port on 127.0.0.1 that nothing listens on: for "unreachable server" tests."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
