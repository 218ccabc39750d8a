"""The planner against brute force on random small instances, plus the cases users will hit."""

import json
import math
import random
import re
import time
from dataclasses import replace
from itertools import combinations

import pytest

from shardstream.errors import InvalidOption, PlanInfeasible
from shardstream.pipeline.planner import (
    STREAM_DEPTH,
    STREAM_UNIT_BYTES,
    UNMEASURED_DISK_BYTES_PER_S,
    Device,
    LayerCost,
    Link,
    ModelCost,
    Plan,
    PlanOptions,
    format_bytes,
    plan,
)
from shardstream.stream.residency import choose_resident

FREE = Link(latency_s=0.0, bandwidth_bytes_per_s=1e30)
GIB = 1024**3


def evaluate(model, devices, options, spans):
    """(stage times, largest overflow) of stages spans = [(device, first, end)], from scratch."""
    times, overflow = [], -math.inf
    for k, (device, first, end) in enumerate(spans):
        blocks = model.layers[first:end]
        memory = device.overhead_bytes + sum(
            b.weight_bytes + b.kv_bytes_per_token * options.context_length for b in blocks
        )
        flops = sum(b.flops_per_token for b in blocks)
        memory += model.start_bytes if k == 0 else 0
        if k == len(spans) - 1:
            memory += model.end_bytes
            flops += model.end_flops_per_token
            hop = 0.0
        else:
            link = options.links.get((device.name, spans[k + 1][0].name), options.default_link)
            hop = link.latency_s + model.activation_bytes_per_token / link.bandwidth_bytes_per_s
        overflow = max(overflow, memory - device.memory_budget_bytes)
        times.append(flops / (device.gflops * 1e9) + hop)
    return times, overflow


def every_split(model, devices, options):
    """Every (device, first, end) span list the options allow: devices in order, contiguous blocks."""
    n = len(model.layers)
    order = [next(d for d in devices if d.name == name) for name in options.pipeline_order]
    for k in range(1, min(n, len(order)) + 1):
        for used in combinations(order, k):
            for cuts in combinations(range(1, n), k - 1):
                bounds = [0, *cuts, n]
                if bounds[1] >= options.min_prefix:
                    yield list(zip(used, bounds, bounds[1:]))


def brute_force(model, devices, options):
    """Best latency, best throughput and least overflow over every split, by enumeration."""
    best = {"latency": math.inf, "throughput": math.inf}
    least_overflow = math.inf
    for spans in every_split(model, devices, options):
        times, overflow = evaluate(model, devices, options, spans)
        least_overflow = min(least_overflow, overflow)
        if overflow <= 0:
            best["latency"] = min(best["latency"], sum(times))
            best["throughput"] = min(best["throughput"], max(times))
    return best, least_overflow


def random_instance(rng):
    n, count = rng.randint(1, 8), rng.randint(1, 4)
    heavy = rng.random() < 0.5  # MoE-like: some blocks far heavier than others
    layers = [
        LayerCost(
            weight_bytes=rng.randint(0, 20) * (rng.choice([1, 4]) if heavy else 1),
            kv_bytes_per_token=rng.randint(0, 3),
            flops_per_token=rng.uniform(0, 1e9) * (rng.choice([1, 8]) if heavy else 1),
        )
        for _ in range(n)
    ]
    model = ModelCost(
        layers,
        activation_bytes_per_token=rng.randint(1, 10**6),
        start_bytes=rng.randint(0, 15),
        end_bytes=rng.randint(0, 15),
        end_flops_per_token=rng.uniform(0, 1e9),
    )
    devices = [
        Device(f"dev{k}", rng.randint(0, 90), rng.uniform(0.5, 50), rng.randint(0, 5)) for k in range(count)
    ]
    names = [d.name for d in devices]
    links = {
        (a, b): Link(rng.uniform(0, 0.05), rng.uniform(1e6, 1e8))
        for a in names
        for b in names
        if a != b and rng.random() < 0.5
    }
    options = PlanOptions(
        context_length=rng.randint(0, 4),
        pipeline_order=rng.sample(names, rng.randint(1, count)),
        min_prefix=rng.randint(0, n) if rng.random() < 0.3 else 0,
        links=links,
        default_link=Link(rng.uniform(0, 0.01), rng.uniform(1e6, 1e9)),
    )
    return model, devices, options


def planned_spans(result, devices):
    """The plan's stages as (device, first block, end block), as the brute-force evaluators take them."""
    by_name = {d.name: d for d in devices}
    return [(by_name[s.device], s.first_layer, s.last_layer_exclusive) for s in result.stages]


def check_plan(result, model, devices, options, optimum):
    """The returned plan is valid and its value, recomputed from scratch, is the optimum."""
    spans = planned_spans(result, devices)
    assert [s.first_layer for s in result.stages][0] == 0
    assert [s.last_layer_exclusive for s in result.stages][-1] == len(model.layers)
    assert all(a.last_layer_exclusive == b.first_layer for a, b in zip(result.stages, result.stages[1:]))
    positions = [options.pipeline_order.index(s.device) for s in result.stages]
    assert positions == sorted(set(positions))
    assert result.stages[0].last_layer_exclusive >= options.min_prefix
    assert all(s.memory_bytes <= s.budget_bytes for s in result.stages)
    times, overflow = evaluate(model, devices, options, spans)
    assert overflow <= 0
    assert [s.predicted_seconds_per_token for s in result.stages] == pytest.approx(times, rel=1e-9)
    value = sum(times) if options.objective == "latency" else max(times)
    assert result.objective_value == pytest.approx(value, rel=1e-9)
    assert result.objective_value == pytest.approx(optimum, rel=1e-9)


def test_matches_brute_force_on_random_instances():
    rng = random.Random(20240601)
    outcomes = {"feasible": 0, "infeasible": 0, "devices left out": 0, "several stages": 0}
    for _ in range(1000):
        model, devices, options = random_instance(rng)
        best, least_overflow = brute_force(model, devices, options)
        for objective in ("latency", "throughput"):
            options.objective = objective
            if least_overflow > 0:
                with pytest.raises(PlanInfeasible) as caught:
                    plan(model, devices, options)
                assert f"overflows a device by {format_bytes(least_overflow)} (" in str(caught.value)
                outcomes["infeasible"] += 1
                continue
            result = plan(model, devices, options)
            check_plan(result, model, devices, options, best[objective])
            outcomes["feasible"] += 1
            outcomes["devices left out"] += len(result.stages) < len(options.pipeline_order)
            outcomes["several stages"] += len(result.stages) > 1
    assert min(outcomes.values()) > 200, outcomes  # every case is exercised, not just one


def test_slow_device_in_the_middle_is_left_out():
    model = ModelCost([LayerCost(10, 0, 1e9)] * 4, activation_bytes_per_token=1)
    devices = [Device("a", 20, 100), Device("slow", 100, 1), Device("c", 20, 100)]
    result = plan(model, devices, PlanOptions(context_length=0, default_link=FREE))
    spans = [(s.device, s.first_layer, s.last_layer_exclusive) for s in result.stages]
    assert spans == [("a", 0, 2), ("c", 2, 4)]


def test_first_stage_holds_at_least_min_prefix_blocks():
    model = ModelCost([LayerCost(10, 0, 1e9)] * 4, activation_bytes_per_token=1)
    devices = [Device("fast-small", 10, 100), Device("slow-big", 100, 10)]
    spans = {}
    for min_prefix in (0, 1, 2, 4):
        options = PlanOptions(context_length=0, min_prefix=min_prefix, default_link=FREE)
        spans[min_prefix] = [(s.device, s.last_layer_exclusive) for s in plan(model, devices, options).stages]
    assert spans[0] == spans[1] == [("fast-small", 1), ("slow-big", 4)]
    assert spans[2] == spans[4] == [("slow-big", 4)]


def test_throughput_balances_uneven_moe_blocks_by_flops():
    flops = [1e9] * 6 + [6e9]  # the last block is a heavy MoE block
    model = ModelCost([LayerCost(1, 0, f) for f in flops], activation_bytes_per_token=1)
    devices = [Device("a", 100, 1), Device("b", 100, 1)]
    result = plan(model, devices, PlanOptions(context_length=0, objective="throughput", default_link=FREE))
    assert [s.last_layer_exclusive for s in result.stages] == [6, 7]
    assert result.objective_value == pytest.approx(6.0)


def test_kv_cache_and_extras_count_against_the_budget():
    model = ModelCost(
        [LayerCost(100, 10, 1e9)] * 2, activation_bytes_per_token=1, start_bytes=7, end_bytes=9
    )
    needed = 2 * (100 + 10 * 50) + 7 + 9 + 3
    devices = [Device("only", needed, 1, overhead_bytes=3)]
    assert plan(model, devices, PlanOptions(context_length=50)).stages[0].memory_bytes == needed
    with pytest.raises(PlanInfeasible, match="overflows a device by 20 B "):
        plan(model, devices, PlanOptions(context_length=51))


def test_infeasible_says_how_much_memory_is_missing_and_what_to_do():
    model = ModelCost([LayerCost(10 * GIB, 0, 1e9)] * 3, activation_bytes_per_token=1)
    devices = [Device("a", 12 * GIB, 1), Device("b", 12 * GIB, 1)]
    with pytest.raises(ValueError) as caught:
        plan(model, devices, PlanOptions(context_length=0))
    message = str(caught.value)
    assert isinstance(caught.value, PlanInfeasible)
    for part in ("by 8.00 GiB", "needs 30.00 GiB", "offer 24.00 GiB", "add devices", "--mem-fraction"):
        assert part in message


def test_plans_80_blocks_on_16_devices_within_100_ms():
    rng = random.Random(7)
    model = ModelCost(
        [LayerCost(GIB, 2**17, 2e9 * rng.choice([1, 1, 4])) for _ in range(80)],
        activation_bytes_per_token=16384,
        start_bytes=GIB,
        end_bytes=GIB,
        end_flops_per_token=2e9,
    )
    devices = [Device(f"d{k}", 1000 * GIB, rng.uniform(10, 200), GIB) for k in range(16)]
    for objective in ("latency", "throughput"):
        options = PlanOptions(context_length=4096, objective=objective)
        runs = []
        for _ in range(5):
            start = time.perf_counter()
            plan(model, devices, options)
            runs.append(time.perf_counter() - start)
        assert min(runs) < 0.1, (objective, runs)


def small_plan():
    model = ModelCost([LayerCost(3 * GIB, 0, 1e9)] * 4, activation_bytes_per_token=8192, end_bytes=GIB)
    devices = [Device("laptop", 8 * GIB, 50, GIB), Device("desktop", 16 * GIB, 20, GIB)]
    return plan(model, devices, PlanOptions(context_length=0, objective="throughput"))


def test_json_round_trip():
    result = small_plan()
    text = result.to_json()
    assert json.loads(text)["stages"][0]["device"] == "laptop"
    assert Plan.from_json(text) == result


def test_table_shows_devices_layers_memory_and_time():
    result = small_plan()
    lines = result.table().splitlines()
    assert lines[0].split() == ["device", "layers", "memory", "used", "/", "budget", "ms/token"]
    assert lines[1].split()[:2] == ["laptop", "0-1"] and "7.00 GiB / 8.00 GiB" in lines[1]
    assert lines[2].split()[:2] == ["desktop", "2-3"] and "8.00 GiB / 16.00 GiB" in lines[2]
    assert lines[3].startswith("throughput: ") and "slowest stage" in lines[3]


@pytest.mark.parametrize(
    "options, devices, words",
    [
        (PlanOptions(0, objective="speed"), None, "objective 'speed'"),
        (PlanOptions(0, pipeline_order=["a", "z"]), None, "pipeline_order"),
        (PlanOptions(0, pipeline_order=["a", "a"]), None, "pipeline_order"),
        (PlanOptions(0, min_prefix=3), None, "min_prefix"),
        (PlanOptions(-1), None, "context_length"),
        (PlanOptions(0), [Device("a", 10, 0.0)], "gflops"),
        (PlanOptions(0, default_link=Link(0.0, 0.0)), None, "bandwidth"),
    ],
)
def test_rejects_options_that_cannot_work(options, devices, words):
    model = ModelCost([LayerCost(1, 0, 1.0)] * 2, activation_bytes_per_token=1)
    with pytest.raises(InvalidOption, match=words):
        plan(model, devices or [Device("a", 10, 1.0), Device("b", 10, 1.0)], options)


def evaluate_streamed(model, devices, options, spans):
    """(stage times, streamed bytes, fits) from scratch, a stage that does not fit in memory laid
    out by the streaming engine's own rule (choose_resident with STREAM_DEPTH + 1 reading units in flight,
    a block's unit at most STREAM_UNIT_BYTES), the last stage's head streamed too where that alone fits."""
    times, streamed, fits = [], [], True
    for k, (device, first, end) in enumerate(spans):
        sizes = [b.weight_bytes for b in model.layers[first:end]]
        fixed = device.overhead_bytes + sum(b.kv_bytes_per_token * options.context_length for b in model.layers[first:end])
        fixed += (model.start_bytes if k == 0 else 0) + (model.end_bytes if k == len(spans) - 1 else 0)
        budget, in_flight = device.memory_budget_bytes - fixed, (STREAM_DEPTH + 1) * min(max(sizes), STREAM_UNIT_BYTES)
        head = model.head_bytes if k == len(spans) - 1 and sum(sizes) > budget and in_flight > budget else 0
        budget += head
        if sum(sizes) <= budget and not head:
            read = 0
        elif device.disk_bytes_per_s > 0 and in_flight <= budget:
            read = sum(sizes) - sum(sizes[i] for i in choose_resident(sizes, budget, in_flight)) + head
        else:
            fits = False
            read = 0
        single, _ = evaluate(model, [device], options, [(device, first, end)])
        hop = 0.0
        if k + 1 < len(spans):
            link = options.links.get((device.name, spans[k + 1][0].name), options.default_link)
            hop = link.latency_s + model.activation_bytes_per_token / link.bandwidth_bytes_per_s
        flops = sum(b.flops_per_token for b in model.layers[first:end]) + (
            model.end_flops_per_token if k == len(spans) - 1 else 0)
        times.append(flops / (device.gflops * 1e9) + hop + (read / device.disk_bytes_per_s if read else 0.0))
        streamed.append(read)
    return times, streamed, fits


def test_streams_only_when_nothing_fits_and_matches_brute_force():
    """Random small instances with disks: in memory when any split fits, else the best streamed split."""
    rng = random.Random(11)
    outcomes = {"in memory": 0, "streamed": 0, "infeasible": 0}
    for _ in range(400):
        model, devices, options = random_instance(rng)
        largest, total = max(b.weight_bytes for b in model.layers), sum(b.weight_bytes for b in model.layers)
        devices = [Device(d.name, 2 * largest + d.overhead_bytes + rng.randint(0, total // 4 + 20), d.gflops, d.overhead_bytes,
                          rng.choice([0.0, rng.uniform(1, 100), rng.uniform(1, 100)]))
                   for d in devices]   # about two blocks and up: many cases must stream
        options.objective = rng.choice(["latency", "throughput"])
        best_memory, best_streamed = math.inf, math.inf
        for spans in every_split(model, devices, options):
            times, streamed, fits = evaluate_streamed(model, devices, options, spans)
            value = sum(times) if options.objective == "latency" else max(times)
            if fits and not any(streamed):
                best_memory = min(best_memory, value)
            elif fits:
                best_streamed = min(best_streamed, value)
        if best_memory == best_streamed == math.inf:
            with pytest.raises(PlanInfeasible):
                plan(model, devices, options)
            outcomes["infeasible"] += 1
            continue
        result = plan(model, devices, options)
        spans = planned_spans(result, devices)
        times, streamed, fits = evaluate_streamed(model, devices, options, spans)
        assert fits and all(s.memory_bytes <= s.budget_bytes for s in result.stages)
        assert [s.streamed_bytes_per_token for s in result.stages] == streamed
        assert [s.predicted_seconds_per_token for s in result.stages] == pytest.approx(times, rel=1e-9)
        expected = best_memory if best_memory < math.inf else best_streamed
        assert result.objective_value == pytest.approx(expected, rel=1e-9)
        outcomes["in memory" if best_memory < math.inf else "streamed"] += 1
    assert min(outcomes.values()) > 20, outcomes   # seeded: every case is exercised


def streamed_case():
    """Five 2 GiB blocks and a 1 GiB head on two devices with 5 GiB free: 11 GiB fit nowhere in memory."""
    model = ModelCost([LayerCost(2 * GIB, 0, 1e9)] * 5, activation_bytes_per_token=8192, end_bytes=GIB)
    devices = [Device("a", 6 * GIB, 50, GIB, disk_bytes_per_s=2 * GIB), Device("b", 6 * GIB, 50, GIB, disk_bytes_per_s=GIB)]
    return model, devices


def test_a_split_that_fits_only_streamed():
    model, devices = streamed_case()
    result = plan(model, devices, PlanOptions(context_length=0, default_link=FREE))
    # in memory a holds 2 blocks and b 2 blocks and the head: one block too many. Either streams 3 blocks with
    # 2 pieces in flight, keeping 2 blocks resident beside them (b would keep only one); a's disk is the faster.
    stages = [(s.device, s.first_layer, s.last_layer_exclusive, s.streamed_bytes_per_token) for s in result.stages]
    assert stages == [("a", 0, 3, 2 * GIB), ("b", 3, 5, 0)]
    assert result.stages[0].read_seconds_per_token == pytest.approx(1.0)
    assert result.stages[0].predicted_seconds_per_token == pytest.approx(1.0 + 3e9 / 50e9)
    assert result.stages[0].stream_budget_bytes == 5 * GIB
    assert result.stages[0].memory_bytes == 5 * GIB + 2 * STREAM_UNIT_BYTES   # overhead, 2 blocks, 2 pieces
    table = result.table().splitlines()
    assert "streamed from disk/token" in table[0]
    assert table[1].endswith("2.00 GiB (1,000 ms)") and table[2].endswith("no (in memory)")
    assert Plan.from_json(result.to_json()) == result


def test_no_streaming_refuses_with_a_clear_message():
    model, devices = streamed_case()
    with pytest.raises(PlanInfeasible) as caught:
        plan(model, devices, PlanOptions(context_length=0, streaming=False))
    assert str(caught.value).endswith(
        "or use compression, or drop --no-streaming so that agents may stream blocks from their disk.")
    small = [Device(d.name, 2 * GIB, 50, GIB, disk_bytes_per_s=GIB) for d in devices]   # the head alone fills 1 GiB free
    with pytest.raises(PlanInfeasible, match="Streaming blocks from disk does not help: .* 2 pieces of blocks in flight"):
        plan(model, small, PlanOptions(context_length=0))


def test_a_last_stage_that_cannot_hold_its_head_streams_it():
    """The case above whose 1 GiB head can be read every token (a big plainly stored matrix): the last stage
    streams it beside its blocks, and what it reads a token counts the head."""
    model, devices = streamed_case()
    model.head_bytes = GIB
    small = [Device(d.name, 2 * GIB, 50, GIB, disk_bytes_per_s=GIB) for d in devices]
    last = plan(model, small, PlanOptions(context_length=0, default_link=FREE)).stages[-1]
    assert last.last_layer_exclusive == 5
    assert last.streamed_bytes_per_token == GIB + 2 * GIB * (5 - last.first_layer)   # the head, and no block resident
    assert last.memory_bytes <= last.budget_bytes
    no_disk = [Device(d.name, 6 * GIB, 50, GIB) for d in devices]
    with pytest.raises(PlanInfeasible, match="no device reported a disk read speed"):
        plan(model, no_disk, PlanOptions(context_length=0))


def test_a_streamed_last_stage_that_keeps_its_head_is_given_it_in_its_budget():
    """The engine places a big head out of the resident budget it is given, so the budget the plan hands a
    streamed last stage that keeps its head holds the head as well as the blocks' share."""
    model, _ = streamed_case()
    model.head_bytes = GIB
    devices = [Device("a", 6 * GIB, 50, GIB, disk_bytes_per_s=GIB // 8), Device("b", 6 * GIB, 50, GIB, disk_bytes_per_s=2 * GIB)]
    last = plan(model, devices, PlanOptions(context_length=0, default_link=FREE)).stages[-1]
    assert (last.first_layer, last.last_layer_exclusive, last.streamed_bytes_per_token) == (2, 5, 4 * GIB)
    assert last.stream_budget_bytes == 4 * GIB + GIB   # 5 GiB free less the head, for blocks; and the head


def evaluate_experts(model, devices, options, spans):
    """(stage times, largest overflow) from scratch for blocks whose experts are read on demand: each stage also
    holds its blocks' largest expert buffers, once, and reads their routed experts at its disk's speed (an
    assumed one where none was measured)."""
    times, _ = evaluate(model, devices, options, spans)
    overflow = -math.inf
    for k, (device, first, end) in enumerate(spans):
        blocks = model.layers[first:end]
        memory = device.overhead_bytes + max(b.expert_reading_bytes for b in blocks) + sum(
            b.weight_bytes + b.kv_bytes_per_token * options.context_length for b in blocks)
        memory += (model.start_bytes if k == 0 else 0) + (model.end_bytes if k == len(spans) - 1 else 0)
        overflow = max(overflow, memory - device.memory_budget_bytes)
        speed = device.disk_bytes_per_s or UNMEASURED_DISK_BYTES_PER_S
        times[k] += sum(b.expert_bytes_per_token for b in blocks) / speed
    return times, overflow


def test_experts_read_on_demand_match_brute_force():
    """Random small instances with on-demand blocks (some without experts) and disks (some unmeasured): the
    best split in memory, with each stage's expert buffers and expert reads."""
    rng = random.Random(5)
    outcomes = {"feasible": 0, "infeasible": 0, "several stages": 0}
    for _ in range(400):
        model, devices, options = random_instance(rng)
        model.layers = [replace(b, expert_reading_bytes=rng.choice([0, rng.randint(1, 30)]),
                                expert_bytes_per_token=rng.choice([0, rng.randint(1, 10**6)])) for b in model.layers]
        devices = [replace(d, memory_budget_bytes=d.memory_budget_bytes + 30,
                           disk_bytes_per_s=rng.choice([0.0, 1e6, 1e8])) for d in devices]
        options.objective, options.streaming = rng.choice(["latency", "throughput"]), False
        best, least_overflow = math.inf, math.inf
        for spans in every_split(model, devices, options):
            times, overflow = evaluate_experts(model, devices, options, spans)
            least_overflow = min(least_overflow, overflow)
            if overflow <= 0:
                best = min(best, sum(times) if options.objective == "latency" else max(times))
        if least_overflow > 0:
            with pytest.raises(PlanInfeasible, match=f"overflows a device by {format_bytes(least_overflow)} "):
                plan(model, devices, options)
            outcomes["infeasible"] += 1
            continue
        result = plan(model, devices, options)
        spans = planned_spans(result, devices)
        times, overflow = evaluate_experts(model, devices, options, spans)
        assert overflow <= 0 and all(s.memory_bytes <= s.budget_bytes for s in result.stages)
        assert [s.predicted_seconds_per_token for s in result.stages] == pytest.approx(times, rel=1e-9)
        assert [s.expert_bytes_per_token for s in result.stages] == [
            sum(b.expert_bytes_per_token for b in model.layers[first:end]) for _, first, end in spans]
        assert result.objective_value == pytest.approx(best, rel=1e-9)
        outcomes["feasible"] += 1
        outcomes["several stages"] += len(result.stages) > 1
    assert min(outcomes.values()) > 40, outcomes   # seeded: every case is exercised


def moe_case():
    """Four blocks of 1 GiB held, each with 2 GiB of expert buffers and 1 GiB of experts read a token."""
    return ModelCost([LayerCost(GIB, 0, 1e9, expert_reading_bytes=2 * GIB, expert_bytes_per_token=GIB)] * 4,
                     activation_bytes_per_token=8192)


def test_a_stage_holds_its_expert_buffers_once_and_prefers_the_faster_disk():
    """All four blocks and one set of buffers (6 GiB) fit either device: the one with the faster disk takes
    them, its time the compute and 4 GiB read; the table shows what its experts read."""
    devices = [Device("slow-disk", 7 * GIB, 50, GIB, disk_bytes_per_s=GIB), Device("fast-disk", 7 * GIB, 50, GIB,
                                                                                 disk_bytes_per_s=4 * GIB)]
    result = plan(moe_case(), devices, PlanOptions(context_length=0, default_link=FREE))
    [stage] = result.stages
    assert (stage.device, stage.first_layer, stage.last_layer_exclusive) == ("fast-disk", 0, 4)
    assert (stage.memory_bytes, stage.streamed_bytes_per_token, stage.expert_bytes_per_token) == (7 * GIB, 0, 4 * GIB)
    assert stage.read_seconds_per_token == pytest.approx(1.0)
    assert stage.predicted_seconds_per_token == pytest.approx(1.0 + 4e9 / 50e9)
    table = result.table().splitlines()
    assert "experts read/token" in table[0] and "streamed from disk/token" not in table[0]
    assert table[1].endswith("4.00 GiB (1,000 ms)")
    assert Plan.from_json(result.to_json()) == result


def test_a_streamed_stage_keeps_its_expert_buffers_out_of_its_budget_and_pays_both_reads():
    """5 GiB free: the buffers and two pieces in flight leave room for two blocks resident; the other two are
    read a token with the four blocks' experts, at 1 GiB/s."""
    devices = [Device("only", 6 * GIB, 50, GIB, disk_bytes_per_s=GIB)]
    [stage] = plan(moe_case(), devices, PlanOptions(context_length=0)).stages
    assert (stage.streamed_bytes_per_token, stage.expert_bytes_per_token) == (2 * GIB, 4 * GIB)
    assert stage.stream_budget_bytes == 3 * GIB   # 5 GiB free less the expert buffers
    assert stage.memory_bytes == GIB + 2 * GIB + 2 * GIB + 2 * STREAM_UNIT_BYTES
    assert stage.read_seconds_per_token == pytest.approx(6.0)
    table = Plan("latency", 0.0, [stage]).table().splitlines()
    assert re.split(r"\s{2,}", table[1])[-2:] == ["2.00 GiB (2,000 ms)", "4.00 GiB (4,000 ms)"]
