"""The pipeline end to end: three agents as real subprocesses on 127.0.0.1, a tiny llama split
over them, token-identical greedy output, a SIGKILL during generation, auth and corrupt stages.

Profiles are measured for real; the tests then fix gflops and round trips to equal values so the
plan is deterministic (throughput objective: equal devices split the blocks three ways).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest
import torch

from shardstream.errors import AuthenticationFailed, PlanInfeasible, SourceUnreachable
from shardstream.pipeline.cli import coordinator_command
from shardstream.pipeline.client import AgentClient
from shardstream.pipeline.coordinator import Coordinator, CoordinatorOptions
from shardstream.pipeline.generation import PipelineModel
from shardstream.pipeline.local import LocalAgent, spawn_agents
from shardstream.pipeline.package import package_stage
from shardstream.pipeline.server import BackgroundServer, coordinator_app
from shardstream.store import open_store
from shardstream.serving.protocol import NO_TOKEN, SamplingParams
from http_server import unused_port
from tiny_models import llama_store_with_tokenizer
import warm_python

TOKEN = "test-token"
KEY = "test-api-key"
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(store, reference model, tokenizer)."""
    store, reference, tokenizer = llama_store_with_tokenizer(tmp_path_factory.mktemp("pipeline"))
    return open_store(store), reference, tokenizer


@pytest.fixture(scope="module")
def agents(tmp_path_factory):
    started = spawn_agents(["a", "b", "c"], TOKEN, tmp_path_factory.mktemp("agents"), start=warm_python.popen)
    yield started
    for agent in started:
        agent.stop()


@contextmanager
def _serving(tiny, agents, folder: Path, names: list[str] | None = None, api_key: str | None = None):
    """A coordinator with its stage server, deployed over the live agents (those in `names`);
    yields (pipeline, server)."""
    store, _, tokenizer = tiny
    live = [a for a in agents if a.process.poll() is None and (names is None or a.name in names)]
    coordinator = Coordinator(store, [AgentClient(a.url, TOKEN) for a in live],
                              CoordinatorOptions(folder, context_length=64, objective="throughput"))
    coordinator.profile()
    for profile in coordinator.profiles.values():  # measured; made equal for a deterministic plan
        profile.gflops = 1e-3  # compute outweighs the hops, so more stages pay
        profile.rtt_seconds = {name: 1e-3 for name in profile.rtt_seconds}
        profile.bandwidth_bytes_per_s = {name: 1e8 for name in profile.bandwidth_bytes_per_s}
    pipeline = PipelineModel(coordinator, "127.0.0.1")
    server = BackgroundServer(coordinator_app(pipeline, tokenizer, "tiny", folder / "stages", TOKEN, api_key=api_key),
                              "127.0.0.1", 0)
    coordinator.stage_url = f"http://127.0.0.1:{server.port}/stages/"
    coordinator.deploy()
    try:
        yield pipeline, server
    finally:
        server.stop()
        pipeline.close()
        coordinator.close()


@pytest.fixture
def deployed(tiny, agents, tmp_path):
    """Three stages over agents a, b, c; the API wants the --token."""
    with _serving(tiny, agents, tmp_path) as served:
        yield served


@pytest.fixture
def keyed(tiny, agents, tmp_path):
    """Two stages over agents a and b; the API wants --api-key KEY."""
    with _serving(tiny, agents, tmp_path, ["a", "b"], KEY) as served:
        yield served


def _reference(reference, tokenizer, new: int) -> torch.Tensor:
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    return reference.generate(ids, max_new_tokens=new, do_sample=False, pad_token_id=0)[0]


def test_agents_report_capabilities_profiles_and_round_trips(agents):
    client = AgentClient(agents[0].url, TOKEN)
    capabilities = client.get("/v1/capabilities")
    assert capabilities["name"] == "a" and capabilities["cpu_count"] >= 1 and capabilities["torch"] == torch.__version__
    assert 0 < capabilities["ram_available_bytes"] <= capabilities["ram_total_bytes"]
    assert capabilities["torch_threads"] == max(1, capabilities["cpu_count"] // 3)   # three agents split the cores
    assert client.post("/v1/profile/matmul", {"size": 64, "repeats": 2})["gflops"] > 0
    assert client.post("/v1/profile/block", {"hidden_size": 32, "intermediate_size": 64})["gflops"] > 0
    net = client.post("/v1/net/ping", {"peers": [agents[1].url, "http://127.0.0.1:9"], "probe_bytes": 2**20})
    rtt, bandwidth = net["rtt_seconds"], net["bandwidth_bytes_per_s"]
    assert 0 < rtt[agents[1].url] < 1 and rtt["http://127.0.0.1:9"] is None
    assert bandwidth[agents[1].url] > 1e6 and bandwidth["http://127.0.0.1:9"] is None   # loopback: far above 1 MB/s
    assert len(httpx.get(agents[1].url + "/v1/net/blob", params={"size": 1000},
                         headers={"Authorization": f"Bearer {TOKEN}"}).content) == 1000
    too_big = httpx.post(agents[0].url + "/v1/net/ping", json={"peers": [], "probe_bytes": 2**30},
                         headers={"Authorization": f"Bearer {TOKEN}"})
    assert too_big.status_code == 422


@pytest.mark.parametrize("path", ["/v1/health", "/v1/capabilities", "/v1/stage/unload"])
def test_a_wrong_token_gets_401(agents, path):
    method = httpx.post if "stage" in path else httpx.get
    assert method(agents[0].url + path, headers={"Authorization": "Bearer nope"}).status_code == 401
    assert method(agents[0].url + path).status_code == 401


def test_the_coordinator_names_an_agent_that_refuses_the_token(agents, tiny, tmp_path):
    with pytest.raises(AuthenticationFailed, match=rf"agent at {agents[0].url} refused the token \(HTTP 401\); pass the --token"):
        Coordinator(tiny[0], [AgentClient(agents[0].url, "wrong")], CoordinatorOptions(tmp_path))


def test_the_coordinator_names_an_unreachable_agent(tiny, tmp_path):
    url = f"http://127.0.0.1:{unused_port()}"
    with pytest.raises(SourceUnreachable, match=rf"agent at {url} could not be reached .*start `shardstream agent` there"):
        Coordinator(tiny[0], [AgentClient(url, TOKEN)], CoordinatorOptions(tmp_path))


ORPHAN_SCRIPT = """
import os, sys
from pathlib import Path
from shardstream.pipeline.local import spawn_agents
print(spawn_agents(["orphan"], "t", Path(sys.argv[1]))[0].process.pid, flush=True)
os._exit(0)   # dies without stopping its agent
"""


def test_a_local_agent_does_not_outlive_the_process_that_started_it(tmp_path):
    run = warm_python.run([sys.executable, "-c", ORPHAN_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                          timeout=300)
    pid = int(run.stdout.split()[-1])
    deadline = time.monotonic() + 30
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _running(pid), "the agent outlived its parent"


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie waits for init to reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def test_an_agent_on_a_taken_port_says_so(agents):
    port = agents[0].url.rsplit(":", 1)[1]
    run = warm_python.run([sys.executable, "-m", "shardstream.pipeline.cli", "agent", "--name", "z", "--token", TOKEN,
                           "--host", "127.0.0.1", "--port", port], capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert f"the agent cannot listen on 127.0.0.1:{port} (Address already in use); stop what uses that port or pick another --port." in run.stderr
    run = warm_python.run([sys.executable, "-m", "shardstream.pipeline.cli", "agent", "--name", "z", "--token", TOKEN,
                           "--host", "no-such-host.invalid", "--port", "0"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and "Traceback" not in run.stderr   # it advised another --port
    assert "the agent cannot listen on no-such-host.invalid:0 (" in run.stderr
    assert "); give --host an address of this machine (127.0.0.1, 0.0.0.0 for every interface, or one of its own)." in run.stderr
    with socket.socket() as taken:   # the data port given and taken
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        data_port = taken.getsockname()[1]
        run = warm_python.run([sys.executable, "-m", "shardstream.pipeline.cli", "agent", "--name", "z", "--token", TOKEN,
                               "--host", "127.0.0.1", "--port", "0", "--data-port", str(data_port)],
                              capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert f"the agent cannot bind its data port {data_port}" in run.stderr and "pick another --data-port" in run.stderr


def test_greedy_output_over_three_agents_is_token_identical(tiny, deployed):
    _, reference, tokenizer = tiny
    pipeline, _ = deployed
    stages = pipeline.coordinator.route.plan.stages
    assert [s.device for s in stages] == ["a", "b", "c"]
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    out = pipeline.generate(ids, max_new_tokens=20)
    assert torch.equal(out[0], _reference(reference, tokenizer, 20))
    assert [t[0] for t in pipeline.last_timings] == ["a", "b", "c"]


def test_openai_completions_through_the_coordinator(tiny, deployed):
    _, reference, tokenizer = tiny
    _, server = deployed
    url = f"http://127.0.0.1:{server.port}/v1/completions"
    body = {"prompt": PROMPT, "max_tokens": 10, "temperature": 0}
    assert httpx.post(url, json=body).status_code == 401
    reply = httpx.post(url, json=body, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60).json()
    expected = tokenizer.decode(_reference(reference, tokenizer, 10)[len(PROMPT):], skip_special_tokens=True)
    assert reply["choices"][0]["text"] == expected
    stop = expected[4:6]
    stopped = httpx.post(url, json={**body, "stop": stop}, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60).json()
    assert stopped["choices"][0]["text"] == expected[:expected.index(stop)]
    assert stopped["choices"][0]["finish_reason"] == "stop" and stopped["usage"]["completion_tokens"] < 10


def test_stage_files_are_served_with_range_requests(tiny, deployed):
    pipeline, server = deployed
    package = package_stage(tiny[0], 0, 1, pipeline.coordinator.options.work_dir / "stages")
    url = f"http://127.0.0.1:{server.port}/stages/{package.stage_id}/stage.json"
    headers = {"Authorization": f"Bearer {TOKEN}", "Range": "bytes=2-9"}
    response = httpx.get(url, headers=headers)
    assert response.status_code == 206 and response.content == (package.folder / "stage.json").read_bytes()[2:10]


def test_a_corrupt_stage_file_is_retried_then_refused(tiny, agents, deployed):
    pipeline, _ = deployed
    package = package_stage(tiny[0], 1, 2, pipeline.coordinator.options.work_dir / "stages")
    victim = next(p for p in package.folder.rglob("*.safetensors"))
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.unlink()  # a hard link into the store: replace it, do not write through it
    victim.write_bytes(data)
    url = pipeline.coordinator.stage_url + package.stage_id + "/"
    client = AgentClient(agents[0].url, TOKEN)
    client.name = "a"
    try:
        with pytest.raises(Exception, match=rf"agent a: {url}{victim.relative_to(package.folder)} failed 3 downloads: "
                                            r"it arrived as \d+ bytes with checksum .*re-package"):
            client.post("/v1/stage/load", {"coordinator": pipeline.coordinator.id, "url": url,
                                            "stage_id": package.stage_id, "epoch": 9, "metadata_only": True})
    finally:
        shutil.rmtree(package.folder)
    assert client.get("/v1/health")["stage_id"] != package.stage_id


def test_the_cli_plans_deploys_and_generates(tiny, agents, tmp_path, capsys):
    store, reference, tokenizer = tiny
    coordinator_command(model=store.root, token=TOKEN, urls=",".join(a.url for a in agents), context_length=64,
                        work_dir=tmp_path, host="127.0.0.1", generate=PROMPT, max_new_tokens=8,
                        pipeline_order="c,b,a", mem_fraction=0.5)
    out = capsys.readouterr().out
    expected = tokenizer.decode(_reference(reference, tokenizer, 8)[len(PROMPT):], skip_special_tokens=True)
    assert "latency:" in out and out.rstrip().endswith(expected)
    assert (tmp_path / "plan.json").is_file()


def test_a_killed_agent_is_detected_replanned_and_the_output_is_the_same(tiny, agents, deployed, monkeypatch, tmp_path):
    """Kills agent b, then starts it again at the same address: the next request takes it back."""
    _, reference, tokenizer = tiny
    pipeline, _ = deployed
    coordinator = pipeline.coordinator
    coordinator.options.readmit_after_s = 0.0
    assert [s.device for s in coordinator.route.plan.stages] == ["a", "b", "c"]
    killed_at, detected_at = [], []
    recover = coordinator.recover
    monkeypatch.setattr(coordinator, "recover", lambda name: detected_at.append(time.monotonic()) or recover(name))

    class KillAfterFive:
        def __init__(self):
            self.seen = 0

        def put(self, value):
            self.seen += 1
            if self.seen == 6:  # the prompt, then five new tokens
                agents[1].kill()
                killed_at.append(time.monotonic())

        def end(self):
            pass

    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    out = pipeline.generate(ids, max_new_tokens=20, streamer=KillAfterFive())
    assert torch.equal(out[0], _reference(reference, tokenizer, 20))
    assert pipeline.recoveries == 1 and detected_at[0] - killed_at[0] < 2.0
    assert [s.device for s in coordinator.route.plan.stages] == ["a", "c"] and coordinator.route.epoch == 1

    assert pipeline.generate(ids, max_new_tokens=3).shape[1] == ids.shape[1] + 3   # b is still down: no change
    assert coordinator.route.epoch == 1 and "b" in coordinator.lost
    agents[1] = _restart(agents[1], tmp_path)
    out = pipeline.generate(ids, max_new_tokens=20)
    assert torch.equal(out[0], _reference(reference, tokenizer, 20))
    assert "b" in coordinator.agents and not coordinator.lost and coordinator.route.epoch == 2
    assert "b" in [s.device for s in coordinator.route.plan.stages]   # measured now, b outruns a and c's fixed 1 MFLOPS


def _restart(agent: LocalAgent, folder) -> LocalAgent:
    """The same agent, started again at the same address (the fixture stops it at the end). Its data port
    is any free one, as when the fixture started it (the coordinator profiles a re-admitted agent again):
    the default, the HTTP port + 1, was once in use already (a fresh clone's `make test`), and the restart failed."""
    ready = folder / f"{agent.name}.ready.json"
    process = warm_python.popen([sys.executable, "-m", "shardstream.pipeline.cli", "agent", "--name", agent.name,
                                 "--token", TOKEN, "--host", "127.0.0.1", "--port", agent.url.rsplit(":", 1)[1],
                                 "--data-port", "0", "--ready-file", str(ready), "--cache-dir", str(folder / agent.name)])
    client, deadline = AgentClient(agent.url, TOKEN), time.monotonic() + 180   # a loaded 2-core machine
    while not ready.exists() or not client.alive(timeout=1.0):
        assert process.poll() is None and time.monotonic() < deadline, "the restarted agent did not come up"
        time.sleep(0.1)
    client.close()
    return LocalAgent(agent.name, agent.url, process, agent.log)


def test_when_the_agents_left_cannot_hold_the_model_the_error_says_so(tiny, agents, deployed):
    pipeline, _ = deployed
    coordinator = pipeline.coordinator
    coordinator.options.mem_fraction = 1e-9
    left = ", ".join(name for name in coordinator.agents if name != "c")   # b may be gone already
    with pytest.raises(PlanInfeasible, match=rf"agent c was lost and the agents left \({re.escape(left)}\) cannot hold the model: No split"):
        coordinator.recover("c")


class KillAt:
    """A streamer that SIGKILLs an agent once the prompt and `after` new tokens have streamed."""

    def __init__(self, agent: LocalAgent, after: int):
        self.agent, self.left, self.killed_at = agent, after + 1, None

    def put(self, value):
        self.left -= 1
        if self.left == 0:
            self.agent.kill()
            self.killed_at = time.monotonic()

    def end(self):
        pass


def _deploy_in_order(coordinator: Coordinator, agents: list[LocalAgent], order: list[str] | None,
                     stage: int) -> tuple[list[str], int]:
    """Deploy with --pipeline-order `order` (lost agents re-admitted at once); (the stage order, the
    index in `agents` of the agent that holds `stage`)."""
    coordinator.options.pipeline_order, coordinator.options.readmit_after_s = order, 0.0
    expected_order = order or ["a", "b", "c"]
    assert [s.device for s in coordinator.deploy().plan.stages] == expected_order
    return expected_order, next(i for i, a in enumerate(agents) if a.name == expected_order[stage])


# every stage position and both orders, each pair of them once (the order decides which agent holds a stage)
@pytest.mark.parametrize(("stage", "order"), [(0, ["c", "a", "b"]), (1, None), (2, ["c", "a", "b"])],
                         ids=["first-order-c,a,b", "middle-no-order", "last-order-c,a,b"])
def test_recovery_keeps_the_pipeline_order(tiny, agents, deployed, tmp_path, order, stage):
    """SIGKILL the agent of one stage mid-generation: the re-plan keeps the others in --pipeline-order,
    the text stays identical, and the agent, started again, is taken back in its place."""
    _, reference, tokenizer = tiny
    pipeline, _ = deployed
    coordinator = pipeline.coordinator
    expected_order, victim = _deploy_in_order(coordinator, agents, order, stage)
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    out = pipeline.generate(ids, max_new_tokens=8, streamer=KillAt(agents[victim], 3))
    assert torch.equal(out[0], _reference(reference, tokenizer, 8)) and pipeline.recoveries == 1
    left = [name for name in expected_order if name != agents[victim].name]
    assert [s.device for s in coordinator.route.plan.stages] == left
    agents[victim] = _restart(agents[victim], tmp_path)
    out = pipeline.generate(ids, max_new_tokens=8)
    assert torch.equal(out[0], _reference(reference, tokenizer, 8))
    assert agents[victim].name in coordinator.agents and not coordinator.lost
    used = [expected_order.index(s.device) for s in coordinator.route.plan.stages]
    assert used == sorted(used)   # the re-admitted agent is back in its place of the order


def test_an_agent_reports_its_cgroup_limit_and_max_memory(tmp_path):
    """A real cgroup (memcap, as Docker sets one): the agent offers what it may use, not the host's RAM."""
    memcap = Path("/work/shared/tools/memcap")
    if not memcap.is_file() or not Path("/sys/fs/cgroup/memory").is_dir() and not Path("/sys/fs/cgroup/cgroup.controllers").is_file():
        pytest.skip("needs shared/tools/memcap and a cgroup memory controller")
    reports = {}
    for label, prefix, extra in [("cgroup", [str(memcap), "700M", "--"], []), ("flag", [], ["--max-memory", "700MiB"])]:
        ready = tmp_path / f"{label}.json"
        start = subprocess.Popen if prefix else warm_python.popen   # memcap runs the interpreter it is given
        process = start([*prefix, sys.executable, "-m", "shardstream.pipeline.cli", "agent", "--name", label,
                         "--token", TOKEN, "--port", "0", "--ready-file", str(ready),
                         "--cache-dir", str(tmp_path / label), *extra], stdout=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 120
            while not ready.exists():
                assert process.poll() is None and time.monotonic() < deadline, "the agent did not start"
                time.sleep(0.1)
            client = AgentClient(f"http://127.0.0.1:{json.loads(ready.read_text())['port']}", TOKEN)
            while not client.alive(timeout=1.0):
                time.sleep(0.1)
            reports[label] = client.get("/v1/capabilities")
            client.close()
        finally:
            process.terminate()
            printed = process.communicate(timeout=30)[0]
        port = json.loads(ready.read_text())["port"]
        assert f"agent {label} listening on http://127.0.0.1:{port}" in printed   # the default host: loopback only
        assert re.search(r"GET /v1/capabilities 200 \d+\.\d{3}s", printed)
        assert printed.endswith(f"agent {label} stopped\n")
    assert 0 < reports["cgroup"]["ram_available_bytes"] <= 700 * 2**20 < reports["cgroup"]["host_ram_available_bytes"]
    assert 0 < reports["flag"]["ram_available_bytes"] <= 700 * 2**20 - reports["flag"]["process_rss_bytes"]


def test_serve_port_0_picks_a_free_port_and_prints_it(tiny, agents, tmp_path):
    """Also: SHARDSTREAM_API_KEY sets the API's key, which the agents' token then does not replace."""
    store, reference, tokenizer = tiny
    live = ",".join(a.url for a in agents if a.process.poll() is None)
    process = warm_python.popen([sys.executable, "-m", "shardstream.pipeline.cli", "coordinator", "--model", str(store.root),
                                 "--token", TOKEN, "--urls", live, "--context-length", "64", "--probe-bytes", "0",
                                 "--work-dir", str(tmp_path), "--serve-port", "0"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "SHARDSTREAM_API_KEY": KEY})
    try:
        printed = ""
        while "serving" not in printed:
            line = process.stdout.readline()
            assert line, f"the coordinator exited: {printed}"
            printed += line
        url = re.search(r"serving /v1/completions on (http://127\.0\.0\.1:\d+) \(bearer --api-key required", printed).group(1)
        assert not url.endswith(":0")
        body = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0}
        assert httpx.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 401
        reply = httpx.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=120).json()
        expected = tokenizer.decode(_reference(reference, tokenizer, 5)[len(PROMPT):], skip_special_tokens=True)
        assert reply["choices"][0]["text"] == expected
    finally:
        process.terminate()
        process.wait(30)


def test_the_cli_samples_with_a_seed_and_stops_at_a_stop_string(tiny, agents, tmp_path, capsys):
    store, reference, tokenizer = tiny
    live = ",".join(a.url for a in agents if a.process.poll() is None)
    texts = []
    for _ in range(2):
        coordinator_command(model=store.root, token=TOKEN, urls=live, context_length=4096, work_dir=tmp_path,
                            probe_bytes=0, generate=PROMPT, max_new_tokens=8, temperature=0.8, top_k=5, seed=7)
        texts.append(capsys.readouterr())
    sampled = [t.out.split("(sum of stages)\n", 1)[1] for t in texts]   # after the plan table, whose timings vary
    assert sampled[0] == sampled[1] and sampled[0].strip() and "exceeds the model's 64 tokens" in texts[0].err
    greedy = tokenizer.decode(_reference(reference, tokenizer, 8)[len(PROMPT):], skip_special_tokens=True)
    coordinator_command(model=store.root, token=TOKEN, urls=live, context_length=64, work_dir=tmp_path,
                        probe_bytes=0, generate=PROMPT, max_new_tokens=8, stop=[greedy[4:6]])
    assert greedy.index(greedy[4:6]) > 0
    assert capsys.readouterr().out.split("(sum of stages)\n", 1)[1].rstrip("\n") == greedy[:greedy.index(greedy[4:6])]
    coordinator_command(model=store.root, token=TOKEN, urls=live, work_dir=tmp_path, probe_bytes=0, generate=PROMPT,
                        max_new_tokens=8)   # no --context-length: the model's 64 tokens, no warning on every run
    assert "exceeds the model's" not in capsys.readouterr().err


PROMPTS = [PROMPT, "The quick brown fox", "Hi", "In a hole in the ground there lived"]


def _greedy_ids(reference, tokenizer, prompt: str, new: int) -> list[int]:
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    return reference.generate(ids, max_new_tokens=new, do_sample=False, pad_token_id=0)[0, ids.shape[1]:].tolist()


def _collect(sequence) -> list[int]:
    return [event.token for event in sequence if event.token != NO_TOKEN]


def test_four_requests_in_flight_through_two_stages_equal_transformers(tiny, keyed):
    _, reference, tokenizer = tiny
    pipeline, _ = keyed
    engine = pipeline.engine
    assert [s.device for s in pipeline.coordinator.route.plan.stages] == ["a", "b"]
    sequences = [engine.submit(tokenizer(p)["input_ids"], SamplingParams(max_new_tokens=12)) for p in PROMPTS]
    assert [_collect(s) for s in sequences] == [_greedy_ids(reference, tokenizer, p, 12) for p in PROMPTS]
    assert engine.peak_active == 4 and set(engine.busy_seconds) == {"a", "b"}
    batched = [pipeline.coordinator.agents[name].get("/v1/health")["batched_steps"] for name in ("a", "b")]
    assert sum(batched) > 0, "no two sessions' steps ever shared a pass"


def test_the_coordinator_api_wants_its_api_key_and_answers_as_serve_does(tiny, keyed):
    _, reference, tokenizer = tiny
    _, server = keyed
    url = f"http://127.0.0.1:{server.port}"
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    expected = [tokenizer.decode(_greedy_ids(reference, tokenizer, p, 10), skip_special_tokens=True) for p in PROMPTS]
    with ThreadPoolExecutor(4) as pool:   # concurrent clients, each its own answer
        texts = list(pool.map(lambda p: client.completions.create(model="tiny", prompt=p, max_tokens=10,
                                                                  temperature=0).choices[0].text, PROMPTS))
    assert texts == expected
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected[0]
    scored = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2).choices[0]
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    full = torch.tensor([[*ids[0].tolist(), *_greedy_ids(reference, tokenizer, PROMPT, 3)]])
    with torch.no_grad():
        logprobs = torch.log_softmax(reference(full).logits[0].float(), -1)
    want = [logprobs[i - 1, full[0, i]].item() for i in range(ids.shape[1], full.shape[1])]
    assert scored.logprobs.token_logprobs == pytest.approx(want, abs=1e-4)
    echoed = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2,
                                       echo=True).choices[0]   # the prompt's scores too, as `serve` gives them
    assert echoed.text.startswith(PROMPT) and echoed.logprobs.token_logprobs[0] is None
    everything = [logprobs[i - 1, full[0, i]].item() for i in range(1, full.shape[1])]
    assert echoed.logprobs.token_logprobs[1:] == pytest.approx(everything, abs=1e-4)

    with pytest.raises(openai.AuthenticationError):   # with --api-key, the agents' token does not open the API
        openai.OpenAI(base_url=url + "/v1", api_key=TOKEN, max_retries=0).models.list()
    body = {"prompt": PROMPT, "max_tokens": 4}
    refused = httpx.post(url + "/v1/completions", json=body)
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert "--api-key" in refused.json()["error"]["message"]
    assert httpx.get(url + "/health").status_code == 200
    stage = httpx.get(url + "/stages/none.json", headers={"Authorization": f"Bearer {KEY}"})
    assert stage.status_code == 401 and "--token" in stage.json()["error"]["message"]
    assert httpx.get(url + "/stages/none.json", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 404
    headers = {"Authorization": f"Bearer {KEY}"}
    for extra, status, param, words in [
        ({"logit_bias": {"5": 1}}, 400, "logit_bias", "logit_bias is not supported"),
        ({"tools": []}, 400, "tools", "unrecognized request argument supplied: tools"),
        ({"temperature": 5}, 400, "temperature", "less than or equal to 2"),
        ({"model": "gpt-4"}, 404, "model", "'gpt-4' does not exist"),
        ({"max_tokens": 100}, 400, "max_tokens", "set max_tokens to at most 48"),   # --context-length 64
    ]:
        reply = httpx.post(url + "/v1/completions", json={**body, **extra}, headers=headers, timeout=60)
        error = reply.json()["error"]
        assert (reply.status_code, error["param"]) == (status, param) and words in error["message"], reply.text
    chat = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]},
                      headers=headers, timeout=60)
    assert chat.status_code == 400 and "no chat template" in chat.json()["error"]["message"]


@pytest.mark.parametrize("order", [None, ["c", "a", "b"]], ids=["no-order", "order-c,a,b"])
def test_a_killed_agent_replays_every_request_in_flight(tiny, agents, deployed, tmp_path, order):
    """Four requests in flight over three stages; SIGKILL the middle stage's agent: all four finish
    with transformers' text on the re-planned route."""
    _, reference, tokenizer = tiny
    pipeline, _ = deployed
    coordinator = pipeline.coordinator
    expected_order, victim = _deploy_in_order(coordinator, agents, order, 1)
    sequences = [pipeline.engine.submit(tokenizer(p)["input_ids"], SamplingParams(max_new_tokens=10)) for p in PROMPTS]
    first = []
    for event in sequences[0]:
        first.append(event.token)
        if len(first) == 3:
            agents[victim].kill()
    texts = [first, *(_collect(s) for s in sequences[1:])]
    assert texts == [_greedy_ids(reference, tokenizer, p, 10) for p in PROMPTS]
    assert pipeline.recoveries == 1 and pipeline.engine.peak_active == 4
    assert [s.device for s in coordinator.route.plan.stages] == [n for n in expected_order if n != agents[victim].name]
    agents[victim] = _restart(agents[victim], tmp_path)


def test_an_agent_killed_as_it_loads_its_stage_is_named_and_planned_around(tiny, agents, deployed, tmp_path,
                                                                          monkeypatch, caplog):
    """An agent the kernel kills while it loads (SIGKILL, as the OOM killer does) is
    named with the reason the coordinator believes, and the new plan leaves it out."""
    _, reference, tokenizer = tiny
    pipeline, _ = deployed
    coordinator = pipeline.coordinator
    victim = next(i for i, a in enumerate(agents) if a.name == "c")
    client, post = coordinator.agents["c"], coordinator.agents["c"].post

    def killed_on_load(path, body, **kwargs):
        if path == "/v1/stage/load":
            agents[victim].kill()
        return post(path, body, **kwargs)

    monkeypatch.setattr(client, "post", killed_on_load)
    with caplog.at_level("WARNING", logger="shardstream.pipeline.coordinator"):
        route = coordinator.deploy()
    assert "agent c died while loading its stage" in caplog.text and "killed by a signal" in caplog.text
    assert [s.device for s in route.plan.stages] == ["a", "b"] and "c" in coordinator.lost
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    assert torch.equal(pipeline.generate(ids, max_new_tokens=8)[0], _reference(reference, tokenizer, 8))
    agents[victim] = _restart(agents[victim], tmp_path)
