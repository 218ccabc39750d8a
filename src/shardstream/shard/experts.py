"""MoE experts stored apart, in one container per tier and block, moved between tiers crash-safely.

A block's experts on one tier live in one container, `<tier root>/experts/tier_<t>/group_<g>.<n>.experts`
(the group is the block's layer, `n` the container's generation: every rewrite gets a new name). It
holds each expert's bytes as a safetensors file of its own would, one after another, each starting at
a multiple of direct_io.ALIGN, so that one read (O_DIRECT included) fetches one expert; the index
records each expert's offset, length and own checksum, and the container's size and checksum.
Stores sharded before containers (one `group_<g>/expert_<e>.safetensors` per expert) still load;
re-running `shard --experts`, or relocating one of a block's experts, repacks them.

Tier roots may be other disks (absolute) or folders inside the store (relative; only those are
reachable over HTTP). `--tiers` lists them fastest first; an expert's `hint` is its tier's position
there (0 = fastest), so a runtime can keep low-hint experts resident. Experts keep the store's
encoding (quantized stays quantized).

Placing stores the experts apart: a block's containers are written and recorded in the index, then
the block's `mid/<l>` part is rewritten without them (a new file, recorded in the manifest, then the
old file removed), so every expert is stored once, on its tier. A kill at any point leaves a store
that loads; re-running `shard --experts` finishes the job.

Relocating an expert runs copy -> verify -> index -> remove: the block's containers on the source and
destination tiers are written anew under new names (the source's without the expert, the
destination's with it), read back, then the index is switched to them atomically, then the old
containers are removed. A kill between (or inside) steps leaves the old index with its containers
(and stray new ones), or the new index with its containers (and stray old ones); the next run of
`relocate` or `shard --experts` removes the strays and finishes.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path, PurePosixPath

import xxhash

from ..errors import InvalidOption
from ..naming import Part
from ..atomic import discard_temp_files, write_chunks_atomic
from ..store.checksum import checksum_file
from ..store.direct_io import aligned
from ..store.manifest import FileRecord, PartRecord, TensorRecord
from ..store.partfile import EncodedPart, encode_stored
from ..store.lock import editing
from ..store.reader import Store
from ..store.sharding import Expert, ExpertRecord, ShardIndex, expert_record, load_index, tier_root
from ..store.writer import write_encoded
from .tiers import check_tier, define_tiers


def parse_expert_key(text: str) -> tuple[int, int]:
    """`12:7` -> (layer 12, expert 7)."""
    match = re.fullmatch(r"(\d+):(\d+)", text.strip())
    if match is None:
        raise InvalidOption(f"--expert {text!r} is not valid; write <layer>:<expert>, e.g. 12:7.")
    return int(match[1]), int(match[2])


WITHOUT_EXPERTS = "weights-without-experts.safetensors"
CONTAINER = re.compile(r"group_(\d+)\.(\d+)\.experts")

ExpertSource = Callable[[], EncodedPart]   # an expert's bytes as its container will hold them, made when written


def container_file(tier: str, group: int, generation: int) -> str:
    return f"experts/tier_{tier}/group_{group}.{generation}.experts"


def _generation(record: ExpertRecord) -> int:
    """The container's generation (0: a file of its own, as written before containers)."""
    match = CONTAINER.fullmatch(PurePosixPath(record.file).name)
    return int(match[2]) if match else 0


def write_container(path: Path, experts: dict[int, ExpertSource]) -> tuple[FileRecord, dict[int, tuple[int, int, str, dict]]]:
    """Write `experts` one after another, each at an ALIGN-aligned offset, to `path` (atomically, durably);
    returns the file's record and each expert's (offset, length, checksum, tensor records)."""
    whole, placed, end = xxhash.xxh3_128(), {}, [0]

    def chunks():
        for expert, source in experts.items():
            encoded, own = source(), xxhash.xxh3_128()
            for chunk in encoded.stream(own):
                whole.update(chunk)
                yield chunk
            placed[expert] = (end[0], encoded.size, own.hexdigest(), encoded.records)
            padding = bytes(aligned(end[0] + encoded.size) - end[0] - encoded.size)
            whole.update(padding)
            yield padding
            end[0] = aligned(end[0] + encoded.size)

    write_chunks_atomic(path, chunks())
    return FileRecord(size=end[0], xxh3_128=whole.hexdigest()), placed


def _check_written(written: list[tuple[Path, FileRecord]]) -> None:
    """Re-hash containers just written: a disk that returns other bytes is caught before the index names them."""
    for path, record in written:
        if checksum_file(path) != record.xxh3_128:
            raise OSError(f"{path} reads back different from what was written; check that disk and re-run.")


def _placed_source(store: Store, index: ShardIndex, record: ExpertRecord) -> ExpertSource:
    """An expert already stored apart: its bytes as they are, checksum-verified when read."""
    return lambda: EncodedPart([memoryview(Expert(store, index, record).contents(verify=True))], dict(record.tensors), 0.0)


def _part_source(store: Store, names: list[str], buffers: "_FileBuffers") -> ExpertSource:
    """An expert still inside its block's part: its tensors laid out as a file of their own."""
    tensors = store.manifest.tensors
    return lambda: encode_stored({n: (buffers.get(tensors[n].file), asdict(tensors[n])) for n in names})


def _pack_block(store: Store, index: ShardIndex, layer: int, tiers: dict[int, str],
                sources: dict[int, ExpertSource]) -> list[tuple[Path, FileRecord]]:
    """Write a new container for each tier whose experts of block `layer` change (`tiers[expert]` says where
    each goes), record them in `index` (not saved), and return what was written. A tier whose experts are
    already its one container's is left as it is."""
    current = {r.expert: r for r in index.experts.values() if r.group == layer}
    by_file: dict[str, set[int]] = {}
    for record in current.values():
        by_file.setdefault(record.file, set()).add(record.expert)
    written = []
    for tier in sorted(set(tiers.values())):
        members = sorted(e for e, t in tiers.items() if t == tier)
        now = [current.get(e) for e in members]
        if all(r is not None and r.tier == tier and _generation(r) for r in now) and by_file.get(now[0].file) == set(members):
            for record in now:   # kept as it is, but the tiers may have been listed in another order
                record.hint = index.tiers[tier]["hint"]
            continue
        generation = 1 + max((_generation(r) for r in current.values() if r.tier == tier), default=0)
        file = container_file(tier, layer, generation)
        path = tier_root(store, index, tier) / file
        record, placed = write_container(path, {e: sources[e] for e in members})
        index.files[file] = record
        for expert, (offset, length, digest, tensors) in placed.items():
            index.experts[f"{layer}:{expert}"] = ExpertRecord(
                tier=tier, group=layer, expert=expert, file=file, hint=index.tiers[tier]["hint"], tensors=tensors,
                offset=offset, length=length, xxh3_128=digest)
        written.append((path, record))
    named = {r.file for r in index.experts.values()}
    for old in {r.file for r in current.values()} - named:
        index.files.pop(old, None)
    return written


def _discard_unnamed(store: Store, index: ShardIndex, layer: int) -> None:
    """Remove block `layer`'s expert files the index does not name, on every tier: containers replaced, files
    of one expert each (before containers), what a killed run left."""
    for tier in index.tiers:
        folder = tier_root(store, index, tier) / f"experts/tier_{tier}"
        if not folder.is_dir():
            continue
        single = folder / f"group_{layer}"
        for path in [*folder.glob(f"group_{layer}.*.experts"), *single.glob("expert_*.safetensors")]:
            if path.relative_to(folder.parent.parent).as_posix() not in index.files:
                path.unlink()
        discard_temp_files(folder)
        if single.is_dir() and not any(single.iterdir()):
            single.rmdir()


@editing
def place_experts(store: Store, tiers: dict[str, str], placement: dict[tuple[int, int], str] | None = None) -> dict[str, ExpertRecord]:
    """Store every expert apart on its tier (`placement[(layer, expert)]`, else where it already
    is, else the first tier), then drop the experts from their blocks' parts; re-running finishes
    an interrupted run (a block whose containers already hold what they should is not rewritten);
    a store without experts is refused, unchanged."""
    index = load_index(store, for_update=True)
    groups: dict[tuple[int, int], list[str]] = {}
    for name, record in store.manifest.tensors.items():
        if record.expert is not None:
            groups.setdefault((Part.parse(record.part).index, record.expert), []).append(name)
    for key, record in index.experts.items():   # already stored apart by an earlier run
        groups.setdefault((record.group, record.expert), list(record.tensors))
    if not groups:
        raise InvalidOption(
            f"{store.root} holds no mixture-of-experts experts to place (model_type "
            f"{store.config.get('model_type')!r}, no tensor of one expert); leave out --experts."
        )
    define_tiers(store, index, tiers)
    first_tier = next(iter(tiers))
    buffers = _FileBuffers(store)
    for layer in sorted({group for group, _ in groups}):   # a layer at a time: its part is read once
        block = {expert: names for (group, expert), names in sorted(groups.items()) if group == layer}
        old = {e: index.experts.get(f"{layer}:{e}") for e in block}
        wanted = {e: (placement or {}).get((layer, e)) or getattr(old[e], "tier", None) or first_tier for e in block}
        sources = {e: _placed_source(store, index, old[e]) if old[e] else _part_source(store, names, buffers)
                   for e, names in block.items()}   # a placed expert's container is the copy to keep (the part's may be gone)
        _check_written(_pack_block(store, index, layer, wanted, sources))
        index.save(store)   # the containers are the experts' record before the part loses them
        _discard_unnamed(store, index, layer)
        _drop_experts_from_part(store, layer, buffers)
    index.save(store)
    return index.experts


class _FileBuffers:
    """Store files read (checksum-verified) once each, keeping only the latest part's."""

    def __init__(self, store: Store):
        self._store = store
        self._part = ""
        self._files: dict[str, bytearray] = {}

    def get(self, name: str) -> bytearray:
        part = name.rpartition("/")[0]
        if part != self._part:
            self._part, self._files = part, {}
        if name not in self._files:
            self._files[name] = self._store.read_file(name, verify=True)
        return self._files[name]


def _drop_experts_from_part(store: Store, layer: int, buffers: _FileBuffers) -> None:
    """Rewrite block `layer`'s part without its experts (now on their tiers): a new file, then the
    manifest, then the old files go (also those a killed run left behind)."""
    manifest = store.manifest
    part = f"mid/{layer}"
    record = manifest.parts[part]
    dense = [n for n in record.tensors if manifest.tensors[n].expert is None]
    if len(dense) < len(record.tensors):
        new_file = f"{part}/{WITHOUT_EXPERTS}"
        encoded = encode_stored({n: (buffers.get(manifest.tensors[n].file), asdict(manifest.tensors[n])) for n in dense})
        digest = write_encoded(store.file_path(new_file), encoded)
        for name in record.tensors:
            del manifest.tensors[name]
        for name in record.files:
            manifest.files.pop(name, None)
        manifest.files[new_file] = FileRecord(size=encoded.size, xxh3_128=digest)
        manifest.tensors.update({n: TensorRecord(part=part, file=new_file, **r) for n, r in encoded.records.items()})
        manifest.parts[part] = PartRecord(files=[new_file], tensors=sorted(dense), nbytes=encoded.size)
        manifest.save(store.root)
    folder = store.file_path(f"{part}/{WITHOUT_EXPERTS}").parent   # the part's folder, on its tier if relocated
    for leftover in folder.glob("*.safetensors"):
        if f"{part}/{leftover.name}" not in manifest.files:
            leftover.unlink()
    discard_temp_files(folder)


def _check_expert_key(store: Store, index: ShardIndex, layer: int, expert: int) -> None:
    """`--expert L:E` names a layer and an expert the store has (placed or not yet)."""
    layers = store.num_layers
    if not 0 <= layer < layers:
        raise InvalidOption(f"--expert {layer}:{expert}: the store at {store.root} has {layers} layers (0 to "
                            f"{layers - 1}), so no layer {layer}; name one of them.")
    experts = ({r.expert for r in store.manifest.tensors.values() if r.expert is not None}
               | {r.expert for r in index.experts.values()})
    if not experts:
        raise InvalidOption(f"--expert {layer}:{expert}: the store at {store.root} holds no mixture-of-experts experts "
                            f"(model_type {store.config.get('model_type')!r}); move whole parts with --part instead.")
    if expert not in experts:
        raise InvalidOption(f"--expert {layer}:{expert}: the store at {store.root} has {len(experts)} experts a layer "
                            f"(0 to {max(experts)}), so no expert {expert}; name one of them.")


@editing
def relocate(store: Store, layer: int, expert: int, tier: str, on_step: Callable[[str], None] = lambda step: None) -> ExpertRecord:
    """Move one expert to `tier`: new containers, verified, then the index switched, then the old ones removed.

    `on_step(name)` is called after each of RELOCATION_STEPS (progress, and the crash tests)."""
    index = load_index(store, for_update=True)
    _check_expert_key(store, index, layer, expert)
    record = expert_record(store, index, layer, expert)
    check_tier(store, index, tier)
    if record.tier != tier:
        block = {r.expert: r for r in index.experts.values() if r.group == layer}
        wanted = {e: tier if e == expert else r.tier for e, r in block.items()}
        written = _pack_block(store, index, layer, wanted, {e: _placed_source(store, index, r) for e, r in block.items()})
        on_step("copy")
        _check_written(written)
        on_step("verify")
        index.save(store)
        on_step("index")
    _discard_unnamed(store, index, layer)
    on_step("remove")
    return index.experts[f"{layer}:{expert}"]
