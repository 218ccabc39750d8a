"""Tensor-parallel rank loads, verification speed, and MoE experts on demand, in one run.

Run: `.venv/bin/python benchmarks/shard.py` (about 2-4 minutes on 2 cores; the first run also builds
and caches the checkpoints and stores under artifacts/bench/shard-*; later runs reuse them).

1. TP: one rank's slices (`load_tp`) versus the whole part (`Store.load(verify=True)`) over every part
   of a random-init Llama (~375 MB fp32), for tp = 2, 4, 8, warm and cold page cache.
2. Verification: `verify_store` (xxh3-128) over the whole store, warm and cold, next to the raw
   xxh3-128 speed on an in-memory buffer and a plain read of the same files (the two physical limits).
3. MoE: greedy decoding of a random-init Mixtral (experts ~80% of the bytes, half of them on a
   second tier) with experts on demand vs with the block, pure streaming, vs all resident, vs
   transformers' own in-memory model; the streamed tokens are asserted equal to transformers' greedy ones.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _measure import MB, cpu_model, evict, markdown_table  # noqa: E402

from shardstream.shard import Expert  # noqa: E402
from shardstream.convert import convert  # noqa: E402
from shardstream.store import verify_sharding  # noqa: E402
from shardstream.shard import export_tp, load_index, load_tp, place_experts  # noqa: E402
from shardstream.store import open_store  # noqa: E402
from shardstream.store.verify import verify_store  # noqa: E402
from shardstream.stream import StreamingModel  # noqa: E402

TPS = (2, 4, 8)
REPEATS = 3


def best_of(action, repeats: int = REPEATS) -> float:
    """Fastest of `repeats` runs, in seconds (warm: the first run also warms the page cache)."""
    action()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        action()
        times.append(time.perf_counter() - started)
    return min(times)


def cold(action, *paths: Path) -> float:
    """One run after dropping `paths` from the page cache."""
    for path in paths:
        evict(path)
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def ms(seconds: float) -> str:
    return f"{1000 * seconds:,.1f}"


def gbs(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.2f}"


# -- models ----------------------------------------------------------------------------------------

def save_random(config_kwargs: dict, folder: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    if (folder / "config.json").exists():
        return
    settings = dict(config_kwargs)
    config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder, max_shard_size="200MB")


LLAMA = dict(model_type="llama", hidden_size=1024, intermediate_size=2816, num_hidden_layers=6,
             num_attention_heads=16, num_key_value_heads=8, vocab_size=8192, max_position_embeddings=512,
             tie_word_embeddings=False)
MIXTRAL = dict(model_type="mixtral", hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
               num_attention_heads=8, num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2,
               vocab_size=8192, max_position_embeddings=256, tie_word_embeddings=False,
               bos_token_id=1, eos_token_id=2)


def tp_store(work: Path) -> tuple[object, str]:
    """The Llama store with slices for every tp in TPS; (store, note on what was built now)."""
    src, root = work / "shard-src", work / "shard-store"
    save_random(LLAMA, src)
    notes = []
    if not (root / "manifest.json").exists():
        started = time.perf_counter()
        convert(src, root, progress=False)
        notes.append(f"convert {time.perf_counter() - started:.1f} s")
    store = open_store(root)
    have = {s.count for s in load_index(store).slices}
    for size in TPS:
        if size not in have:
            started = time.perf_counter()
            export_tp(store, size)
            notes.append(f"export_tp --tp {size} {time.perf_counter() - started:.1f} s")
    return store, "; ".join(notes) or "store and slices reused from an earlier run"


def moe_store(work: Path):
    src, root, cold_tier = work / "shard-moe-src", work / "shard-moe-store", work / "shard-moe-cold"
    save_random(MIXTRAL, src)
    if not (root / "manifest.json").exists():
        convert(src, root, progress=False)
    store = open_store(root)
    if any(r.expert is not None for r in store.manifest.tensors.values()):   # not yet stored apart
        layers, experts = MIXTRAL["num_hidden_layers"], MIXTRAL["num_local_experts"]
        placement = {(layer, e): ("cold" if e >= experts // 2 else "hot") for layer in range(layers) for e in range(experts)}
        place_experts(store, {"hot": ".", "cold": str(cold_tier.resolve())}, placement=placement)
    return src, store, cold_tier


# -- 1. TP ------------------------------------------------------------------------------------------

def bench_tp(store) -> str:
    index = load_index(store)
    root = Path(store.root)
    parts = store.parts
    whole_bytes = sum(store.manifest.files[f].size for p in parts for f in store.manifest.parts[p].files)

    def whole():
        for part in parts:
            store.load(part, verify=True)

    warm_whole, cold_whole = best_of(whole), cold(whole, root)
    rows = [["1 (whole part, `Store.load(verify=True)`)", f"{whole_bytes / MB:,.0f}", "1.00", ms(warm_whole),
             ms(cold_whole), "1.0x", gbs(whole_bytes, warm_whole), "1.0x", gbs(whole_bytes, cold_whole)]]
    for size in TPS:
        files = {s.file for s in index.slices if s.rank == 0 and s.count == size}
        rank_bytes = sum(index.files[f].size for f in files)

        def rank0(size=size):
            for part in parts:
                load_tp(store, part, 0, size)

        warm, cold_s = best_of(rank0), cold(rank0, root)
        rows.append([f"{size} (rank 0, `load_tp`)", f"{rank_bytes / MB:,.0f}", f"{whole_bytes / rank_bytes:.2f}",
                     ms(warm), ms(cold_s), f"{warm_whole / warm:.1f}x", gbs(rank_bytes, warm),
                     f"{cold_whole / cold_s:.1f}x", gbs(rank_bytes, cold_s)])
    return markdown_table(
        ["tp", "MB read", "whole / rank bytes", "warm ms", "cold ms", "warm speedup", "warm GB/s",
         "cold speedup", "cold GB/s"], rows)


# -- 2. verification --------------------------------------------------------------------------------

def read_all(paths: list[Path]) -> int:
    buffer = bytearray(8 * 1024 * 1024)
    total = 0
    for path in paths:
        with open(path, "rb", buffering=0) as handle:
            while n := handle.readinto(buffer):
                total += n
    return total


def bench_verify(store) -> str:
    root = Path(store.root)
    files = [root / name for name in sorted(store.manifest.files)]
    nbytes = sum(f.stat().st_size for f in files)
    index = load_index(store)
    slice_paths = [root / name for name in sorted({s.file for s in index.slices})]
    slice_bytes = sum(f.stat().st_size for f in slice_paths)

    def verify():
        hashed, problems = verify_store(root)
        assert hashed == nbytes and not problems, problems

    def verify_slices():
        assert not verify_sharding(store)[1]

    buffer = bytearray(files[max(range(len(files)), key=lambda i: files[i].stat().st_size)].read_bytes())
    rows = []
    hash_s = best_of(lambda: xxhash.xxh3_128_hexdigest(buffer))
    rows.append(["xxh3_128 of an in-memory buffer (hash limit)", f"{len(buffer) / MB:,.0f}", gbs(len(buffer), hash_s), "-"])
    warm_read = best_of(lambda: read_all(files))
    rows.append(["plain read, 8 MiB `readinto` (read limit)", f"{nbytes / MB:,.0f}", gbs(nbytes, warm_read),
                 gbs(nbytes, cold(lambda: read_all(files), *files))])
    warm = best_of(verify)
    rows.append(["`verify_store` (read + xxh3_128, whole store)", f"{nbytes / MB:,.0f}", gbs(nbytes, warm),
                 gbs(nbytes, cold(verify, *files))])
    warm = best_of(verify_slices, 1)
    rows.append([f"`verify_sharding` (TP slices, tp={'+'.join(map(str, TPS))})", f"{slice_bytes / MB:,.0f}",
                 gbs(slice_bytes, warm), gbs(slice_bytes, cold(verify_slices, *slice_paths))])
    return markdown_table(["what", "MB", "warm GB/s", "cold GB/s"], rows)


# -- 3. MoE decoding --------------------------------------------------------------------------------

class Counter:
    """Expert bytes read: every expert read (`Expert.raw` with its block, `Expert.read_into` on demand),
    by either mode (experts are stored apart)."""

    def __init__(self, store):
        index = load_index(store)
        self.expert_total = sum(r.length for r in index.experts.values())
        self.bytes = 0
        self.files = 0
        for method in ("raw", "read_into"):
            real = getattr(Expert, method)

            def counting(expert, *args, real=real, **kwargs):
                self.bytes += expert.nbytes
                self.files += 1
                return real(expert, *args, **kwargs)

            setattr(Expert, method, counting)


def greedy(model, ids: torch.Tensor, steps: int, counter: Counter | None) -> tuple[torch.Tensor, float, int]:
    """Prefill, then `steps` single-token decode steps; (new tokens, decode seconds, expert bytes in decode)."""
    with torch.no_grad():
        out = model(ids, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        tokens = [token]
        before = counter.bytes if counter else 0
        started = time.perf_counter()
        for _ in range(steps):
            out = model(token, past_key_values=out.past_key_values, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
            tokens.append(token)
        seconds = time.perf_counter() - started
    return torch.cat(tokens, 1), seconds, (counter.bytes - before) if counter else 0


def bench_moe(work: Path, prompt_len: int, steps: int) -> tuple[str, str, list[str]]:
    from transformers import AutoModelForCausalLM

    src, store, cold_tier = moe_store(work)
    counter = Counter(store)
    reference = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    ids = torch.randint(3, MIXTRAL["vocab_size"], (1, prompt_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = reference.generate(ids, max_new_tokens=steps + 1, do_sample=False)[:, prompt_len:]
    layers = MIXTRAL["num_hidden_layers"]
    expert_bytes = counter.expert_total / (layers * MIXTRAL["num_local_experts"])
    rows, mismatches = [], []

    tokens, seconds, _ = greedy(reference, ids, steps, None)
    rows.append(["transformers, whole model in memory (upper bound)", f"{steps / seconds:.1f}", "0.0", "-", "yes" if torch.equal(tokens, want) else "NO"])
    settings = [("`experts=\"on_demand\"`, `max_resident_memory=0`", "on_demand", 0),
                ("`experts=\"with_block\"`, `max_resident_memory=0`", "with_block", 0),
                ("`experts=\"with_block\"`, `max_resident_memory=\"auto\"` (all resident)", "with_block", "auto"),
                ("`experts=\"on_demand\"`, `max_resident_memory=\"auto\"`", "on_demand", "auto")]
    for label, experts, budget in settings:
        with StreamingModel(store, experts=experts, max_resident_memory=budget) as model:
            tokens, seconds, nbytes = greedy(model, ids, steps, counter)
            same = torch.equal(tokens, want)
            if experts == "on_demand" and budget == 0:
                generated = model.generate(ids, max_new_tokens=steps + 1, do_sample=False)[:, prompt_len:]
                same = same and torch.equal(generated, want)
            if not same:
                mismatches.append(label)
            per_token = nbytes / steps
            rows.append([label, f"{steps / seconds:.1f}", f"{per_token / MB:,.1f}",
                         f"{per_token / expert_bytes / layers:.2f}", "yes" if same else "NO"])
    rows[0][3] = "0.00"
    table = markdown_table(["setting", "decode tok/s", "expert MB read / token", "experts read / layer / token",
                            "tokens == transformers greedy"], rows)
    sizes = (f"Mixtral h{MIXTRAL['hidden_size']} i{MIXTRAL['intermediate_size']} x{MIXTRAL['num_local_experts']} "
             f"experts top-{MIXTRAL['num_experts_per_tok']}, {layers} layers, vocab {MIXTRAL['vocab_size']}, fp32: "
             f"store {(sum(r.size for r in store.manifest.files.values()) + counter.expert_total) / MB:,.0f} MB "
             f"(one expert {expert_bytes / MB:.1f} MB, experts {counter.expert_total / MB:,.0f} MB, stored apart), "
             f"experts 0-3 on tier hot (in the store), 4-7 on tier cold ({cold_tier.name}/)")
    return table, sizes, mismatches


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", default="artifacts/bench")
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--steps", type=int, default=24)
    args = parser.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(2)
    started = time.perf_counter()

    store, built = tp_store(work)
    store_mb = sum(r.size for r in store.manifest.files.values()) / MB
    llama = (f"Llama h{LLAMA['hidden_size']} i{LLAMA['intermediate_size']} {LLAMA['num_hidden_layers']} layers "
             f"vocab {LLAMA['vocab_size']} fp32, store {store_mb:,.0f} MB in {len(store.parts)} parts")
    machine = f"{cpu_model()}, {torch.get_num_threads()} threads, torch {torch.__version__}"

    print(f"### Tensor-parallel rank load vs whole part\n\n{machine}; {llama} ({built}). "
          "Each row loads every part of the store: the whole part (checksummed) for tp 1, rank 0's slices "
          "(`load_tp`, checksummed) otherwise. MB read = bytes of the files read; warm = best of "
          f"{REPEATS} with the files in the page cache; cold = one run after `posix_fadvise(DONTNEED)` on the "
          "store; speedup = whole-part time / rank time.\n")
    print(bench_tp(store) + "\n", flush=True)

    print(f"### Verification speed\n\n{machine}; {llama}. GB/s = bytes / wall time; warm = best of {REPEATS} "
          "with the files in the page cache, cold = one run after `posix_fadvise(DONTNEED)`. The first two rows "
          "are the physical limits: hashing memory that is already there, and reading the files without hashing.\n")
    print(bench_verify(store) + "\n", flush=True)

    table, sizes, mismatches = bench_moe(work, args.prompt, args.steps)
    print(f"### MoE decoding: experts on demand vs with the block vs resident\n\n{machine}; {sizes}. "
          f"Greedy decoding, batch 1, prompt {args.prompt} tokens, then {args.steps} decode steps timed (prefill "
          "excluded), page cache warm. Expert MB read / token = expert bytes read from the store during "
          "decoding (expert files: on_demand reads the routed ones, with_block all of each streamed block's) / "
          "steps; experts read / layer / token = that in units of one expert per layer (top-2 routing: at most 2; "
          "with_block: all 8). Last column: the tokens equal transformers' own `generate(do_sample=False)`.\n")
    print(table + "\n")
    print(f"total wall time {time.perf_counter() - started:.0f} s")
    assert not mismatches, f"streamed tokens differ from transformers' greedy tokens: {mismatches}"


if __name__ == "__main__":
    main()
