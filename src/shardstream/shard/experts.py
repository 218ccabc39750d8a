"""MoE experts as files of their own, placed on storage tiers, moved between them crash-safely.

An expert lives at `<tier root>/experts/tier_<t>/group_<g>/expert_<e>.safetensors`, the group being
its layer. Tier roots may be other disks (absolute) or folders inside the store (relative; only
those are reachable over HTTP). `--tiers` lists them fastest first; an expert's `hint` is its
tier's position there (0 = fastest), so a runtime can keep low-hint experts resident. Expert files
keep the store's encoding (quantized stays quantized).

Placing stores the experts apart: each one is written to its tier and recorded in the index, then
each MoE block's `mid/<l>` part is rewritten without them (a new file, recorded in the manifest,
then the old file removed), so every expert is stored once, on its tier. A kill at any point leaves
a store that loads; re-running `shard --experts` finishes the job.

Relocation runs copy -> verify -> index -> remove. The index names the live copy and is replaced
atomically, so a kill between (or inside) steps leaves either the old placement with a stray new
copy, or the new placement with a stray old copy; re-running `relocate` finishes either way.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from ..errors import InvalidOption
from ..naming import Part
from ..atomic import discard_temp_files
from ..store.manifest import FileRecord, PartRecord, TensorRecord
from ..store.partfile import encode_stored
from ..store.lock import editing
from ..store.reader import Store
from ..store.sharding import Expert, ExpertRecord, ShardIndex, expert_record, load_index, tier_root
from ..store.writer import write_encoded
from .tiers import check_tier, copy_verified, define_tiers


def parse_expert_key(text: str) -> tuple[int, int]:
    """`12:7` -> (layer 12, expert 7)."""
    match = re.fullmatch(r"(\d+):(\d+)", text.strip())
    if match is None:
        raise InvalidOption(f"--expert {text!r} is not valid; write <layer>:<expert>, e.g. 12:7.")
    return int(match[1]), int(match[2])


WITHOUT_EXPERTS = "weights-without-experts.safetensors"


def expert_file(tier: str, group: int, expert: int) -> str:
    return f"experts/tier_{tier}/group_{group}/expert_{expert}.safetensors"


@editing
def place_experts(store: Store, tiers: dict[str, str], placement: dict[tuple[int, int], str] | None = None) -> dict[str, ExpertRecord]:
    """Store every expert apart on its tier (`placement[(layer, expert)]`, else where it already
    is, else the first tier), then drop the experts from their blocks' parts; re-running finishes
    an interrupted run and rewrites the same files; a store without experts is refused, unchanged."""
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
        stale = [_place(store, index, layer, expert, names, (placement or {}).get((layer, expert)), first_tier, buffers)
                 for (group, expert), names in sorted(groups.items()) if group == layer]
        index.save(store)   # the tier files are the experts' record before the part loses them
        for path in filter(None, stale):
            path.unlink(missing_ok=True)
        _drop_experts_from_part(store, layer, buffers)
    index.save(store)
    return index.experts


def _place(store: Store, index: ShardIndex, layer: int, expert: int, names: list[str], wanted: str | None,
           default: str, buffers: "_FileBuffers") -> Path | None:
    """Write one expert's file on its tier (`wanted`, else where it is, else `default`) and record
    it in `index`; return the file it replaces, if any."""
    key = f"{layer}:{expert}"
    old = index.experts.get(key)
    if old is not None:   # its tier file is the copy to keep (the part's may already be gone)
        data = Expert(store, index, old).contents(verify=True)
        stored = {n: (data, r) for n, r in old.tensors.items()}
    else:
        manifest = store.manifest
        stored = {n: (buffers.get(manifest.tensors[n].file), asdict(manifest.tensors[n])) for n in names}
    tier = wanted or getattr(old, "tier", None) or default
    encoded = encode_stored(stored)
    file = expert_file(tier, layer, expert)
    digest = write_encoded(tier_root(store, index, tier) / file, encoded)
    index.files[file] = FileRecord(size=encoded.size, xxh3_128=digest)
    index.experts[key] = ExpertRecord(tier=tier, group=layer, expert=expert, file=file,
                                      hint=index.tiers[tier]["hint"], tensors=encoded.records)
    if old is None or old.file == file:
        return None
    index.files.pop(old.file, None)
    return tier_root(store, index, old.tier) / old.file


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
    """Move one expert to `tier`: copy, verify, switch the index, remove the old copy.

    `on_step(name)` is called after each of RELOCATION_STEPS (progress, and the crash tests)."""
    index = load_index(store, for_update=True)
    _check_expert_key(store, index, layer, expert)
    record = expert_record(store, index, layer, expert)
    check_tier(store, index, tier)
    if record.tier != tier:
        new_file = expert_file(tier, layer, expert)
        copy_verified([(tier_root(store, index, record.tier) / record.file, tier_root(store, index, tier) / new_file,
                        index.files[record.file])], on_step)
        index.files[new_file] = index.files.pop(record.file)
        record.tier, record.file, record.hint = tier, new_file, index.tiers[tier]["hint"]
        index.save(store)
        on_step("index")
    for other in index.tiers:
        if other != tier:
            stale = tier_root(store, index, other) / expert_file(other, layer, expert)
            stale.unlink(missing_ok=True)
            if stale.parent.is_dir():
                discard_temp_files(stale.parent)
    discard_temp_files((tier_root(store, index, tier) / record.file).parent)
    on_step("remove")
    return record
