"""A tiny Mixtral with its experts on two tiers over a 2-stage pipeline of real agent processes: each stage
carries its experts' containers from both tiers, and the greedy output is token-identical to transformers'."""

from __future__ import annotations

import json

import pytest
import warm_python
import torch

from shardstream.convert import convert
from shardstream.pipeline.client import AgentClient
from shardstream.pipeline.coordinator import Coordinator, CoordinatorOptions
from shardstream.pipeline.generation import PipelineModel
from shardstream.pipeline.local import spawn_agents
from shardstream.pipeline.server import BackgroundServer, coordinator_app
from shardstream.shard import place_experts
from shardstream.store import open_store
from tiny_models import save_checkpoint

TOKEN = "test-token"
LAYERS = 3   # the tiny Mixtral's blocks
COLD = {(0, 1): "cold", (1, 3): "cold", (2, 0): "cold", (2, 2): "cold"}


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """(pipeline over agents a and b, their clients, transformers' model); the cold tier is outside the store."""
    tmp = tmp_path_factory.mktemp("moe")
    reference = save_checkpoint("mixtral", tmp / "ckpt")
    convert(tmp / "ckpt", tmp / "store", progress=False)
    store = open_store(tmp / "store")
    place_experts(store, {"hot": ".", "cold": str(tmp / "cold")}, placement=COLD)
    agents = spawn_agents(["a", "b"], TOKEN, tmp / "agents", start=warm_python.popen)
    clients = [AgentClient(a.url, TOKEN) for a in agents]
    coordinator = Coordinator(store, clients, CoordinatorOptions(tmp / "work", context_length=64, objective="throughput",
                                                                 pipeline_order=["a", "b"]))
    coordinator.profile()
    for profile in coordinator.profiles.values():  # equal devices: the blocks split over both
        profile.gflops = 1e-3
        profile.rtt_seconds = {name: 1e-3 for name in profile.rtt_seconds}
        profile.bandwidth_bytes_per_s = {name: 1e8 for name in profile.bandwidth_bytes_per_s}
    model = PipelineModel(coordinator, "127.0.0.1")
    server = BackgroundServer(coordinator_app(model, None, "tiny", tmp / "work" / "stages", TOKEN), "127.0.0.1", 0)
    coordinator.stage_url = f"http://127.0.0.1:{server.port}/stages/"
    coordinator.deploy()
    yield model, clients, reference
    server.stop()
    model.close()
    coordinator.close()
    for agent in agents:
        agent.stop()


def _expert_loads(clients: list[AgentClient]) -> list[int]:
    return [client.get("/v1/health")["expert_loads"] for client in clients]


def test_stages_carry_their_experts_from_both_tiers(pipeline):
    model, _, _ = pipeline
    stages = model.coordinator.route.plan.stages
    assert [s.device for s in stages] == ["a", "b"]
    folders = sorted((model.coordinator.options.work_dir / "stages").iterdir())
    files = {name for folder in folders for name in json.loads((folder / "stage.json").read_text())["files"]}
    experts = {name for name in files if name.startswith("experts/")}
    assert len(experts) == LAYERS * 2 and "experts/tier_cold/group_2.1.experts" in experts   # a container a tier a block
    assert "sharding.json" in files


def test_greedy_output_is_token_identical_with_the_experts_read_at_load(pipeline):
    """Each stage's experts fit its memory, so its engine read them all at load (stream/experts.py, `preload`):
    generating reads none, and the tokens are transformers'."""
    model, clients, reference = pipeline
    one = torch.tensor([[5]])
    assert torch.equal(model.generate(one, max_new_tokens=1), reference.generate(one, max_new_tokens=1, do_sample=False))
    ids = torch.randint(3, 128, (1, 7), generator=torch.Generator().manual_seed(1))
    out = model.generate(ids, max_new_tokens=12)
    assert torch.equal(out, reference.generate(ids, max_new_tokens=12, do_sample=False))
    assert _expert_loads(clients) == [0, 0]
