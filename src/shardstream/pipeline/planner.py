"""Pipeline planner: which device runs which contiguous run of transformer blocks.

The split is the exact optimum over all contiguous splits that fit memory (a hard limit), found by
dynamic programming over (blocks assigned so far, device in pipeline order). Each stage holds at
least one block; devices keep their pipeline order and any of them may be left out. A stage's
predicted time is its compute plus the hop to the next stage, so "latency" (one token stream) is
the sum of stage times and "throughput" (a full pipeline) is their maximum, the bottleneck.
"""

from __future__ import annotations

import json
import math
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Literal

from shardstream.errors import InvalidOption, PlanInfeasible

Objective = Literal["latency", "throughput"]
Choice = Callable[[float], tuple[float, int]]


@dataclass(frozen=True)
class LayerCost:
    """One transformer block; blocks differ (MoE, sliding-window attention), so each has its own."""

    weight_bytes: int
    kv_bytes_per_token: int
    flops_per_token: float


@dataclass
class ModelCost:
    """A whole model; start (embeddings) rides on the first stage, end (norm, head) on the last."""

    layers: list[LayerCost]
    activation_bytes_per_token: int
    start_bytes: int = 0
    end_bytes: int = 0
    end_flops_per_token: float = 0.0


@dataclass(frozen=True)
class Device:
    """A machine: its budget is already RAM x mem_fraction; overhead is kept for activations."""

    name: str
    memory_budget_bytes: int
    gflops: float
    overhead_bytes: int = 0


@dataclass(frozen=True)
class Link:
    """The network between two devices, one direction."""

    latency_s: float
    bandwidth_bytes_per_s: float


LAN = Link(latency_s=1e-3, bandwidth_bytes_per_s=125e6)  # 1 Gbit/s Ethernet


@dataclass
class PlanOptions:
    """How to plan. The first stage (whichever device it lands on) holds at least min_prefix blocks.

    pipeline_order names the devices to consider, in stage order (None: the order given); links
    maps (sender, receiver) names to a Link, default_link covers the pairs it lacks.
    """

    context_length: int
    pipeline_order: list[str] | None = None
    min_prefix: int = 0
    objective: Objective = "latency"
    links: dict[tuple[str, str], Link] = field(default_factory=dict)
    default_link: Link = LAN


@dataclass
class Stage:
    """Blocks [first_layer, last_layer_exclusive) on one device; time includes the outgoing hop."""

    device: str
    first_layer: int
    last_layer_exclusive: int
    memory_bytes: int
    budget_bytes: int
    predicted_seconds_per_token: float


@dataclass
class Plan:
    """The chosen stages in pipeline order and the objective's predicted seconds per token."""

    objective: str
    objective_value: float
    stages: list[Stage]

    def table(self) -> str:
        """The plan as an aligned text table, for the coordinator to print."""
        rows = [("device", "layers", "memory used / budget", "ms/token")]
        rows += [
            (
                s.device,
                _layer_range(s.first_layer, s.last_layer_exclusive),
                f"{format_bytes(s.memory_bytes)} / {format_bytes(s.budget_bytes)}",
                _milliseconds(s.predicted_seconds_per_token),
            )
            for s in self.stages
        ]
        widths = [max(len(row[k]) for row in rows) for k in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
        kind = "sum of stages" if self.objective == "latency" else "slowest stage"
        lines.append(f"{self.objective}: {_milliseconds(self.objective_value)} ms/token ({kind})")
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        data = json.loads(text)
        stages = [Stage(**stage) for stage in data["stages"]]
        return cls(data["objective"], data["objective_value"], stages)


def _layer_range(first: int, end: int) -> str:
    return f"{first}-{end - 1}" if end - first > 1 else str(first)


def _milliseconds(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.3g}" if ms < 1000 else f"{ms:,.0f}"


def format_bytes(n: int) -> str:
    """Binary units, exact below 1 KiB."""
    power = 0
    while power < 4 and abs(n) >= 1024 ** (power + 1):
        power += 1
    return f"{n} B" if power == 0 else f"{n / 1024**power:.2f} {('KiB', 'MiB', 'GiB', 'TiB')[power - 1]}"


def plan(model: ModelCost, devices: list[Device], options: PlanOptions) -> Plan:
    """The best contiguous split, or PlanInfeasible with the memory that is missing."""
    p = _Problem(model, devices, options)
    choose = _min_sum if options.objective == "latency" else _min_max
    n, D = p.num_layers, len(p.devices)
    # before[d][i]: best value of the stages that cover blocks [0, i) when device d starts at i
    before = [[0.0] + [math.inf] * n for _ in range(D)]
    came_from: list[list[tuple[int, int]]] = [[(-1, -1)] * (n + 1) for _ in range(D)]
    best, last, last_start = math.inf, -1, -1
    for d in range(D):
        flops, seconds_per_flop = p.flops, p.seconds_per_flop[d]
        for j in range(1, n + 1):
            # (time before, own compute time, start) for each start; p.compute inlined: hot loop
            chosen = choose(
                [(before[d][i], (flops[j] - flops[i]) * seconds_per_flop, i) for i in p.starts(d, j)]
            )
            if j == n:
                value, i = chosen(p.end_seconds[d])
                if value < best:
                    best, last, last_start = value, d, i
                continue
            for e in range(d + 1, D):
                value, i = chosen(p.hop[d][e])
                if value < before[e][j]:
                    before[e][j], came_from[e][j] = value, (d, i)
    if last < 0:
        raise PlanInfeasible(p.infeasible_message())
    spans = [(last, last_start, n)]
    while spans[-1][1] > 0:
        d, i, _ = spans[-1]
        spans.append((*came_from[d][i], i))
    return p.make_plan(spans[::-1])


def _min_sum(options: list[tuple[float, float, int]]) -> Choice:
    """Latency: the stages before, this stage and its outgoing hop add up, so one start wins."""
    value, start = min(((b + c, i) for b, c, i in options), default=(math.inf, -1))
    return lambda hop: (value + hop, start)


def _min_max(options: list[tuple[float, float, int]]) -> Choice:
    """Throughput: the best start depends on the hop, so keep the starts not beaten on both
    counts (time before, own time) and bisect for the one where the two cross.

    options come with own time c non-decreasing (start moving back).
    """
    kept, lowest = [], math.inf
    for b, c, i in options:
        if b < lowest:
            kept.append((b, c, i))
            lowest = b
    keys = [c - b for b, c, _ in kept]  # increasing

    def query(hop: float) -> tuple[float, int]:
        k = bisect_left(keys, -hop)  # before k the time before counts, from k on own time + hop
        if k == 0:
            return (kept[0][1] + hop, kept[0][2]) if kept else (math.inf, -1)
        if k < len(kept) and kept[k][1] + hop < kept[k - 1][0]:
            return kept[k][1] + hop, kept[k][2]
        return kept[k - 1][0], kept[k - 1][2]

    return query


class _Problem:
    """Validated inputs as prefix sums and tables, so any stage's cost is O(1)."""

    def __init__(self, model: ModelCost, devices: list[Device], options: PlanOptions):
        _validate(model, devices, options)
        by_name = {device.name: device for device in devices}
        order = options.pipeline_order or [device.name for device in devices]
        self.devices = [by_name[name] for name in order]
        self.num_layers = len(model.layers)
        self.options, self.model = options, model
        self.mem, self.flops = [0], [0.0]
        for layer in model.layers:
            kv_bytes = layer.kv_bytes_per_token * options.context_length
            self.mem.append(self.mem[-1] + layer.weight_bytes + kv_bytes)
            self.flops.append(self.flops[-1] + layer.flops_per_token)
        self.free = [d.memory_budget_bytes - d.overhead_bytes for d in self.devices]
        self.seconds_per_flop = [1 / (d.gflops * 1e9) for d in self.devices]
        self.end_seconds = [model.end_flops_per_token * s for s in self.seconds_per_flop]
        self.hop = [[self._hop(a, b) for b in self.devices] for a in self.devices]

    def _hop(self, a: Device, b: Device) -> float:
        link = self.options.links.get((a.name, b.name), self.options.default_link)
        return link.latency_s + self.model.activation_bytes_per_token / link.bandwidth_bytes_per_s

    def stage_bytes(self, i: int, j: int) -> int:
        """Memory of blocks [i, j) as a stage, device overhead excluded."""
        first = self.model.start_bytes if i == 0 else 0
        last = self.model.end_bytes if j == self.num_layers else 0
        return self.mem[j] - self.mem[i] + first + last

    def compute(self, d: int, i: int, j: int) -> float:
        return (self.flops[j] - self.flops[i]) * self.seconds_per_flop[d]

    def starts(self, d: int, j: int) -> list[int]:
        """Every i such that blocks [i, j) fit device d as a stage, latest first."""
        last = self.model.end_bytes if j == self.num_layers else 0
        lowest = max(1, bisect_left(self.mem, self.mem[j] + last - self.free[d]))
        found = list(range(j - 1, lowest - 1, -1))
        if j >= max(1, self.options.min_prefix) and self.stage_bytes(0, j) <= self.free[d]:
            found.append(0)
        return found

    def make_plan(self, spans: list[tuple[int, int, int]]) -> Plan:
        stages = []
        for k, (d, i, j) in enumerate(spans):
            after = self.hop[d][spans[k + 1][0]] if k + 1 < len(spans) else self.end_seconds[d]
            device = self.devices[d]
            memory = self.stage_bytes(i, j) + device.overhead_bytes
            seconds = self.compute(d, i, j) + after
            stages.append(Stage(device.name, i, j, memory, device.memory_budget_bytes, seconds))
        times = [s.predicted_seconds_per_token for s in stages]
        value = sum(times) if self.options.objective == "latency" else max(times)
        return Plan(self.options.objective, value, stages)

    def shortfall(self) -> int:
        """Over all splits, the least overflow of the most overflowing stage: the missing memory."""
        n, D, min_prefix = self.num_layers, len(self.devices), self.options.min_prefix
        before = [[-math.inf] + [math.inf] * n for _ in range(D)]
        best = math.inf
        for d in range(D):
            for j in range(1, n + 1):
                first = 0 if j >= min_prefix else 1
                over = min(
                    (max(before[d][i], self.stage_bytes(i, j) - self.free[d]) for i in range(first, j)),
                    default=math.inf,
                )
                if j == n:
                    best = min(best, over)
                for e in range(d + 1, D):
                    before[e][j] = min(before[e][j], over)
        return int(best)

    def infeasible_message(self) -> str:
        need = self.stage_bytes(0, self.num_layers)
        offer = sum(max(0, free) for free in self.free)
        return (
            f"No split of the {self.num_layers} blocks fits in memory: the best one still overflows"
            f" a device by {format_bytes(self.shortfall())} (the model needs {format_bytes(need)},"
            f" the devices offer {format_bytes(offer)} after overhead); add devices, raise"
            " --mem-fraction, lower --context-length or use compression."
        )


def _validate(model: ModelCost, devices: list[Device], options: PlanOptions) -> None:
    names = [device.name for device in devices]
    order = options.pipeline_order or names
    if not model.layers:
        raise InvalidOption("The model cost has no blocks; build it from a store with at least one block.")
    if len(set(names)) != len(names) or len(set(order)) != len(order) or not set(order) <= set(names):
        raise InvalidOption(f"pipeline_order {order} must name distinct devices among {names}; fix it.")
    if options.objective not in ("latency", "throughput"):
        raise InvalidOption(f"objective {options.objective!r} is unknown; use 'latency' or 'throughput'.")
    if options.context_length < 0 or not 0 <= options.min_prefix <= len(model.layers):
        raise InvalidOption(
            f"context_length must be >= 0 and min_prefix between 0 and {len(model.layers)}; fix them."
        )
    if any(device.gflops <= 0 for device in devices):
        raise InvalidOption("Every device needs gflops > 0; measure it again.")
    links = [options.default_link, *options.links.values()]
    if any(link.latency_s < 0 or link.bandwidth_bytes_per_s <= 0 for link in links):
        raise InvalidOption("Every link needs latency >= 0 and bandwidth > 0; measure it again.")
    costs = [(x.weight_bytes, x.kv_bytes_per_token, x.flops_per_token) for x in model.layers]
    if min(map(min, costs)) < 0 or min(model.start_bytes, model.end_bytes, model.end_flops_per_token) < 0:
        raise InvalidOption("Model costs must be non-negative; rebuild the cost table from the store.")
