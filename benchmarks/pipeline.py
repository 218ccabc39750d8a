"""Pipeline generation speed on loopback: 1, 2 and 3 stages (agents as local processes) against
transformers in one process, per-hop overhead, and the plan's predicted stage times against measured.

The stage count is forced by memory: --mem-fraction is set so that a device holds just the blocks
of an even k-way split, and the latency objective then uses exactly k stages. Every agent shares
this machine's cores, so a stage's compute competes with the others' idle polling and the
coordinator; on loopback a hop costs serialization, two ZeroMQ copies and a context switch.
Requests in flight: for each stage count, 1, 2, 4 and 8 requests submitted together to the
coordinator's engine; aggregate tokens/s and each stage's busy fraction (its compute seconds, from
the stages' timings, over the wall time). Then the re-plan time after a SIGKILL.
Run: `.venv/bin/python benchmarks/pipeline.py [--layers 8] [--hidden 256] [--tokens 32]`.
`--streamed` instead runs two agents under a memory cap (memcap) smaller than the model: the plan
streams blocks from disk, and tok/s is set against the agents' disk read floor.
`--shape llama-3.2-1b` runs a real shape's store (scripts/real_shapes.py, all its blocks; `--compression
4bit` its 4-bit store too) as two agents under `--cap` each against one process streaming the same store
under `--single-cap`, both loaded at once and called in turn (`--turns` generate() calls of `--tokens` each a
round, one of the pipeline, then one of the process), so that the disk's speed of the moment (which drifts
by 1.5x within minutes on a shared machine) weighs on both alike: greedy tokens checked equal (and, for the
unquantized store, to transformers' own model on the same weights, computing in the dtype the engine chose),
the median of each one's decode steps (those after the first new token) and their ratio, per round.
The agents share this host and a request's stages run one after the other, so each agent gets all its cores.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import math
import os
import select
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from shardstream.convert import convert
from shardstream.pipeline.client import AgentClient
from shardstream.pipeline.coordinator import Coordinator, CoordinatorOptions
from shardstream.pipeline.costs import activation_bytes
from shardstream.pipeline.generation import PipelineModel
from shardstream.pipeline.local import spawn_agents
from shardstream.pipeline.measure import cold_read_seconds
from shardstream.pipeline.server import BackgroundServer, coordinator_app
from shardstream.store import open_store
from shardstream.serving.protocol import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

TOKEN = "bench"
CONTEXT = 256
MEMCAP = Path(__file__).resolve().parents[2] / "shared" / "tools" / "memcap"
IN_FLIGHT = (1, 2, 4, 8)   # requests submitted together (at most the stages' 8 KV sessions)


@contextmanager
def running_pipeline(folder: Path, store: Path, names: list[str], options: CoordinatorOptions,
                     wrapper: list[str] = (), threads: int | None = None) -> Iterator[tuple[list, Coordinator, PipelineModel]]:
    """Agents (under `wrapper`, with `threads` each), a coordinator and its stage server, all stopped on the way out."""
    agents = spawn_agents(names, TOKEN, folder / "agents", wrapper=wrapper, threads=threads)
    coordinator = Coordinator(open_store(store), [AgentClient(a.url, TOKEN) for a in agents], options)
    pipeline = PipelineModel(coordinator, "127.0.0.1")
    server = BackgroundServer(coordinator_app(pipeline, None, "bench", folder / "work" / "stages", TOKEN), "127.0.0.1", 0)
    coordinator.stage_url = f"http://127.0.0.1:{server.port}/stages/"
    try:
        yield agents, coordinator, pipeline
    finally:
        server.stop()
        pipeline.close()
        coordinator.close()
        for agent in agents:
            agent.stop()


def build_store(folder: Path, layers: int, hidden: int, intermediate: int | None = None,
                kv_heads: int = 4) -> tuple[Path, AutoModelForCausalLM]:
    config = AutoConfig.for_model("llama", hidden_size=hidden, intermediate_size=intermediate or hidden * 8 // 3,
                                  num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=kv_heads, vocab_size=2048,
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
    parser.add_argument("--streamed", action="store_true", help="only the model larger than the agents' memory")
    parser.add_argument("--cap", default="400M", help="with --streamed or --shape: each agent's memcap limit")
    parser.add_argument("--shape", help="a real shape (scripts/real_shapes.py): two agents against one process")
    parser.add_argument("--compression", default="none", help="with --shape: stores to run, e.g. none,4bit")
    parser.add_argument("--single-cap", default="1400M", help="with --shape: the one process's memcap limit")
    parser.add_argument("--mem-fraction", type=float, default=0.5, help="with --shape: the coordinator's --mem-fraction")
    parser.add_argument("--rounds", type=int, default=2, help="with --shape: rounds, each a new pipeline beside a new one process")
    parser.add_argument("--turns", type=int, default=3, help="with --shape: generate() calls of each per round, in turn")
    parser.add_argument("--workdir", default="artifacts/bench-pipeline", help="with --shape: checkpoint and stores, kept")
    args = parser.parse_args()
    if args.streamed:
        return streamed_main(args.tokens, args.cap)
    if args.shape:
        return shape_main(args)
    prompt = torch.arange(3, 19).unsqueeze(0)
    with tempfile.TemporaryDirectory() as temp:
        folder = Path(temp)
        store_path, reference = build_store(folder, args.layers, args.hidden)
        reference.generate(prompt, max_new_tokens=4, do_sample=False)
        clock = StepClock(None)
        expected = reference.generate(prompt, max_new_tokens=args.tokens, do_sample=False, streamer=clock)
        single = statistics.median(clock.times)
        rows = [("single process", "-", 1 / single, single * 1e3, "-", "-", "-")]
        flights = []
        with running_pipeline(folder, store_path, ["a", "b", "c"], CoordinatorOptions(folder / "work", context_length=CONTEXT)
                              ) as (agents, coordinator, pipeline):
            coordinator.profile()
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
                flights += [(len(stages), *row) for row in in_flight(pipeline, agents, prompt, args.tokens, expected)]
            replan = replan_seconds(pipeline, agents, prompt, args.tokens, expected)
    block_mb = coordinator.cost.layers[0].weight_bytes / 1e6
    print(f"\nllama {args.layers} blocks x {block_mb:.1f} MB fp32, hidden {args.hidden}; {args.tokens} new tokens after a "
          f"16-token prompt; median per token; outputs token-identical to transformers.\n")
    print("| setup | stages | tokens/s | ms/token | per-hop overhead ms | predicted ms/stage | measured ms/stage |")
    print("|---|---|---|---|---|---|---|")
    for name, layout, rate, ms, hop, predicted, measured in rows:
        print(f"| {name} | {layout} | {rate:.1f} | {ms:.2f} | {hop} | {predicted} | {measured} |")
    print(f"\nrequests in flight: n requests of {args.tokens} new tokens submitted together (best of 3 interleaved "
          "rounds); busy = a stage's compute seconds over the wall time.\n")
    print("| stages | requests in flight | aggregate tokens/s | x one at a time | busy fraction per stage | "
          "CPU ms/token per stage / coordinator |")
    print("|---|---|---|---|---|---|")
    alone = {stages: rate for stages, count, rate, _, _ in flights if count == 1}
    for stages, count, rate, busy, cpu in flights:
        print(f"| {stages} | {count} | {rate:.1f} | {rate / alone[stages]:.2f} | {' / '.join(f'{b:.2f}' for b in busy)} "
              f"| {' / '.join(f'{c:.1f}' for c in cpu)} |")
    print(f"\nre-plan after SIGKILL of the last stage's agent (3 stages -> 2; detection + plan + redeploy + replay, "
          f"kill to next token): {replan:.2f} s; output still token-identical.")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (/proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def in_flight(pipeline: PipelineModel, agents, prompt: torch.Tensor, tokens: int, expected: torch.Tensor,
              rounds: int = 3) -> list[tuple]:
    """(requests, aggregate tokens/s, busy fraction of each stage, CPU ms per token of each stage's
    agent and of the coordinator) for each count in IN_FLIGHT: the best of `rounds` rounds, the
    counts interleaved, so that each sees the same load on a shared machine."""
    engine, ids, best = pipeline.engine, prompt[0].tolist(), {}
    devices = [s.device for s in pipeline.coordinator.route.plan.stages]
    pids = [next(a.process.pid for a in agents if a.name == d) for d in devices] + [os.getpid()]
    for _ in range(rounds):
        for count in IN_FLIGHT:
            busy, cpu = dict(engine.busy_seconds), [cpu_seconds(pid) for pid in pids]
            started = time.perf_counter()
            sequences = [engine.submit(ids, SamplingParams(max_new_tokens=tokens)) for _ in range(count)]
            outputs = [[event.token for event in sequence] for sequence in sequences]
            wall = time.perf_counter() - started
            assert all(torch.equal(torch.tensor([ids + out]), expected) for out in outputs), "output differs"
            row = (count, count * tokens / wall, [(engine.busy_seconds.get(d, 0.0) - busy.get(d, 0.0)) / wall
                                                  for d in devices],
                   [(cpu_seconds(pid) - before) * 1e3 / (count * tokens) for pid, before in zip(pids, cpu)])
            if count not in best or row[1] > best[count][1]:
                best[count] = row
    return [best[count] for count in IN_FLIGHT]


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


def streamed_main(tokens: int, cap: str) -> None:
    """Two agents under `memcap CAP` and a 24-block llama (13 MiB blocks, 312 MiB) larger than their
    memory together: the plan streams, and a token cannot come faster than the streamed bytes read
    at each agent's measured disk speed (the stages run one after the other)."""
    prompt = torch.arange(3, 19).unsqueeze(0)
    with tempfile.TemporaryDirectory(dir="/tmp") as temp:
        folder = Path(temp)
        _, reference = build_store(folder, layers=24, hidden=512, intermediate=1536, kv_heads=8)
        clock = StepClock(None)
        expected = reference.generate(prompt, max_new_tokens=tokens, do_sample=False, streamer=clock)
        single = statistics.median(clock.times)
        del reference
        options = CoordinatorOptions(folder / "work", mem_fraction=0.7, context_length=64, pipeline_order=["s0", "s1"])
        with running_pipeline(folder, folder / "store", ["s0", "s1"], options, wrapper=[str(MEMCAP), cap, "--"]
                              ) as (agents, coordinator, pipeline):
            profiles = coordinator.profile()
            route = coordinator.deploy()
            pipeline.generate(prompt, max_new_tokens=2)
            clock = StepClock(pipeline)
            out = pipeline.generate(prompt, max_new_tokens=tokens, streamer=clock)
            assert torch.equal(out, expected), "the pipeline's greedy output differs from transformers"
            alive = all(a.process.poll() is None for a in agents)
            reread = [streamed_read_seconds(agent, folder / "agents" / agent.name) for agent in route.agents]
        caps = [line for a in agents for line in a.log.read_text().splitlines() if line.startswith("memcap:")]
    step = statistics.median(clock.times)
    stages = route.plan.stages
    if not any(s.streamed_bytes_per_token for s in stages):
        raise SystemExit(f"the agents under memcap {cap} hold the model in memory, so nothing streams; lower --cap.")
    floor = sum(s.streamed_bytes_per_token / profiles[s.device].disk_bytes_per_s for s in stages)
    cost = coordinator.cost
    model_mb = (sum(x.weight_bytes for x in cost.layers) + cost.start_bytes + cost.end_bytes) / 2**20
    offered = sum(p.available_bytes for p in profiles.values()) / 2**20
    print(f"\nllama 24 blocks x {cost.layers[0].weight_bytes / 2**20:.1f} MiB fp32 = {model_mb:.0f} MiB; two agents under "
          f"memcap {cap} offering {offered:.0f} MiB together; {tokens} new tokens after a 16-token prompt; median per "
          f"token; output token-identical to transformers; agents alive after: {alive}.\n")
    print(route.plan.table())
    print("\n| agent | disk read MiB/s (profiled) | streamed MiB/token | read floor ms/token |")
    print("|---|---|---|---|")
    for s in stages:
        speed = profiles[s.device].disk_bytes_per_s
        print(f"| {s.device} | {speed / 2**20:.0f} | {s.streamed_bytes_per_token / 2**20:.1f} | "
              f"{s.streamed_bytes_per_token / speed * 1e3:.0f} |")
    print(f"\nmeasured: {1 / step:.2f} tok/s ({step * 1e3:.0f} ms/token); disk read floor at the profiled speeds "
          f"{1 / floor:.2f} tok/s ({floor * 1e3:.0f} ms/token): decode speed {floor / step:.2f}x the floor's; reading "
          f"the streamed blocks' files once more with O_DIRECT after the run: {sum(reread) * 1e3:.0f} ms per token's "
          f"blocks (decode speed {sum(reread) / step:.2f}x that floor's); "
          f"plan predicted {route.plan.objective_value * 1e3:.0f} ms/token; transformers in one uncapped process: "
          f"{single * 1e3:.1f} ms/token.")
    print("\n".join(caps))


SINGLE = """
import json, sys, time, torch
from shardstream import AutoModel
prompt = torch.tensor([[%s]])
class Clock:
    def __init__(self):
        self.times, self.last, self.new = [], time.perf_counter(), 0
    def put(self, value):   # decode steps only: the first new token's time is the prompt's pass
        now = time.perf_counter()
        if value.dim() == 1:
            self.new += 1
            if self.new > 1:
                self.times.append(now - self.last)
        self.last = now
    def end(self):
        pass
words = open(int(sys.argv[3]))   # a pipe from the parent: memcap runs this in the background, stdin at /dev/null
with AutoModel.from_pretrained(sys.argv[1]) as model:
    model.generate(prompt, max_new_tokens=2, do_sample=False)
    print(json.dumps({"ready": True}), flush=True)
    for word in words:   # one generate() call each
        clock = Clock()
        out = model.generate(prompt, max_new_tokens=int(sys.argv[2]), do_sample=False, streamer=clock)
        print(json.dumps({"times": clock.times, "tokens": out[0, prompt.shape[1]:].tolist(),
                          "resident": len(model.resident_blocks), "dtype": str(model.model.dtype)}), flush=True)
"""


def shape_prompt() -> torch.Tensor:
    return torch.arange(3, 19).unsqueeze(0)


class OneProcess:
    """One process streaming `store` under memcap `cap` (cold), loaded and warmed up, that makes one greedy
    generate() call of `tokens` new tokens each time `call()` is called, the pipeline's calls in between. A
    load or a call that takes longer than `timeout` seconds stops it (SIGTERM, which memcap passes on)."""

    def __init__(self, store: Path, cap: str, tokens: int, log: Path, timeout: float = 1800):
        code = SINGLE % ", ".join(map(str, shape_prompt()[0].tolist()))
        self.log, self.timeout = log, timeout
        words, word = os.pipe()
        self.process = subprocess.Popen([str(MEMCAP), cap, "--cold", str(store), "--", sys.executable, "-c", code, str(store),
                                         str(tokens), str(words)], stdout=subprocess.PIPE, stderr=log.open("w"), text=True,
                                        pass_fds=(words,))
        os.close(words)
        self.words = os.fdopen(word, "w")
        self.times: list[float] = []
        self.result: dict | None = None
        self.timed_out = False
        self.alive = bool(self._line())   # loaded and warmed up, or gone

    def _line(self) -> str:
        """Its next line of output; "" once it has exited, or after `timeout` seconds (it is then stopped)."""
        if not select.select([self.process.stdout], [], [], self.timeout)[0]:
            self.timed_out = True
            self.process.terminate()
            return ""
        return self.process.stdout.readline()

    def call(self) -> None:
        if not self.alive:
            return
        try:
            self.words.write("go\n")
            self.words.flush()
            line = self._line()
        except BrokenPipeError:
            line = ""
        if not line:   # it died or hung: finish() says how
            self.alive = False
            return
        self.result = json.loads(line)
        self.times += self.result["times"]

    def finish(self) -> dict | str:
        """Its greedy tokens, median decode step and cgroup peak, or why there are none."""
        with contextlib.suppress(BrokenPipeError):
            self.words.close()
        code = self.process.wait(timeout=600)
        stderr = self.log.read_text()
        peak = re.search(r"memcap: limit \S+, peak ([^,\s]+)", stderr)
        if self.timed_out:
            return f"timeout ({self.timeout:.0f} s)"
        if code != 0 or not self.times:
            return "killed (out of memory)" if code in (-9, 137) else f"failed: {stderr.strip()[-200:]}"
        return {**self.result, "step": statistics.median(self.times), "peak": peak.group(1) if peak else "?"}


def pipeline_run(store: Path, cap: str, tokens: int, mem_fraction: float, turns: int = 1,
                 beside: Callable[[], None] | None = None) -> dict | str:
    """Two agents under memcap `cap`, planned and deployed by a coordinator: greedy tokens and median decode step
    (the steps after the first new token) of `turns` generate() calls, `beside` run after each."""
    prompt = shape_prompt()
    with tempfile.TemporaryDirectory(dir="/tmp") as temp:
        folder = Path(temp)
        options = CoordinatorOptions(folder / "work", mem_fraction=mem_fraction, context_length=64, pipeline_order=["s0", "s1"])
        with running_pipeline(folder, store, ["s0", "s1"], options, wrapper=[str(MEMCAP), cap, "--"],
                              threads=os.cpu_count()) as (agents, coordinator, pipeline):
            coordinator.profile()
            route = coordinator.deploy()
            pipeline.generate(prompt, max_new_tokens=2)
            times = []
            for _ in range(turns):
                clock = StepClock(pipeline)
                out = pipeline.generate(prompt, max_new_tokens=tokens, streamer=clock)
                times += clock.times[1:]
                if beside is not None:
                    beside()
            alive = all(a.process.poll() is None for a in agents)
        peaks = [re.search(r"peak ([^,\s]+)", line).group(1) for a in agents for line in a.log.read_text().splitlines()
                 if line.startswith("memcap:")]
    layout = " + ".join(f"{s.device}:{s.first_layer}-{s.last_layer_exclusive - 1}"
                        f"{' (streams %.0f MiB)' % (s.streamed_bytes_per_token / 2**20) if s.streamed_bytes_per_token else ''}"
                        for s in route.plan.stages)
    return {"tokens": out[0, prompt.shape[1]:].tolist(), "step": statistics.median(times), "alive": alive,
            "layout": layout, "peak": " / ".join(peaks)}


def shape_main(args) -> None:
    """Two agents under --cap against one process under --single-cap, on a real shape's stores, same rounds."""
    from real_shapes import write_checkpoint

    work = Path(args.workdir) / args.shape
    ckpt = write_checkpoint(args.shape, work / "ckpt")
    stores = {}
    for compression in args.compression.split(","):
        stores[compression] = work / ("store" if compression == "none" else f"store-{compression}")
        if not (stores[compression] / "manifest.json").exists():
            convert(ckpt, stores[compression], compression=None if compression == "none" else compression, progress=False)
    expected: dict[str, list[int]] = {}   # transformers' greedy tokens, in each compute dtype the engine took

    def transformers_tokens(dtype: str) -> list[int]:
        if dtype not in expected:
            reference = AutoModelForCausalLM.from_pretrained(ckpt, dtype=getattr(torch, dtype.removeprefix("torch."))).eval()
            expected[dtype] = reference.generate(shape_prompt(), max_new_tokens=args.tokens, do_sample=False)[0, 16:].tolist()
        return expected[dtype]

    rows = []
    for compression, store in stores.items():
        for round_ in range(1, args.rounds + 1):
            with tempfile.TemporaryDirectory(dir="/tmp") as temp:
                one = OneProcess(store, args.single_cap, args.tokens, Path(temp) / "one-process.log")
                try:
                    staged = pipeline_run(store, args.cap, args.tokens, args.mem_fraction, args.turns, one.call)
                except Exception as error:   # an agent killed, a plan refused: the row says so
                    staged = f"failed: {str(error)[:160]}"
                single = one.finish()
            both = isinstance(single, dict) and isinstance(staged, dict)
            exact = (staged["tokens"] == transformers_tokens(single["dtype"]) if compression == "none" else "n/a (4-bit weights)") \
                if both else ""
            rows.append([compression, str(round_),
                         *([f"{1 / staged['step']:.2f}", staged["peak"], staged["layout"]] if isinstance(staged, dict)
                           else [staged, "", ""]),
                         *([f"{1 / single['step']:.2f}", single["peak"]] if isinstance(single, dict) else [single, ""]),
                         f"{single['step'] / staged['step']:.2f}x" if both else "",
                         str(single["tokens"] == staged["tokens"]) if both else "", str(exact)])
            print(" | ".join(rows[-1]), file=sys.stderr)
    print(f"\n{args.shape} shape, {args.tokens} greedy tokens after a 16-token prompt, median decode step; two agents "
          f"under memcap {args.cap} each (--mem-fraction {args.mem_fraction}, {os.cpu_count()} threads each, stages one "
          f"after the other) against one process under memcap {args.single_cap} (cold), both loaded at once, "
          f"{args.turns} generate() calls of each in turn a round; median of the decode steps after the first new token.\n")
    print("| store | round | pipeline tok/s | agents' peaks | plan | one process tok/s | its peak | pipeline / one "
          "process | same tokens | tokens = transformers' |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


def streamed_read_seconds(agent: AgentClient, cache: Path) -> float:
    """Seconds to read, from the disk, the files of the blocks this agent streams (median of 3 passes)."""
    health = agent.get("/v1/health")
    store = open_store(cache / health["stage_id"])
    files = [store.file_path(name) for block in health["streamed_blocks"] for name in store.manifest.parts[f"mid/{block}"].files]
    return statistics.median(sum(cold_read_seconds(path) for path in files) for _ in range(3))


if __name__ == "__main__":
    main()
