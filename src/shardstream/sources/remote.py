"""What HTTP and Hub sources share: a staging folder that holds at most the shard in use."""

from __future__ import annotations

import os
from abc import abstractmethod
from pathlib import Path

from shardstream.errors import CorruptShard
from shardstream.sources.base import CheckpointSource


class RemoteSource(CheckpointSource):
    """Downloads each shard into the staging folder on fetch and deletes it on release."""

    def __init__(self, description: str, staging_dir: Path, progress: bool) -> None:
        super().__init__(description)
        self.staging_dir = Path(staging_dir)
        self.progress = progress

    @abstractmethod
    def _download(self, name: str) -> Path:
        """Download the shard and return the complete, not yet validated, file."""

    def _published_sha256(self, name: str) -> str | None:
        """The sha256 the publisher gives for the shard, if any; a download must match it."""
        return None

    def staged_path(self, name: str) -> Path:
        return self.staging_dir / name

    def fetch(self, name: str) -> Path:
        self._check_known(name)
        final = self.staged_path(name)
        if final.is_file():  # left by an interrupted run: reuse it if it checks out
            try:
                self._validate(final, name, "")
                self._check_sha256(final, name, self._published_sha256(name), "")
                return final
            except CorruptShard:
                final.unlink()
        final.parent.mkdir(parents=True, exist_ok=True)
        downloaded = self._download(name)
        remedy = "the download was deleted; run again to download it afresh."
        try:
            self._validate(downloaded, name, remedy)
            self._check_sha256(downloaded, name, self._published_sha256(name), remedy)
        except CorruptShard:
            downloaded.unlink(missing_ok=True)
            raise
        os.replace(downloaded, final)
        return final

    def release(self, name: str, delete: bool) -> None:
        """A downloaded copy is always deleted; the remote original is never touched."""
        self._check_known(name)
        self.staged_path(name).unlink(missing_ok=True)

    def delete_remaining(self) -> None:
        """Nothing to do: a remote checkpoint is never deleted."""
