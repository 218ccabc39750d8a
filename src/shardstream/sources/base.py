"""What every checkpoint source shares: index parsing, shard-name checks, header validation.

A concrete source only says how to read a small file, whether a file exists, and how to list the
tensors of a single-file checkpoint; everything that must behave the same for a folder, a URL and
a Hub repo (untrusted index entries, strict headers, atomic metadata copies) lives here once.
"""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from pathlib import Path, PurePosixPath

from shardstream.atomic import write_bytes_atomic
from shardstream.errors import CorruptShard, SourceNotFound, UnsupportedModel, UntrustedPath
from shardstream.safetensors_header import HeaderError, read_header

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
PICKLE_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json")
METADATA_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "processor_config.json",
)


def same_source(recorded: dict | None, current: dict) -> bool:
    """Whether a recorded fingerprint still describes the source: same Hub commit, and every shard
    present in both with the same size and date (a shard deleted since, by a sequential run, is
    no difference). A store from before fingerprints (None) matches."""
    if recorded is None:
        return True
    if recorded.get("commit") != current.get("commit"):
        return False
    old, new = recorded.get("shards", {}), current.get("shards", {})
    return all(old[name] == new[name] for name in old.keys() & new.keys())


class CheckpointSource(ABC):
    """One checkpoint, handed out a shard at a time so peak disk stays at one shard."""

    description: str

    def __init__(self, description: str) -> None:
        self.description = description
        self._weight_map: dict[str, str] | None = None
        self._sizes: dict[str, int | None] = {}

    # What each kind of source provides.

    @abstractmethod
    def _read_file(self, name: str) -> bytes | None:
        """The bytes of a small file (config, index, tokenizer), or None if the source lacks it."""

    @abstractmethod
    def _has_file(self, name: str) -> bool:
        """Whether the source holds a file of that name."""

    @abstractmethod
    def _tensor_shapes(self, name: str) -> dict[str, list[int]] | None:
        """Tensor names and shapes in a safetensors file's header, read without its data; None if absent."""

    @abstractmethod
    def _size(self, name: str) -> int | None:
        """The shard's size in bytes if the source can tell without downloading it."""

    @abstractmethod
    def fetch(self, name: str) -> Path:
        """Make the shard available as a validated local file and return its path."""

    @abstractmethod
    def release(self, name: str, delete: bool) -> None:
        """Done with that shard: drop a downloaded copy, or the original if delete is set."""

    @abstractmethod
    def delete_remaining(self) -> None:
        """After all shards are released with delete=True, remove what is left of the original."""

    @abstractmethod
    def identity(self) -> tuple[str, dict]:
        """Where the checkpoint is (absolute path, URL, hf://id) and what tells a changed copy apart
        (shard sizes and dates, or the Hub commit): recorded in the manifest, checked on reuse."""

    # Shared behaviour.

    def config(self) -> dict:
        """The parsed config.json, which decides how tensors map to parts."""
        raw = self._read_file("config.json")
        if raw is None:
            raise SourceNotFound(
                f"{self.description} has no config.json; point at a Hugging Face checkpoint that includes it."
            )
        try:
            return json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise UnsupportedModel(
                f"config.json in {self.description} is not valid JSON ({exc}); download it again."
            ) from None

    def weight_map(self) -> dict[str, str]:
        """Tensor name -> shard file, from the index or the single file's header; shard names checked."""
        if self._weight_map is None:
            raw = self._read_file(INDEX_FILE)
            weight_map = self._parse_index(raw) if raw is not None else self._single_file_map()
            for shard in set(weight_map.values()):
                self._check_shard_name(shard)
            self._weight_map = weight_map
        return dict(self._weight_map)

    def tensor_shape(self, tensor: str) -> list[int] | None:
        """One tensor's shape, from its shard's header alone (a few KB, even for a remote shard)."""
        shard = self.weight_map().get(tensor)
        return None if shard is None else (self._tensor_shapes(shard) or {}).get(tensor)

    def shard_size(self, name: str) -> int | None:
        """Bytes, if known without downloading; asked once per shard, since planners ask often."""
        self._check_known(name)
        if name not in self._sizes:
            self._sizes[name] = self._size(name)
        return self._sizes[name]

    def shard_names(self) -> list[str]:
        """Each shard once, sorted, so every run processes them in the same order."""
        return sorted(set(self.weight_map().values()))

    def copy_metadata(self, dest: Path) -> list[str]:
        """Copy the config and tokenizer files that exist into dest, atomically; return their names."""
        dest = Path(dest)
        dest.mkdir(parents=True, exist_ok=True)
        copied = []
        for name in METADATA_FILES:
            data = self._read_file(name)
            if data is not None:
                write_bytes_atomic(dest / name, data)
                copied.append(name)
        return copied

    def _single_file_map(self) -> dict[str, str]:
        names = self._tensor_shapes(SINGLE_FILE)
        if names is not None:
            return dict.fromkeys(names, SINGLE_FILE)
        if any(self._has_file(name) for name in PICKLE_WEIGHTS):
            raise UnsupportedModel(
                f"{self.description} holds only PyTorch .bin weights; convert it to safetensors first "
                "(load it with transformers and save_pretrained it)."
            )
        raise SourceNotFound(
            f"{self.description} has neither {INDEX_FILE} nor {SINGLE_FILE}; point at a safetensors checkpoint."
        )

    def _parse_index(self, raw: bytes) -> dict[str, str]:
        try:
            weight_map = json.loads(raw)["weight_map"]
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CorruptShard(
                f"{INDEX_FILE} in {self.description} is not a valid index ({exc!r}); download it again."
            ) from None
        if not (isinstance(weight_map, dict) and all(isinstance(v, str) for v in weight_map.values())):
            raise CorruptShard(
                f"{INDEX_FILE} in {self.description} has a malformed weight_map; download it again."
            )
        return weight_map

    def _check_shard_name(self, name: str) -> None:
        """The index is untrusted input: a shard must be a plain relative path inside the checkpoint."""
        parts = PurePosixPath(name).parts
        if (
            not parts
            or name.startswith("/")
            or "\\" in name
            or ":" in parts[0]
            or any(part in ("..", ".") for part in parts)
            or not name.endswith(".safetensors")
        ):
            raise UntrustedPath(
                f"{INDEX_FILE} in {self.description} names shard {name!r}, which is not a .safetensors file "
                "inside the checkpoint; refusing it, check where this checkpoint came from."
            )

    def _check_known(self, name: str) -> None:
        if name not in self.shard_names():
            raise SourceNotFound(
                f"{name!r} is not a shard of {self.description}; use one of the names from shard_names()."
            )

    def _validate(self, path: Path, name: str, remedy: str) -> None:
        """Check the whole header, and that the shard holds every tensor the index puts in it."""
        try:
            header = read_header(path)
        except HeaderError as exc:
            raise self._corrupt(name, str(exc), remedy) from None
        missing = [t for t, shard in self.weight_map().items() if shard == name and t not in header.tensors]
        if missing:
            detail = f"it lacks {len(missing)} tensors its index lists, first {missing[0]}"
            raise self._corrupt(name, detail, remedy)

    def _check_sha256(self, path: Path, name: str, expected: str | None, remedy: str) -> None:
        """Compare the file with the sha256 its publisher gives, when one is given."""
        if not expected:
            return
        with open(path, "rb") as handle:
            actual = hashlib.file_digest(handle, "sha256").hexdigest()
        if actual != expected.lower():
            raise self._corrupt(name, f"its sha256 is {actual[:12]}..., the published one {expected[:12]}...", remedy)

    def _corrupt(self, name: str, detail: str, remedy: str) -> CorruptShard:
        return CorruptShard(f"shard {name} of {self.description} is corrupt ({detail}); {remedy}")
