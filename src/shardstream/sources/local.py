"""A checkpoint already on disk: shards are used in place and deleted only when asked."""

from __future__ import annotations

from pathlib import Path

from shardstream.errors import InvalidOption, SourceNotFound
from shardstream.safetensors_header import HeaderError, read_header
from shardstream.sources.base import INDEX_FILE, METADATA_FILES, CheckpointSource

# Files a downloaded checkpoint folder carries besides its shards; delete_remaining removes these and
# nothing it does not recognise, so pointing at the wrong folder cannot wipe unrelated files.
CHECKPOINT_EXTRAS = (INDEX_FILE, *METADATA_FILES, "README.md", ".gitattributes")
REMEDY = "delete it and download the checkpoint again."


class LocalSource(CheckpointSource):
    """A Hugging Face checkpoint folder (sharded with an index, or a single model.safetensors)."""

    def __init__(self, root: Path) -> None:
        root = Path(root).expanduser()
        if not root.exists():
            raise SourceNotFound(f"{root} does not exist; give the folder that holds the checkpoint.")
        if not root.is_dir():
            raise InvalidOption(f"{root} is a file; give the checkpoint folder that holds it instead.")
        super().__init__(f"local folder {root}")
        self.root = root
        self.weight_map()  # fail now on a folder that is not a safetensors checkpoint

    def _read_file(self, name: str) -> bytes | None:
        path = self.root / name
        return path.read_bytes() if path.is_file() else None

    def _has_file(self, name: str) -> bool:
        return (self.root / name).is_file()

    def _tensor_shapes(self, name: str) -> dict[str, list[int]] | None:
        path = self.root / name
        if not path.is_file():
            return None
        try:
            return {n: list(e.shape) for n, e in read_header(path).tensors.items()}
        except HeaderError as exc:
            raise self._corrupt(name, str(exc), REMEDY) from None

    def _size(self, name: str) -> int | None:
        path = self.root / name
        return path.stat().st_size if path.is_file() else None  # None once released with delete=True

    def fetch(self, name: str) -> Path:
        self._check_known(name)
        path = self.root / name
        if not path.is_file():
            raise SourceNotFound(f"{path} is missing though the index lists it; download the checkpoint again.")
        self._validate(path, name, REMEDY)
        return path

    def identity(self) -> tuple[str, dict]:
        shards = {}
        for name in self.shard_names():
            path = self.root / name
            if path.is_file():
                stat = path.stat()
                shards[name] = [stat.st_size, stat.st_mtime_ns]
        return str(self.root.resolve()), {"shards": shards}

    def check_all(self) -> None:
        """Validate every shard still on disk before anything is deleted: a damaged last shard
        must not cost the user the ones a sequential run would have released before reaching it."""
        for name in self.shard_names():
            if (self.root / name).is_file():
                self.fetch(name)

    def release(self, name: str, delete: bool) -> None:
        self._check_known(name)
        if delete:
            (self.root / name).unlink(missing_ok=True)

    def delete_remaining(self) -> None:
        for name in CHECKPOINT_EXTRAS:
            (self.root / name).unlink(missing_ok=True)
        if not any(self.root.iterdir()):
            self.root.rmdir()
