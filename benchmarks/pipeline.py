"""Pipeline generation speed on loopback: 1, 2 and 3 stages (agents as local processes) against
transformers in one process, per-hop overhead, and the plan's predicted stage times against measured.

The stage count is forced by memory: --mem-fraction is set so that a device holds just the blocks
of an even k-way split, and the latency objective then uses exactly k stages. Every agent shares
this machine's cores, so a stage's compute competes with the others' idle polling and the
coordinator; on loopback a hop costs serialization, two ZeroMQ copies and a context switch.
Run: `.venv/bin/python benchmarks/pipeline.py [--layers 8] [--hidden 256] [--tokens 32]`.
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from shardstream.convert import convert
from shardstream.pipeline.client import AgentClient
from shardstream.pipeline.coordinator import Coordinator, CoordinatorOptions
from shardstream.pipeline.costs import activation_bytes
from shardstream.pipeline.generation import PipelineModel
from shardstream.pipeline.local import spawn_agents
from shardstream.pipeline.server import BackgroundServer, coordinator_app
from shardstream.store import open_store

TOKEN = "bench"
CONTEXT = 256


def build_store(folder: Path, layers: int, hidden: int) -> tuple[Path, AutoModelForCausalLM]:
    config = AutoConfig.for_model("llama", hidden_size=hidden, intermediate_size=hidden * 8 // 3, num_hidden_layers=layers,
                                  num_attention_heads=8, num_key_value_heads=4, vocab_size=2048,
                                  max_position_embeddings=CONTEXT, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(folder / "ckpt")
    convert(folder / "ckpt", folder / "store", progress=False)
    return folder / "store", model


class StepClock:
    """A generate() streamer that records each new token's wall time and the stages' compute times."""

    def __init__(self, pipeline: PipelineModel | None):
        self.pipeline, self.times, self.stage_times, self._last = pipeline, [], [], time.perf_counter()

    def put(self, value) -> None:
        now = time.perf_counter()
        if value.dim() == 1:  # a new token, not the prompt
            self.times.append(now - self._last)
            if self.pipeline is not None:
                self.stage_times.append([t[1] for t in self.pipeline.last_timings])
        self._last = now

    def end(self) -> None:
        pass


def fraction_for(coordinator: Coordinator, stages: int) -> float:
    """The --mem-fraction at which a device holds just one stage of an even `stages`-way split."""
    cost, n = coordinator.cost, len(coordinator.cost.layers)
    per_block = cost.layers[0].weight_bytes + cost.layers[0].kv_bytes_per_token * CONTEXT
    ends = cost.start_bytes + cost.end_bytes if stages == 1 else max(cost.start_bytes, cost.end_bytes)
    need = math.ceil(n / stages) * per_block + ends + activation_bytes(coordinator.store, CONTEXT)
    return (need + per_block // 2) / min(p.available_bytes for p in coordinator.profiles.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    prompt = torch.arange(3, 19).unsqueeze(0)
    with tempfile.TemporaryDirectory() as temp:
        folder = Path(temp)
        store_path, reference = build_store(folder, args.layers, args.hidden)
        reference.generate(prompt, max_new_tokens=4, do_sample=False)
        clock = StepClock(None)
        expected = reference.generate(prompt, max_new_tokens=args.tokens, do_sample=False, streamer=clock)
        single = statistics.median(clock.times)
        rows = [("single process", "-", 1 / single, single * 1e3, "-", "-", "-")]
        agents = spawn_agents(["a", "b", "c"], TOKEN, folder / "agents")
        coordinator = Coordinator(open_store(store_path), [AgentClient(a.url, TOKEN) for a in agents],
                                  CoordinatorOptions(folder / "work", context_length=CONTEXT))
        coordinator.profile()
        pipeline = PipelineModel(coordinator, "127.0.0.1")
        server = BackgroundServer(coordinator_app(pipeline, None, "bench", folder / "work" / "stages", TOKEN), "127.0.0.1", 0)
        coordinator.stage_url = f"http://127.0.0.1:{server.port}/stages/"
        try:
            for k in (1, 2, 3):
                coordinator.options.mem_fraction = fraction_for(coordinator, k)
                route = coordinator.deploy()
                pipeline.generate(prompt, max_new_tokens=4)
                clock = StepClock(pipeline)
                out = pipeline.generate(prompt, max_new_tokens=args.tokens, streamer=clock)
                assert torch.equal(out, expected), "the pipeline's greedy output differs from transformers"
                step = statistics.median(clock.times)
                compute = [statistics.median(s[i] for s in clock.stage_times) for i in range(len(route.plan.stages))]
                hop = (step - sum(compute)) / (len(compute) + 1)
                stages = route.plan.stages
                predicted = " / ".join(f"{s.predicted_seconds_per_token * 1e3:.2f}" for s in stages)
                measured = " / ".join(f"{(c + hop) * 1e3:.2f}" for c in compute)
                layout = " + ".join(f"{s.device}:{s.first_layer}-{s.last_layer_exclusive - 1}" for s in stages)
                rows.append((f"{len(stages)} stage(s)", layout, 1 / step, step * 1e3, f"{hop * 1e3:.2f}", predicted, measured))
            replan = replan_seconds(pipeline, agents, prompt, args.tokens, expected)
        finally:
            server.stop()
            pipeline.close()
            coordinator.close()
            for agent in agents:
                agent.stop()
    block_mb = coordinator.cost.layers[0].weight_bytes / 1e6
    print(f"\nllama {args.layers} blocks x {block_mb:.1f} MB fp32, hidden {args.hidden}; {args.tokens} new tokens after a "
          f"16-token prompt; median per token; outputs token-identical to transformers.\n")
    print("| setup | stages | tokens/s | ms/token | per-hop overhead ms | predicted ms/stage | measured ms/stage |")
    print("|---|---|---|---|---|---|---|")
    for name, layout, rate, ms, hop, predicted, measured in rows:
        print(f"| {name} | {layout} | {rate:.1f} | {ms:.2f} | {hop} | {predicted} | {measured} |")
    print(f"\nre-plan after SIGKILL of the last stage's agent (3 stages -> 2; detection + plan + redeploy + replay, "
          f"kill to next token): {replan:.2f} s; output still token-identical.")


def replan_seconds(pipeline: PipelineModel, agents, prompt: torch.Tensor, tokens: int, expected: torch.Tensor) -> float:
    """SIGKILL the agent of the last stage after 4 new tokens; seconds from the kill to the next token.
    The memory fraction is raised first so that the two agents left can hold the model."""
    coordinator = pipeline.coordinator
    victim = next(agent for agent in agents if agent.name == coordinator.route.plan.stages[-1].device)
    coordinator.options.mem_fraction = fraction_for(coordinator, 2)

    class KillAfterFour(StepClock):
        def put(self, value) -> None:
            super().put(value)
            if len(self.times) == 4 and victim.process.poll() is None:
                victim.kill()
                self._last = time.perf_counter()   # the next token's time counts from the kill

    clock = KillAfterFour(None)
    out = pipeline.generate(prompt, max_new_tokens=tokens, streamer=clock)
    assert torch.equal(out, expected) and pipeline.recoveries == 1, "recovery changed the output"
    return clock.times[4]


if __name__ == "__main__":
    main()
