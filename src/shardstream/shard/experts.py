"""MoE experts as files of their own, placed on storage tiers, moved between them crash-safely.

An expert lives at `<tier root>/experts/tier_<t>/group_<g>/expert_<e>.safetensors`, the group being
its layer. Tier roots may be other disks (absolute) or folders inside the store (relative; only
those are reachable over HTTP). `--tiers` lists them fastest first; an expert's `hint` is its
tier's position there (0 = fastest), so a runtime can keep low-hint experts resident. The experts stay in their `mid/<l>` part too: the tiers are extra placement, not a move
of the converter's files. Stored unquantized (dequantized from a quantized store).

Relocation runs copy -> verify -> index -> remove. The index names the live copy and is replaced
atomically, so a kill between (or inside) steps leaves either the old placement with a stray new
copy, or the new placement with a stray old copy; re-running `relocate` finishes either way.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import cached_property
from pathlib import Path, PurePosixPath

import torch

from ..errors import InvalidOption, PartNotFound
from ..naming import Part
from ..atomic import discard_temp_files, write_bytes_atomic
from ..store.checksum import checksum_file
from ..store.manifest import FileRecord, check_relative
from ..store.partfile import encode_part, tensor_from_bytes
from ..store.reader import Store
from ..store.writer import write_encoded
from ..store.remote import RemoteStore
from ..store.verify import Problem
from .index import INDEX_NAME, ExpertRecord, ShardIndex, checked, load_index, read_path, read_store_file

RELOCATION_STEPS = ("copy", "verify", "index", "remove")


def parse_tiers(spec: str) -> dict[str, str]:
    """`hot=/nvme,warm=/ssd` -> {"hot": "/nvme", "warm": "/ssd"}, order kept (fastest first)."""
    tiers = {}
    for item in spec.split(","):
        name, sep, root = item.partition("=")
        if not sep or not re.fullmatch(r"[a-z0-9_]+", name) or not root or name in tiers:
            raise InvalidOption(f"--tiers entry {item!r} is not valid; write name=folder pairs like hot=/nvme,cold=/hdd.")
        tiers[name] = root
    return tiers


def parse_expert_key(text: str) -> tuple[int, int]:
    """`12:7` -> (layer 12, expert 7)."""
    match = re.fullmatch(r"(\d+):(\d+)", text.strip())
    if match is None:
        raise InvalidOption(f"--expert {text!r} is not valid; write <layer>:<expert>, e.g. 12:7.")
    return int(match[1]), int(match[2])


def expert_file(tier: str, group: int, expert: int) -> str:
    return f"experts/tier_{tier}/group_{group}/expert_{expert}.safetensors"


def tier_root(store: Store, index: ShardIndex, tier: str) -> Path:
    root = Path(index.tiers[tier]["root"])
    return root if root.is_absolute() else Path(store.root) / root


def place_experts(store: Store, tiers: dict[str, str], placement: dict[tuple[int, int], str] | None = None) -> dict[str, ExpertRecord]:
    """Write every expert to its tier (`placement[(layer, expert)]`, else where it already is, else
    the first tier) and record it; re-running rewrites the same files."""
    index = load_index(store, for_update=True)
    for name, root in tiers.items():
        if not Path(root).is_absolute():
            check_relative(root, "--tiers")
        if index.tiers.get(name, {"root": root})["root"] != root:
            raise InvalidOption(
                f"tier {name!r} already has root {index.tiers[name]['root']} in {store.root}/{INDEX_NAME}; "
                "keep that root or relocate its experts first."
            )
    index.tiers.update({name: {"root": root, "hint": i} for i, (name, root) in enumerate(tiers.items())})
    groups: dict[tuple[int, int], list[str]] = {}
    for name, record in store.manifest.tensors.items():
        if record.expert is not None:
            groups.setdefault((Part.parse(record.part).index, record.expert), []).append(name)
    loaded: dict[str, dict[str, torch.Tensor]] = {}
    for (group, expert), names in sorted(groups.items()):
        part = f"mid/{group}"
        if part not in loaded:
            loaded = {part: store.load(part, verify=True)}
        key = f"{group}:{expert}"
        tier = (placement or {}).get((group, expert)) or getattr(index.experts.get(key), "tier", None) or next(iter(tiers))
        encoded = encode_part({n: loaded[part][n] for n in names}, None)
        file = expert_file(tier, group, expert)
        digest = write_encoded(tier_root(store, index, tier) / file, encoded)
        index.files[file] = FileRecord(size=encoded.size, xxh3_128=digest)
        index.experts[key] = ExpertRecord(tier=tier, group=group, expert=expert, file=file,
                                          hint=index.tiers[tier]["hint"], tensors=encoded.records)
    index.save(store.root)
    return index.experts


def relocate(store: Store, layer: int, expert: int, tier: str, on_step: Callable[[str], None] = lambda step: None) -> ExpertRecord:
    """Move one expert to `tier`: copy, verify, switch the index, remove the old copy.

    `on_step(name)` is called after each of RELOCATION_STEPS (progress, and the crash tests)."""
    index = load_index(store, for_update=True)
    record = _record(store, index, layer, expert)
    if tier not in index.tiers:
        raise InvalidOption(f"{store.root}/{INDEX_NAME} has no tier {tier!r} (it has {', '.join(index.tiers)}); pick one of those.")
    if record.tier != tier:
        file_record = index.files[record.file]
        data = checked(_read(store, index, record), file_record, str(tier_root(store, index, record.tier) / record.file))
        new_file = expert_file(tier, layer, expert)
        dest = tier_root(store, index, tier) / new_file
        write_bytes_atomic(dest, data)
        on_step("copy")
        if checksum_file(dest) != file_record.xxh3_128:
            raise OSError(f"{dest} reads back different from what was written; check that disk and re-run.")
        on_step("verify")
        index.files[new_file] = index.files.pop(record.file)
        record.tier, record.file, record.hint = tier, new_file, index.tiers[tier]["hint"]
        index.save(store.root)
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


class Expert:
    """One placed expert; its file is read and checksum-verified on first use of `tensors`."""

    def __init__(self, store: Store, index: ShardIndex, record: ExpertRecord):
        self.store, self.index, self.record = store, index, record

    @cached_property
    def tensors(self) -> dict[str, torch.Tensor]:
        data = _read(self.store, self.index, self.record)
        checked(data, self.index.files[self.record.file], self._where())
        return {n: tensor_from_bytes(data, r["offset"], r["dtype"], r["shape"]) for n, r in self.record.tensors.items()}

    def _where(self) -> str:
        return str(PurePosixPath(self.index.tiers[self.record.tier]["root"]) / self.record.file)


def load_expert(store: Store, layer: int, expert: int) -> Expert:
    index = load_index(store)
    return Expert(store, index, _record(store, index, layer, expert))


def verify_experts_and_slices(store: Store) -> list[Problem]:
    """Check every file the sharding index names (local stores), like `verify_store` for the manifest."""
    index = load_index(store)
    locations = {name: Path(store.root) / name for name in {s.file for s in index.slices}}
    locations.update({r.file: tier_root(store, index, r.tier) / r.file for r in index.experts.values()})
    problems = []
    for name, path in sorted(locations.items()):
        if not path.is_file():
            problems.append(Problem(str(path), "missing"))
        elif checksum_file(path) != index.files[name].xxh3_128:
            problems.append(Problem(str(path), "checksum mismatch"))
    return problems


def _record(store: Store, index: ShardIndex, layer: int, expert: int) -> ExpertRecord:
    try:
        return index.experts[f"{layer}:{expert}"]
    except KeyError:
        raise PartNotFound(
            f"{store.root}/{INDEX_NAME} places no expert {layer}:{expert}; run `shardstream shard {store.root} --experts` first."
        ) from None


def _read(store: Store, index: ShardIndex, record: ExpertRecord) -> bytearray:
    root = index.tiers[record.tier]["root"]
    if not Path(root).is_absolute():
        return read_store_file(store, str(PurePosixPath(root) / record.file))
    if isinstance(store, RemoteStore):
        raise InvalidOption(
            f"expert {record.group}:{record.expert} is on tier {record.tier!r} at {root}, outside the store; "
            "relocate it to a tier inside the store to serve it over HTTP."
        )
    return read_path(Path(root) / record.file)