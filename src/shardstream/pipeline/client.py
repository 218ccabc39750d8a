"""The coordinator's side of an agent's control plane: JSON over HTTP with the bearer token,
every failure turned into one sentence that names the agent and its URL."""

from __future__ import annotations

from urllib.parse import urlsplit

import httpx

from ..errors import AgentBusy, AuthenticationFailed, ShardstreamError, SourceUnreachable


class AgentClient:
    def __init__(self, url: str, token: str, timeout: float = 30.0):
        self.url = url.rstrip("/")
        self.name = self.url  # until capabilities tell the agent's own name
        self.host = urlsplit(self.url).hostname or "127.0.0.1"
        self._client = httpx.Client(base_url=self.url, timeout=timeout, headers={"Authorization": f"Bearer {token}"})

    def get(self, path: str, timeout: float | None = None) -> dict:
        return self._call("GET", path, None, timeout)

    def post(self, path: str, body: dict | None = None, timeout: float | None = None) -> dict:
        return self._call("POST", path, body or {}, timeout)

    def alive(self, timeout: float) -> bool:
        """Whether the agent answers its health check within `timeout` seconds."""
        try:
            return self._client.get("/v1/health", timeout=timeout).status_code == 200
        except httpx.HTTPError:
            return False

    def _call(self, method: str, path: str, body: dict | None, timeout: float | None) -> dict:
        who = f"agent {self.name} at {self.url}" if self.name != self.url else f"agent at {self.url}"
        try:
            response = self._client.request(method, path, json=body,
                                            timeout=timeout if timeout is not None else self._client.timeout)
        except httpx.HTTPError as error:
            raise SourceUnreachable(
                f"{who} could not be reached ({type(error).__name__}: {error}); start `shardstream agent` there "
                "or leave it out of --urls.") from None
        if response.status_code == 401:
            raise AuthenticationFailed(f"{who} refused the token (HTTP 401); pass the --token the agent was started with.")
        if response.status_code == 409:   # it serves another coordinator: its own sentence says which and what to do
            raise AgentBusy(_detail(response))
        if response.status_code != 200:
            raise ShardstreamError(f"{who} answered {method} {path} with HTTP {response.status_code}: {_detail(response)}")
        return response.json()

    def close(self) -> None:
        self._client.close()


def _detail(response: httpx.Response) -> str:
    try:
        return str(response.json().get("detail", response.text))
    except ValueError:
        return response.text[:200]
