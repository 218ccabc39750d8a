"""Coordinators and agents as a user runs them, all real processes on 127.0.0.1 started
through the `shardstream` CLI: an agent serves one coordinator and refuses a second (unless it
takes over); a coordinator whose stages are gone (taken over, agent started again) re-deploys or
answers 503; /health says "deploying" until the stages are loaded; an agent joins a running
coordinator; a --serve-port in use is one line; `agent --max-memory` bounds the whole process.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from shardstream.pipeline.local import LocalAgent, spawn_agents
from tiny_models import llama_store_with_tokenizer
import warm_python

TOKEN = "test-token"
PROMPT = "Once upon a time"
CLI = [sys.executable, "-m", "shardstream"]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


class Running:
    """A CLI process whose output (stdout and stderr together) is read as it comes."""

    def __init__(self, command: list[str]):
        self.process = warm_python.popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
        self.output = ""
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.output += line

    def wait_for(self, pattern: str, timeout: float = 240.0) -> re.Match:
        deadline = time.monotonic() + timeout
        while not (found := re.search(pattern, self.output)):
            assert self.process.poll() is None or self._reader.is_alive(), f"it exited:\n{self.output}"
            assert time.monotonic() < deadline, f"no {pattern!r} in:\n{self.output}"
            time.sleep(0.05)
        return found

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        self.process.wait(30)
        self._reader.join(10)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(store path, expected greedy text of 5 new tokens)."""
    store, reference, tokenizer = llama_store_with_tokenizer(tmp_path_factory.mktemp("model"))
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    new = reference.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)[0, ids.shape[1]:]
    return store, tokenizer.decode(new, skip_special_tokens=True)


@pytest.fixture(scope="module")
def agents(tmp_path_factory):
    started = spawn_agents(["a", "b"], TOKEN, tmp_path_factory.mktemp("agents"), start=warm_python.popen)
    yield started
    for agent in started:
        agent.stop()


@pytest.fixture
def coordinators():
    """Starts `shardstream coordinator ... --serve-port 0` processes; stops whatever is left at the end."""
    started: list[Running] = []

    def start(store: Path, urls: list[str], work: Path, *extra: str, wait: bool = True) -> tuple[Running, str]:
        running = Running([*CLI, "coordinator", "--model", str(store), "--token", TOKEN, "--urls", ",".join(urls),
                           "--context-length", "64", "--probe-bytes", "0", "--work-dir", str(work),
                           "--serve-port", "0", *extra])
        started.append(running)
        url = running.wait_for(r"(?:coordinator|serving /v1/completions) on (http://127\.0\.0\.1:\d+)").group(1)
        if wait:
            running.wait_for(r"serving /v1/completions on")
        return running, url

    yield start
    for running in started:
        running.stop()


def _complete(url: str) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 5, "temperature": 0},
                      headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120)


def _text(url: str) -> str:
    reply = _complete(url)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


def test_a_second_coordinator_is_refused_unless_it_takes_over(tiny, agents, coordinators, tmp_path):
    """The second coordinator says which one the agents serve and how to take over,
    and leaves the first one serving; with --take-over the first answers 503 (never 400), and once
    the second is gone (SIGKILL) the first re-deploys and answers again."""
    store, expected = tiny
    urls = [a.url for a in agents]
    _, first = coordinators(store, urls, tmp_path / "first")
    assert _text(first) == expected

    refused = warm_python.run([*CLI, "coordinator", "--model", str(store), "--token", TOKEN, "--urls", ",".join(urls),
                               "--context-length", "64", "--probe-bytes", "0", "--work-dir", str(tmp_path / "second"),
                               "--serve-port", "0"], capture_output=True, text=True, timeout=300, env=ENV)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr
    assert re.fullmatch(rf"error: agent a: it serves the coordinator at {first} \(since \d\d:\d\d:\d\d\); stop that "
                        r"coordinator, or start this one with --take-over to take the agent from it\.",
                        refused.stderr.strip().splitlines()[-1]), refused.stderr
    assert _text(first) == expected   # the agents were left alone

    taker, third = coordinators(store, urls, tmp_path / "third", "--take-over")
    assert _text(third) == expected
    lost = _complete(first)
    assert lost.status_code == 503, lost.text
    error = lost.json()["error"]
    assert (error["type"], error["code"]) == ("server_error", "pipeline_unavailable")
    assert f"it serves the coordinator at {third}" in error["message"] and "--take-over" in error["message"]
    health = httpx.get(first + "/health")
    assert health.status_code == 503 and health.json()["status"] == "unavailable"

    taker.stop(signal.SIGKILL)
    assert _text(first) == expected   # the agents are free again: re-deployed
    assert httpx.get(first + "/health").json()["status"] == "ok"


def test_an_agent_started_again_gets_its_stage_back(tiny, agents, coordinators, tmp_path):
    """An agent SIGKILLed between requests and started again at the same address holds
    no stage; the coordinator's next request re-deploys instead of failing. Started again on another
    data port, its steps go nowhere: the coordinator's check of the route finds it stage-less."""
    store, expected = tiny
    _, url = coordinators(store, [a.url for a in agents], tmp_path / "work")
    assert _text(url) == expected
    states = [httpx.get(a.url + "/v1/health", headers={"Authorization": f"Bearer {TOKEN}"}).json() for a in agents]
    victim = next(i for i, state in enumerate(states)   # an agent that holds a stage for this coordinator
                  if state["stage_id"] and state.get("coordinator", url) == url)
    agents[victim] = _start_again(agents[victim], tmp_path, "same")
    assert _text(url) == expected
    assert httpx.get(url + "/health").json()["epoch"] == 1
    agents[victim] = _start_again(agents[victim], tmp_path, "other")
    assert _text(url) == expected
    assert httpx.get(url + "/health").json()["epoch"] == 2


def _start_again(agent: LocalAgent, folder: Path, data_port: str) -> LocalAgent:
    """SIGKILL the agent and start it again on the same HTTP port and the "same" data port (so that
    old code's steps reach it and are answered at once) or an "other" one."""
    ports = json.loads((agent.log.parent / f"{agent.name}.ready.json").read_text())
    agent.kill()
    ready = folder / f"{agent.name}.{data_port}.json"
    process = warm_python.popen([*CLI, "agent", "--name", agent.name, "--token", TOKEN, "--port", str(ports["port"]),
                                 "--data-port", str(ports["data_port"]) if data_port == "same" else "0",
                                 "--ready-file", str(ready),
                                 "--cache-dir", str(folder / agent.name)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    while not ready.exists() or not _answers(agent.url + "/v1/health"):
        assert process.poll() is None and time.monotonic() < deadline, "the agent did not start again"
        time.sleep(0.1)
    return LocalAgent(agent.name, agent.url, process, agent.log)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_health_says_deploying_until_the_stages_are_loaded(tiny, agents, coordinators, tmp_path):
    """Agent b is stopped (SIGSTOP) as the coordinator starts deploying, so it cannot
    finish; meanwhile /health is a 503 "deploying", and the API a 503 too."""
    store, expected = tiny
    running, url = coordinators(store, [a.url for a in agents], tmp_path / "work", wait=False)
    agents[1].process.send_signal(signal.SIGSTOP)
    try:
        health = httpx.get(url + "/health", timeout=10)
        assert (health.status_code, health.json()) == (503, {"status": "deploying"})
        early = _complete(url)
        assert early.status_code == 503 and "still deploying" in early.json()["error"]["message"]
    finally:
        agents[1].process.send_signal(signal.SIGCONT)
    running.wait_for(r"serving /v1/completions on")
    health = httpx.get(url + "/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert _text(url) == expected


def test_an_agent_joins_a_running_coordinator(tiny, agents, coordinators, tmp_path):
    """`agent --join URL` asks a running coordinator to take it in: the coordinator
    re-plans with it and prints the new plan, the agent prints it too, and requests still answer."""
    store, expected = tiny
    running, url = coordinators(store, [agents[0].url] * 2, tmp_path / "work")   # listed twice: "two agents named 'a'"
    assert _text(url) == expected
    assert httpx.get(url + "/health").json()["agents"] == ["a"]
    late = Running([*CLI, "agent", "--name", "late", "--token", TOKEN, "--port", "0", "--cache-dir",
                    str(tmp_path / "late"), "--join", url])
    try:
        late.wait_for(rf"agent late joined the coordinator at {url} \(plan epoch 1\):\ndevice +layers")
        running.wait_for(r"re-planned \(plan epoch 1\):\ndevice +layers")
        assert httpx.get(url + "/health").json()["agents"] == ["a", "late"]
        assert _text(url) == expected

        twin = warm_python.run([*CLI, "agent", "--name", "a", "--token", TOKEN, "--port", "0", "--cache-dir",
                                str(tmp_path / "twin"), "--join", url], capture_output=True, text=True, timeout=300)
        assert twin.returncode == 1 and "Traceback" not in twin.stderr, twin.stderr
        assert f"an agent named 'a' is in this pipeline already ({agents[0].url}); start the one at" \
               in twin.stderr.strip().splitlines()[-1]
        lost = warm_python.run([*CLI, "agent", "--name", "lost", "--token", TOKEN, "--port", "0", "--cache-dir",
                                str(tmp_path / "lost"), "--join", agents[0].url], capture_output=True, text=True,
                               timeout=300)   # an agent, not a coordinator: its 404 body was shown as it was
        assert lost.returncode == 1 and "Traceback" not in lost.stderr, lost.stderr
        assert lost.stderr.strip().splitlines()[-1] == (
            f"error: {agents[0].url} answers no join (HTTP 404): it is not a coordinator's --serve-port; give --join "
            "that URL.")
    finally:
        late.stop()


def test_a_serve_port_in_use_is_one_line(tiny, agents, tmp_path):
    """No traceback, exit code 1, the sentence says what to do."""
    store, _ = tiny
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = warm_python.run([*CLI, "coordinator", "--model", str(store), "--token", TOKEN, "--urls", agents[0].url,
                               "--context-length", "64", "--work-dir", str(tmp_path), "--serve-port", str(port)],
                              capture_output=True, text=True, timeout=300, env=ENV)
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
    assert run.stderr.strip().splitlines()[-1] == (
        f"error: the coordinator cannot listen on 127.0.0.1:{port} (Address already in use); stop what uses that "
        "port or pick another --serve-port.")


def test_max_memory_bounds_the_whole_agent_process(tmp_path):
    """`agent --max-memory` is what the process may use in all, as in a container that
    size: it offers the limit less what it holds already; below that it warns and offers nothing."""
    help_text = warm_python.run([*CLI, "agent", "--help"], capture_output=True, text=True, timeout=120, env=ENV).stdout
    assert "Memory this agent process may use in all" in " ".join(help_text.replace("│", " ").split())   # rich's table
    for limit, label in [(1500, "roomy"), (100, "tight")]:
        ready = tmp_path / f"{label}.json"
        agent = Running([*CLI, "agent", "--name", label, "--token", TOKEN, "--port", "0", "--ready-file", str(ready),
                         "--cache-dir", str(tmp_path / label), "--max-memory", f"{limit}MiB", "--quiet"])
        try:
            agent.wait_for(f"agent {label} listening")
            port = json.loads(ready.read_text())["port"]
            while not _answers(f"http://127.0.0.1:{port}/v1/health"):
                assert agent.process.poll() is None, agent.output
                time.sleep(0.1)
            offer = httpx.get(f"http://127.0.0.1:{port}/v1/capabilities", headers={"Authorization": f"Bearer {TOKEN}"},
                              timeout=30).json()
        finally:
            agent.stop()
        held = offer["process_rss_bytes"]
        assert held > 50 * 2**20   # Python and torch
        if label == "tight":
            assert offer["ram_available_bytes"] == 0
            assert re.search(r"warning: --max-memory 100MiB is less than the [\d.]+ MiB this agent holds already "
                             r"\(Python, torch\); it offers the coordinator no memory\.", agent.output)
        elif offer["host_ram_available_bytes"] > limit * 2**20:   # else the host's free RAM is the bound
            assert offer["ram_available_bytes"] == limit * 2**20 - held
