"""Agents as local subprocesses on 127.0.0.1: for trying a pipeline on one machine, tests and benchmarks."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from ..errors import SourceUnreachable
from ..switches import PARENT_PID


@dataclass
class LocalAgent:
    name: str
    url: str
    process: subprocess.Popen
    log: Path

    def kill(self) -> None:
        """SIGKILL: the agent gets no chance to say goodbye, as when a device loses power."""
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


def spawn_agents(names: list[str], token: str, folder: Path, timeout: float = 300.0,
                 advertise: bool = False, wrapper: list[str] = (), threads: int | None = None,
                 arguments: list[str] = (),
                 start: Callable[..., subprocess.Popen] = subprocess.Popen) -> list[LocalAgent]:
    """Start one agent process per name (all at once; announced by mDNS with `advertise`; each run
    under `wrapper`, e.g. a memory cap: `["memcap", "400M", "--"]`; `arguments`: more of the agent
    command's options; `start`: what starts a process, with subprocess.Popen's arguments), then wait
    until each answers its health check. They split the host's cores
    (`--threads`, unless `threads` is given: one request's stages run one after the other, so each
    may take them all), so they do not oversubscribe it.
    Each agent binds free ports itself and reports them in a ready file, so no port can be taken
    between choosing and binding it."""
    folder.mkdir(parents=True, exist_ok=True)
    threads = str(threads or max(1, (os.cpu_count() or 1) // len(names)))   # agents on one host split its cores
    started = []
    for name in names:
        log, ready = folder / f"{name}.log", folder / f"{name}.ready.json"
        ready.unlink(missing_ok=True)
        command = [*wrapper, sys.executable, "-m", "shardstream.pipeline.cli", "agent", "--name", name, "--token", token,
                   "--host", "127.0.0.1", "--port", "0", "--ready-file", str(ready),
                   "--cache-dir", str(folder / name), "--threads", threads, *arguments] + (["--advertise"] if advertise else [])
        with open(log, "wb") as out:
            process = start(command, stdout=out, stderr=subprocess.STDOUT,
                            env={**os.environ, PARENT_PID.name: str(os.getpid())})
        started.append((LocalAgent(name, "", process, log), ready))
    agents = [agent for agent, _ in started]
    deadline = time.monotonic() + timeout
    for agent, ready in started:
        while not (agent.url or _read_port(agent, ready)) or not _healthy(agent, token):
            if agent.process.poll() is not None or time.monotonic() > deadline:
                for other in agents:
                    other.stop()
                raise SourceUnreachable(f"agent {agent.name} did not start; see {agent.log}.")
            time.sleep(0.1)
    return agents


def _read_port(agent: LocalAgent, ready: Path) -> bool:
    """Set the agent's URL from its ready file, once it has written one."""
    if not ready.is_file():
        return False
    agent.url = f"http://127.0.0.1:{json.loads(ready.read_text())['port']}"
    return True




def follow_parent() -> None:
    """In an agent started by `spawn_agents`: get SIGTERM when the process that started it is gone,
    so no local agent outlives a crashed demo or test run (Linux prctl PR_SET_PDEATHSIG). Done in
    the agent itself, not in a `preexec_fn`, which can deadlock a parent that has threads. Under a
    wrapper the agent's parent is the wrapper, so a thread watches the starting process instead."""
    parent = PARENT_PID.pop()
    if parent is None or sys.platform != "linux":
        return
    if os.getppid() != int(parent):   # started through a `wrapper` (memcap): watch the starter instead
        threading.Thread(target=_stop_when_gone, args=(int(parent),), name="follow-parent", daemon=True).start()
        return
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)   # 1 = PR_SET_PDEATHSIG
    if os.getppid() != int(parent):   # the parent died before the line above
        sys.exit(0)


def _stop_when_gone(pid: int) -> None:
    """SIGTERM this process once process `pid` no longer exists (checked every second)."""
    while True:
        time.sleep(1.0)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            os.kill(os.getpid(), signal.SIGTERM)
            return


def _healthy(agent: LocalAgent, token: str) -> bool:
    try:
        return httpx.get(agent.url + "/v1/health", headers={"Authorization": f"Bearer {token}"}, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
