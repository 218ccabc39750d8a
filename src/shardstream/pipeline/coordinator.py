"""The coordinator: profile the agents, plan, package and deploy stages, and re-plan when one is lost.

Each deployment is a plan epoch; messages of an older epoch are refused by the agents, so a stage
of a replaced plan can never mix its KV cache into a new one. Every deployment first claims its
agents (agent.py): an agent serving another coordinator that still answers is left out of the plan
(or, at start, refused with its sentence) unless this one was told to take it over.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from transformers import AutoConfig

from ..errors import AgentBusy, InvalidOption, PipelineUnavailable, PlanInfeasible, ShardstreamError, SourceUnreachable
from ..store import Store
from .client import AgentClient
from .costs import activation_bytes, device_from_profile, model_cost
from .measure import PROBE_LIMIT
from .package import package_plan
from .planner import LAN, Link, Plan, PlanOptions, format_bytes, plan

log = logging.getLogger(__name__)
PROFILE_BLOCK_LIMIT = 64 * 2**20  # bytes of block-shaped weights a profile may allocate on an agent


@dataclass
class CoordinatorOptions:
    work_dir: Path
    mem_fraction: float = 0.5
    context_length: int = 2048
    min_prefix: int = 0
    objective: str = "latency"
    pipeline_order: list[str] | None = None
    bandwidth_probe_bytes: int = 4 * 2**20   # per agent pair; 0 assumes a 1 Gbit/s LAN instead
    readmit_after_s: float = 30.0   # a lost agent is tried again after this long (see Coordinator.readmit)
    streaming: bool = True   # when no split fits in memory, agents may stream their blocks from disk


@dataclass
class Profile:
    """What planning needs to know about one agent."""

    available_bytes: int
    gflops: float
    data_port: int
    disk_bytes_per_s: float = 0.0   # read speed of its stage cache's disk (0: not measured, it may not stream)
    rtt_seconds: dict[str, float] = field(default_factory=dict)  # to each other agent, by name
    bandwidth_bytes_per_s: dict[str, float] = field(default_factory=dict)  # from each other agent, by name


@dataclass
class Route:
    """A deployed plan: the epoch, and for each stage its agent, data endpoint and stage id, in order."""

    epoch: int
    plan: Plan
    agents: list[AgentClient]
    endpoints: list[str]
    stage_ids: list[str]


class Coordinator:
    def __init__(self, store: Store, agents: list[AgentClient], options: CoordinatorOptions):
        if not 0 < options.mem_fraction <= 1:
            raise InvalidOption(f"--mem-fraction must be in (0, 1], not {options.mem_fraction}.")
        if not agents:
            raise InvalidOption("no agents: give --urls or --discover.")
        if not 0 <= options.bandwidth_probe_bytes <= PROBE_LIMIT:
            raise InvalidOption(f"--probe-bytes must be between 0 and {PROBE_LIMIT}, not {options.bandwidth_probe_bytes}.")
        self.store, self.options = store, options
        self.agents = {}
        for agent in agents:
            agent.name = agent.get("/v1/capabilities", timeout=10)["name"]
            if agent.name in self.agents:
                raise InvalidOption(f"two agents are named {agent.name!r} ({self.agents[agent.name].url}, {agent.url}); "
                                    "start them with different --name, or list an agent once in --urls.")
            self.agents[agent.name] = agent
        unknown = [n for n in options.pipeline_order or [] if n not in self.agents]
        if unknown:
            raise InvalidOption(f"--pipeline-order names {unknown}, which no agent is called; use {sorted(self.agents)}.")
        self.cost = model_cost(store)
        self.profiles: dict[str, Profile] = {}
        self.lost: dict[str, tuple[AgentClient, float]] = {}   # name -> (client, when to try it again)
        self.route: Route | None = None
        self.stage_url = ""  # set once the stage server listens
        self.id = uuid.uuid4().hex   # how agents tell this coordinator from another
        self.deploying = False
        self.problem: str | None = None   # why the last deployment failed, until one succeeds
        self.on_deploy: Callable[[Route], None] | None = None   # told of every new plan (the CLI prints it)

    @property
    def url(self) -> str:
        """Where agents reach this coordinator (its stage server): they ask it /health to learn whether it lives."""
        return self.stage_url.removesuffix("/").removesuffix("/stages")

    # -- claiming agents ---------------------------------------------------------------------

    def claim(self, take_over: bool = False) -> None:
        """Make every agent serve this coordinator; an agent serving another live one refuses
        (AgentBusy, its sentence names that coordinator) unless `take_over`."""
        for agent in self.agents.values():
            self._claim_one(agent, take_over)

    def _claim_one(self, agent: AgentClient, take_over: bool = False) -> None:
        if not self.stage_url:
            raise AssertionError("the stage server must listen before claiming agents")
        answer = agent.post("/v1/claim", {"coordinator": self.id, "url": self.url, "take_over": take_over}, timeout=10)
        if agent.name in self.profiles:   # an agent started again may listen for data on another port
            self.profiles[agent.name].data_port = answer["data_port"]

    def _claimed(self, names: list[str]) -> tuple[list[str], list[str]]:
        """Those of `names` that serve this coordinator now, and the refusals of those that serve
        another (left out of this plan, asked again at the next deployment); one that does not answer
        is set aside as lost."""
        claimed, refusals = [], []
        for name in names:
            try:
                self._claim_one(self.agents[name])
                claimed.append(name)
            except AgentBusy as error:
                refusals.append(str(error))
            except SourceUnreachable:
                log.warning("agent %s does not answer; planning without it", name)
                self._set_aside(name, self.agents.pop(name))
        if refusals:
            log.warning("%s (left out of this plan)", "; ".join(refusals))
        if not claimed:
            raise PipelineUnavailable("; ".join(refusals) if refusals else "no agent of this pipeline answers; "
                                      "start them again (they are taken back at the next request).")
        return claimed, refusals

    # -- measuring and planning --------------------------------------------------------------

    def profile(self, names: list[str] | None = None) -> dict[str, Profile]:
        """Capabilities, a block-shaped compute profile, the disk read speed (unless streaming is
        off), round trips and bandwidths, from these agents (default: every one)."""
        config = AutoConfig.from_pretrained(self.store.root)
        hidden = config.hidden_size
        intermediate = getattr(config, "intermediate_size", None) or 4 * hidden
        scale = min(1.0, (PROFILE_BLOCK_LIMIT / (4 * (4 * hidden * hidden + 3 * hidden * intermediate))) ** 0.5)
        shape = {"hidden_size": max(16, int(hidden * scale)), "intermediate_size": max(16, int(intermediate * scale))}
        urls = {agent.url: name for name, agent in self.agents.items()}
        for name in names or list(self.agents):
            agent = self.agents[name]
            gflops = agent.post("/v1/profile/block", shape, timeout=120)["gflops"]
            disk = agent.post("/v1/profile/disk", {}, timeout=120)["bytes_per_s"] if self.options.streaming else 0.0
            # after the profiles: memory their buffers leave with the agent's allocator is not free for a stage
            capabilities = agent.get("/v1/capabilities")
            others = [url for url in urls if url != agent.url]
            probe = self.options.bandwidth_probe_bytes
            net = agent.post("/v1/net/ping", {"peers": others, "probe_bytes": probe}, timeout=60) if others else {}
            self.profiles[name] = Profile(
                capabilities["ram_available_bytes"], gflops, capabilities["data_port"], disk,
                {urls[u]: t for u, t in net.get("rtt_seconds", {}).items() if t is not None},
                {urls[u]: b for u, b in net.get("bandwidth_bytes_per_s", {}).items() if b})
        return self.profiles

    def make_plan(self, names: list[str]) -> Plan:
        """The best plan over these agents (in --pipeline-order where given)."""
        activations = activation_bytes(self.store, self.options.context_length)
        devices = [device_from_profile(n, self.profiles[n].available_bytes, self.profiles[n].gflops,
                                       self.options.mem_fraction, activations, self.profiles[n].disk_bytes_per_s)
                   for n in names]
        # --pipeline-order orders the agents alive now: a lost one is left out, a re-admitted one is back in place
        order = [n for n in (self.options.pipeline_order or names) if n in names]
        order += [n for n in names if n not in order]
        # a -> b: half a's measured round trip to b, and the bandwidth b measured fetching from a (else a LAN's)
        links = {(a, b): Link(rtt / 2, self.profiles[b].bandwidth_bytes_per_s.get(a, LAN.bandwidth_bytes_per_s))
                 for a in names for b, rtt in self.profiles[a].rtt_seconds.items() if b in names}
        options = PlanOptions(self.options.context_length, order, self.options.min_prefix,
                              self.options.objective, links, streaming=self.options.streaming)
        return plan(self.cost, devices, options)

    def save_plan(self, names: list[str]) -> Plan:
        """`make_plan`, also written to <work dir>/plan.json."""
        chosen = self.make_plan(names)
        self.options.work_dir.mkdir(parents=True, exist_ok=True)
        (self.options.work_dir / "plan.json").write_text(chosen.to_json())
        return chosen

    # -- deploying ---------------------------------------------------------------------------

    def deploy(self, names: list[str] | None = None) -> Route:
        """Claim these agents (default: all), plan on those that serve this coordinator, package the
        stages and have each agent load its own; `problem` keeps why it failed, until one succeeds."""
        self.deploying = True
        try:
            route = self._deploy(names or list(self.agents))
        except Exception as error:
            self.problem = str(error)
            raise
        finally:
            self.deploying = False
        self.problem = None
        return route

    def _deploy(self, names: list[str]) -> Route:
        claimed, refusals = self._claimed(names)
        try:
            chosen = self.save_plan(claimed)
        except PlanInfeasible as error:
            if claimed == names:
                raise
            why = "; ".join(refusals) or f"agent(s) {', '.join(n for n in names if n not in claimed)} do not answer"
            raise PipelineUnavailable(f"{why}; the agents left ({', '.join(claimed)}) cannot hold the model: "
                                      f"{error}") from None
        epoch = self.route.epoch + 1 if self.route else 0
        packages = package_plan(self.store, chosen, self.options.work_dir / "stages")
        agents = [self.agents[s.device] for s in chosen.stages]

        def load(pair) -> SourceUnreachable | None:
            agent, package, stage = pair
            body = {"coordinator": self.id, "url": f"{self.stage_url}{package.stage_id}/", "stage_id": package.stage_id,
                    "epoch": epoch, "metadata_only": False,
                    "stream_budget_bytes": stage.stream_budget_bytes if stage.streamed_bytes_per_token else None}
            try:
                agent.post("/v1/stage/load", body, timeout=600)
            except SourceUnreachable as error:
                return error
            return None

        with ThreadPoolExecutor(len(agents)) as pool:
            failed = list(pool.map(load, zip(agents, packages, chosen.stages)))
        for stage, agent, error in zip(chosen.stages, agents, failed):
            if error is not None and not agent.alive(timeout=2.0):
                log.warning("agent %s died while loading its stage (%s of its %s budget): the connection dropped "
                            "and it no longer answers, as when a process is killed by a signal (the kernel's "
                            "out-of-memory killer sends SIGKILL); re-planning without it",
                            agent.name, format_bytes(stage.memory_bytes), format_bytes(stage.budget_bytes))
                return self.recover(agent.name)
            if error is not None:
                raise error
        endpoints = [f"tcp://{a.host}:{self.profiles[a.name].data_port}" for a in agents]
        self.route = Route(epoch, chosen, agents, endpoints, [p.stage_id for p in packages])
        if self.on_deploy is not None:
            self.on_deploy(self.route)
        return self.route

    def recover(self, lost: str) -> Route:
        """Set a lost agent aside and deploy a new plan on the ones left, or say why that cannot
        work. The lost agent is tried again by `readmit` once `readmit_after_s` have passed."""
        log.warning("agent %s was lost; re-planning on the others", lost)
        if lost in self.agents:
            self._set_aside(lost, self.agents.pop(lost))
        if not self.agents:
            self.problem = f"agent {lost} was lost and no agents are left; start agents and retry."
            raise PlanInfeasible(self.problem)
        try:
            return self.deploy(list(self.agents))
        except PlanInfeasible as error:
            raise PlanInfeasible(f"agent {lost} was lost and the agents left ({', '.join(self.agents)}) cannot hold "
                                 f"the model: {error}") from None

    def readmit(self) -> Route | None:
        """Take back lost agents that answer again (after their wait; a silent one waits again),
        profile them and deploy a new plan that may use them; None when nobody came back.
        Petals-style: a failed peer is left alone for a while, not forgotten."""
        now, back = time.monotonic(), []
        for name, (client, retry_at) in list(self.lost.items()):
            if now < retry_at:
                continue
            if client.alive(timeout=1.0):
                self.agents[name] = self.lost.pop(name)[0]
                back.append(name)
            else:
                self._set_aside(name, client)
        if not back:
            return None
        log.warning("agent(s) %s answer again; re-planning with them", ", ".join(back))
        try:
            self.profile(back)
            return self.deploy(list(self.agents))
        except (ShardstreamError, httpx.HTTPError) as error:   # gone again: back to the plan without them
            log.warning("re-admitting %s failed (%s); keeping the plan without them", ", ".join(back), error)
            for name in back:
                if name in self.agents:   # (a deployment sets aside one that stopped answering itself)
                    self._set_aside(name, self.agents.pop(name))
            return self.deploy(list(self.agents))

    def join(self, agent: AgentClient) -> Route:
        """Take in an agent that asked to join (`agent --join`: it wants to serve this coordinator, so
        it is taken over from any other), profile it and deploy a new plan over every agent. One of the
        same name at the same address (started again) replaces the old; another address is refused."""
        agent.name = agent.get("/v1/capabilities", timeout=10)["name"]
        known = self.agents.get(agent.name) or self.lost.get(agent.name, (None, 0.0))[0]
        if known is not None and known.url != agent.url:
            raise InvalidOption(f"an agent named {agent.name!r} is in this pipeline already ({known.url}); start the "
                                f"one at {agent.url} with another --name.")
        self._claim_one(agent, take_over=True)
        self.lost.pop(agent.name, None)
        self.agents[agent.name] = agent
        log.warning("agent %s at %s joins; re-planning with it", agent.name, agent.url)
        try:
            self.profile([agent.name])
        except (ShardstreamError, httpx.HTTPError):
            del self.agents[agent.name]
            raise
        return self.deploy()

    def _set_aside(self, name: str, client: AgentClient) -> None:
        """Keep a lost agent's client, to be tried again after `readmit_after_s`."""
        self.lost[name] = (client, time.monotonic() + self.options.readmit_after_s)

    def close(self) -> None:
        for agent in [*self.agents.values(), *(client for client, _ in self.lost.values())]:
            agent.close()
