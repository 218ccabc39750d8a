"""Pipeline planner: which device runs which contiguous run of transformer blocks.

The split is the exact optimum over all contiguous splits that fit memory (a hard limit), found by
dynamic programming over (blocks assigned so far, device in pipeline order). Each stage holds at
least one block; devices keep their pipeline order and any of them may be left out. A stage's
predicted time is its compute plus the hop to the next stage, so "latency" (one token stream) is
the sum of stage times and "throughput" (a full pipeline) is their maximum, the bottleneck.

Only when no split fits in memory (and `PlanOptions.streaming` allows it), a stage may also be
larger than its device: it runs with the streaming engine, keeping its KV cache, embeddings or
head, the first blocks that fit (as `stream.residency.choose_resident` picks them) and the pieces
in flight in memory, and reads the rest from disk every token; a last stage that cannot keep its
big head beside that streams the head too. Such a stage costs its compute plus the streamed bytes
at the device's measured disk read speed (a bound: prefetch overlaps the two).

A block whose MoE experts are read on demand (placed apart: the stage reads only those its router picks)
counts its other weights as its weight; its stage also holds, once, the buffers its experts are read into
(the largest of its blocks'), and reads the routed experts every token, priced as streamed bytes are, at
UNMEASURED_DISK_BYTES_PER_S on a device that reported no disk speed (it may not stream blocks, but such a
stage reads its experts all the same).
"""

from __future__ import annotations

import json
import math
from bisect import bisect_left, bisect_right
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from itertools import accumulate, takewhile
from typing import Literal

from shardstream.errors import InvalidOption, PlanInfeasible

Objective = Literal["latency", "throughput"]
Choice = Callable[[float], tuple[float, int]]


@dataclass(frozen=True)
class LayerCost:
    """One transformer block; blocks differ (MoE, sliding-window attention), so each has its own. A block
    whose experts are read on demand has its other weights as `weight_bytes`."""

    weight_bytes: int
    kv_bytes_per_token: int
    flops_per_token: float
    expert_reading_bytes: int = 0   # buffers its experts are read into; a stage holds its blocks' largest, once
    expert_bytes_per_token: int = 0   # bytes of the experts a token is routed to, read from disk (none assumed kept)


@dataclass
class ModelCost:
    """A whole model; start (embeddings) rides on the first stage, end (norm, head) on the last."""

    layers: list[LayerCost]
    activation_bytes_per_token: int
    start_bytes: int = 0
    end_bytes: int = 0
    end_flops_per_token: float = 0.0
    head_bytes: int = 0   # of end_bytes, what a streamed last stage may read every token instead of holding


@dataclass(frozen=True)
class Device:
    """A machine: its budget is already RAM x mem_fraction; overhead is kept for activations."""

    name: str
    memory_budget_bytes: int
    gflops: float
    overhead_bytes: int = 0
    disk_bytes_per_s: float = 0.0   # measured read speed of its stage files; 0: it cannot stream blocks


STREAM_DEPTH = 1   # reading units a streamed stage reads ahead while one computes
STREAM_UNIT_BYTES = 64 << 20   # a streamed block's reading unit at most: the engine reads blocks in pieces (stream/pieces.py)
# what experts read on demand are priced at on a device that measured no disk: a SATA SSD's nominal reads
UNMEASURED_DISK_BYTES_PER_S = 500e6


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
    streaming: bool = True   # when nothing fits in memory, stages may stream blocks from disk


@dataclass
class Stage:
    """Blocks [first_layer, last_layer_exclusive) on one device; time includes the outgoing hop."""

    device: str
    first_layer: int
    last_layer_exclusive: int
    memory_bytes: int
    budget_bytes: int
    predicted_seconds_per_token: float
    streamed_bytes_per_token: int = 0   # > 0: the stage streams these bytes of blocks from disk per token
    read_seconds_per_token: float = 0.0   # their and its experts' price at the disk read speed (in the time above)
    stream_budget_bytes: int = 0   # a streamed stage's resident budget: blocks resident and in flight, and a head it keeps
    expert_bytes_per_token: int = 0   # bytes of experts read on demand from disk per token


@dataclass
class Plan:
    """The chosen stages in pipeline order and the objective's predicted seconds per token."""

    objective: str
    objective_value: float
    stages: list[Stage]

    def table(self) -> str:
        """The plan as an aligned text table, for the coordinator to print."""
        streams = any(s.streamed_bytes_per_token for s in self.stages)
        experts = any(s.expert_bytes_per_token for s in self.stages)
        rows = [("device", "layers", "memory used / budget", "ms/token", *(["streamed from disk/token"] * streams),
                 *(["experts read/token"] * experts))]
        rows += [
            (
                s.device,
                _layer_range(s.first_layer, s.last_layer_exclusive),
                f"{format_bytes(s.memory_bytes)} / {format_bytes(s.budget_bytes)}",
                _milliseconds(s.predicted_seconds_per_token),
                *([_streamed(s)] * streams),
                *([_read(s, s.expert_bytes_per_token)] * experts),
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


def _streamed(stage: Stage) -> str:
    if not stage.streamed_bytes_per_token:
        return "no (in memory)"
    return _read(stage, stage.streamed_bytes_per_token)


def _read(stage: Stage, nbytes: int) -> str:
    """`nbytes` of what the stage reads a token (blocks or experts, at one disk speed) and their share of its
    read time."""
    total = stage.streamed_bytes_per_token + stage.expert_bytes_per_token
    seconds = stage.read_seconds_per_token * nbytes / total if nbytes else 0.0
    return f"{format_bytes(nbytes)} ({_milliseconds(seconds)} ms)"


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
    """The best contiguous split in memory; failing that (and if allowed) the best with streamed
    stages; else PlanInfeasible with the memory that is missing."""
    p = _Problem(model, devices, options)
    spans = _search(p, streaming=False)
    if spans is None and options.streaming and p.can_stream:
        spans = _search(p, streaming=True)
    if spans is None:
        raise PlanInfeasible(p.infeasible_message())
    return p.make_plan(spans)


def _search(p: _Problem, streaming: bool) -> list[tuple[int, int, int]] | None:
    """Dynamic programming over (blocks assigned so far, device): the best stages as (device, first,
    end), or None when no split is possible."""
    choose = _min_sum if p.options.objective == "latency" else _min_max
    n, D = p.num_layers, len(p.devices)
    # before[d][i]: best value of the stages that cover blocks [0, i) when device d starts at i
    before = [[0.0] + [math.inf] * n for _ in range(D)]
    came_from: list[list[tuple[int, int]]] = [[(-1, -1)] * (n + 1) for _ in range(D)]
    best, last, last_start = math.inf, -1, -1
    for d in range(D):
        for j in range(1, n + 1):
            chosen = choose([(before[d][i], own, i) for i, own in p.options_ending_at(d, j, streaming)])
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
        return None
    spans = [(last, last_start, n)]
    while spans[-1][1] > 0:
        d, i, _ = spans[-1]
        spans.append((*came_from[d][i], i))
    return spans[::-1]


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
        self.mem, self.flops, self.weights, self.expert_reads = [0], [0.0], [0], [0]
        for layer in model.layers:
            kv_bytes = layer.kv_bytes_per_token * options.context_length
            self.mem.append(self.mem[-1] + layer.weight_bytes + kv_bytes)
            self.flops.append(self.flops[-1] + layer.flops_per_token)
            self.weights.append(self.weights[-1] + layer.weight_bytes)
            self.expert_reads.append(self.expert_reads[-1] + layer.expert_bytes_per_token)
        self.free = [d.memory_budget_bytes - d.overhead_bytes for d in self.devices]
        self.can_stream = any(d.disk_bytes_per_s > 0 for d in self.devices)
        self.read_speed = [d.disk_bytes_per_s or UNMEASURED_DISK_BYTES_PER_S for d in self.devices]
        sizes = [min(layer.weight_bytes, STREAM_UNIT_BYTES) for layer in model.layers]
        # largest[i][k]: the largest reading unit of blocks i .. i + k, as a streamed stage reads them
        self.largest = _running_max(sizes) if self.can_stream else []
        reading = [layer.expert_reading_bytes for layer in model.layers]
        # reading[i][k]: the largest expert buffers of blocks i .. i + k, which their stage holds
        self.reading = _running_max(reading) if any(reading) else []
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
        reading = self.reading[i][j - i - 1] if self.reading else 0
        return self.mem[j] - self.mem[i] + first + last + reading

    def compute(self, d: int, i: int, j: int) -> float:
        return (self.flops[j] - self.flops[i]) * self.seconds_per_flop[d]

    def read_seconds(self, d: int, i: int, j: int, streamed: int = 0) -> float:
        """What blocks [i, j) on device d read from disk a token, priced at its speed: `streamed` bytes of
        blocks and the experts routed to."""
        read = streamed + self.expert_reads[j] - self.expert_reads[i]
        return read / self.read_speed[d] if read else 0.0

    def starts(self, d: int, j: int) -> list[int]:
        """Every i such that blocks [i, j) fit device d as a stage, latest first."""
        last = self.model.end_bytes if j == self.num_layers else 0
        lowest = max(1, bisect_left(self.mem, self.mem[j] + last - self.free[d]))
        found = list(range(j - 1, lowest - 1, -1))
        if self.reading:   # the expert buffers only grow as the start moves back
            found = list(takewhile(lambda i: self.stage_bytes(i, j) <= self.free[d], found))
        if j >= max(1, self.options.min_prefix) and self.stage_bytes(0, j) <= self.free[d]:
            found.append(0)
        return found

    def options_ending_at(self, d: int, j: int, streaming: bool) -> list[tuple[int, float]]:
        """(i, own seconds) for every stage [i, j) device d can run, latest start first; own time
        (compute, plus disk reads of experts and, when streamed, of blocks) does not decrease as the start
        moves back."""
        flops, seconds_per_flop = self.flops, self.seconds_per_flop[d]
        if not streaming or self.devices[d].disk_bytes_per_s <= 0:
            return [(i, (flops[j] - flops[i]) * seconds_per_flop + self.read_seconds(d, i, j))
                    for i in self.starts(d, j)]
        found = []
        for i in range(j - 1, -1, -1):
            if i == 0 and j < max(1, self.options.min_prefix):
                break
            layout = self.layout(d, i, j)
            if layout is None:   # a stage starting earlier needs even more memory
                break
            found.append((i, (flops[j] - flops[i]) * seconds_per_flop + self.read_seconds(d, i, j, layout[1])))
        return found

    def layout(self, d: int, i: int, j: int) -> tuple[int, int, int] | None:
        """Blocks [i, j) as a stage on device d: (memory used, bytes streamed per token, memory for
        blocks), overhead excluded; None when even streaming cannot fit it. In memory when it fits;
        else the streaming engine's layout: KV cache, start/end parts, expert buffers, STREAM_DEPTH + 1
        reading units in flight and the first blocks that fit in what is left (choose_resident's rule); a
        last stage whose head leaves no room for that streams the head as well."""
        total = self.stage_bytes(i, j)
        if total <= self.free[d]:
            return total, 0, 0
        if self.devices[d].disk_bytes_per_s <= 0:
            return None
        blocks = self.weights[j] - self.weights[i]
        for_blocks = self.free[d] - (total - blocks)
        room = for_blocks - (STREAM_DEPTH + 1) * self.largest[i][j - i - 1]
        last = j == self.num_layers
        head = self.model.head_bytes if last and room < 0 else 0
        room, for_blocks = room + head, for_blocks + head
        if room < 0:
            return None
        resident_end = min(j, bisect_right(self.weights, self.weights[i] + room) - 1)
        streamed = self.weights[j] - self.weights[resident_end] + head
        # the engine places a big head out of its resident budget (stream/ends.py): one the plan keeps is in it
        budget = for_blocks + (self.model.head_bytes if last and not head else 0)
        return self.free[d] - room + self.weights[resident_end] - self.weights[i], streamed, budget

    def make_plan(self, spans: list[tuple[int, int, int]]) -> Plan:
        stages = []
        for k, (d, i, j) in enumerate(spans):
            after = self.hop[d][spans[k + 1][0]] if k + 1 < len(spans) else self.end_seconds[d]
            device = self.devices[d]
            used, streamed, for_blocks = self.layout(d, i, j)
            read = self.read_seconds(d, i, j, streamed)
            seconds = self.compute(d, i, j) + read + after
            stages.append(Stage(device.name, i, j, used + device.overhead_bytes, device.memory_budget_bytes, seconds,
                                streamed, read, for_blocks, self.expert_reads[j] - self.expert_reads[i]))
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
            " --mem-fraction, lower --context-length or use compression" + self._streaming_hint()
        )

    def _streaming_hint(self) -> str:
        if not self.options.streaming:
            return ", or drop --no-streaming so that agents may stream blocks from their disk."
        if not self.can_stream:
            return " (no device reported a disk read speed, so none may stream blocks from disk)."
        return (". Streaming blocks from disk does not help: a streamed stage still keeps its KV cache, its"
                f" small outside parts and {STREAM_DEPTH + 1} pieces of blocks in flight in memory.")


def _running_max(sizes: list[int]) -> list[list[int]]:
    """table[i][k]: the largest of sizes[i .. i + k]."""
    return [list(accumulate(sizes[i:], max)) for i in range(len(sizes))]


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
    if any(device.disk_bytes_per_s < 0 for device in devices):
        raise InvalidOption("A device's disk_bytes_per_s must be >= 0 (0: it cannot stream); measure it again.")
    links = [options.default_link, *options.links.values()]
    if any(link.latency_s < 0 or link.bandwidth_bytes_per_s <= 0 for link in links):
        raise InvalidOption("Every link needs latency >= 0 and bandwidth > 0; measure it again.")
    costs = [(x.weight_bytes, x.kv_bytes_per_token, x.flops_per_token, x.expert_reading_bytes,
              x.expert_bytes_per_token) for x in model.layers]
    if min(map(min, costs)) < 0 or min(model.start_bytes, model.end_bytes, model.end_flops_per_token) < 0:
        raise InvalidOption("Model costs must be non-negative; rebuild the cost table from the store.")
