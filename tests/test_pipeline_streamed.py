"""Stages larger than memory: two agents under a real cgroup cap (memcap) whose combined memory,
after what python, torch and the agent take (~270 MiB each), is below the model's size. No split
fits in memory, so the plan streams blocks from the agents' disks; greedy generation equals
transformers', and neither agent is killed. `coordinator --no-streaming` refuses the same model.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from shardstream.convert import convert
from shardstream.pipeline.client import AgentClient
from shardstream.pipeline.coordinator import Coordinator, CoordinatorOptions
from shardstream.pipeline.generation import PipelineModel
from shardstream.pipeline.local import spawn_agents
from shardstream.pipeline.server import BackgroundServer, coordinator_app
from shardstream.store import open_store

TOKEN = "test-token"
MEMCAP = Path("/work/shared/tools/memcap")
CAP = "400M"   # ~130 MiB each once the agent runs: 2 x 130 MiB < the model's 312 MiB
PROMPT = torch.tensor([[1, 5, 9, 20, 33, 7]])


def _memcap_usable() -> bool:
    cgroups = Path("/sys/fs/cgroup/memory").is_dir() or Path("/sys/fs/cgroup/cgroup.controllers").is_file()
    return MEMCAP.is_file() and cgroups and os.geteuid() == 0


@pytest.fixture(scope="module")
def big(module_tmp_path):
    """(store, reference): a 24-block llama of 13 MiB blocks, 312 MiB in float32."""
    folder = module_tmp_path
    config = AutoConfig.for_model("llama", hidden_size=512, intermediate_size=1536, num_hidden_layers=24,
                                  num_attention_heads=8, num_key_value_heads=8, vocab_size=128,
                                  max_position_embeddings=64, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    reference.save_pretrained(folder / "ckpt", max_shard_size="400MB")
    convert(folder / "ckpt", folder / "store", progress=False)
    return open_store(folder / "store"), reference


@pytest.mark.skipif(not _memcap_usable(), reason="needs root, /work/shared/tools/memcap and a cgroup memory controller")
def test_agents_smaller_than_the_model_stream_their_stages_exactly(big, tmp_path):
    store, reference = big
    # objective "throughput" (the slowest stage): on latency, a hot page cache (disk probe 4-5 GB/s) and a
    # slow hop can make one agent streaming all 24 blocks the best plan (seen here while the agents' round
    # trips measured 44 ms, before listener.py), and this test is about two agents streaming their own stages
    agents = spawn_agents(["s0", "s1"], TOKEN, tmp_path / "agents", wrapper=[str(MEMCAP), CAP, "--"])
    coordinator = Coordinator(store, [AgentClient(a.url, TOKEN) for a in agents],
                              CoordinatorOptions(tmp_path / "work", mem_fraction=0.7, context_length=32,
                                                 pipeline_order=["s0", "s1"], bandwidth_probe_bytes=0,
                                                 objective="throughput"))
    pipeline = server = None
    try:
        profiles = coordinator.profile()
        cost = coordinator.cost
        model_bytes = sum(layer.weight_bytes for layer in cost.layers) + cost.start_bytes + cost.end_bytes
        assert sum(p.available_bytes for p in profiles.values()) < model_bytes
        assert all(p.disk_bytes_per_s > 0 for p in profiles.values())
        # the agents' round trips are not held by Nagle's algorithm (44 ms each before listener.py)
        assert all(0 < t < 0.035 for p in profiles.values() for t in p.rtt_seconds.values()), profiles

        refused = subprocess.run(
            [sys.executable, "-m", "shardstream.pipeline.cli", "coordinator", "--model", str(store.root), "--token", TOKEN,
             "--urls", ",".join(a.url for a in agents), "--mem-fraction", "0.7", "--context-length", "32",
             "--probe-bytes", "0", "--work-dir", str(tmp_path / "dry"), "--no-streaming"],
            capture_output=True, text=True, timeout=300)
        assert refused.returncode == 1 and "Traceback" not in refused.stderr
        assert re.fullmatch(r"error: No split of the 24 blocks fits in memory: .*, or drop --no-streaming so that "
                            r"agents may stream blocks from their disk\.\n", refused.stderr)

        pipeline = PipelineModel(coordinator, "127.0.0.1")
        server = BackgroundServer(coordinator_app(pipeline, None, "big", tmp_path / "work" / "stages", TOKEN),
                                  "127.0.0.1", 0)
        coordinator.stage_url = f"http://127.0.0.1:{server.port}/stages/"
        route = coordinator.deploy()
        stages = route.plan.stages
        assert [s.device for s in stages] == ["s0", "s1"]
        assert any(s.streamed_bytes_per_token for s in stages)
        assert "streamed from disk/token" in route.plan.table()

        out = pipeline.generate(PROMPT, max_new_tokens=6)
        expected = reference.generate(PROMPT, max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(out[0], expected[0])

        for agent, stage in zip(route.agents, stages):   # the agents stream what the plan says streams
            streamed = agent.get("/v1/health")["streamed_blocks"]
            assert bool(streamed) == bool(stage.streamed_bytes_per_token)
            assert set(streamed) <= set(range(stage.first_layer, stage.last_layer_exclusive))
        assert all(a.process.poll() is None for a in agents), "an agent was killed"
    finally:
        if server is not None:
            server.stop()
        if pipeline is not None:
            pipeline.close()
        coordinator.close()
        for agent in agents:
            agent.stop()
