"""A Hugging Face Hub repo, downloaded one file at a time through huggingface_hub.

Shards land in the staging folder (`hf_hub_download(local_dir=...)`), never in the shared HF cache,
so releasing a shard frees its disk at once. The Hub address comes from huggingface_hub itself
(`HF_ENDPOINT`), which is also how the tests point it at a local server.
"""

from __future__ import annotations

import re
import socket
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import httpx2
from huggingface_hub import HfApi, HfFileMetadata, constants, get_hf_file_metadata, hf_hub_download, hf_hub_url
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
    SafetensorsParsingError,
)
from tqdm import tqdm

from shardstream.errors import SourceNotFound, SourceUnreachable
from shardstream.sources.remote import RemoteSource

SHA256 = re.compile(r"[0-9a-f]{64}")
PROBE_SECONDS = 5.0



def check_hub_reachable(what: str) -> None:
    """Fail at once, with one line, when offline mode is on or the Hub's port does not answer,
    instead of huggingface_hub's retries (tens of seconds of repeated warnings); `what` is being fetched."""
    endpoint = urlsplit(constants.ENDPOINT)
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        if constants.HF_HUB_OFFLINE:
            raise OSError("HF_HUB_OFFLINE is set")
        socket.create_connection((endpoint.hostname, port), timeout=PROBE_SECONDS).close()
    except OSError as exc:
        raise SourceUnreachable(
            f"could not reach the Hub at {constants.ENDPOINT} for {what} ({exc}); "
            "check your connection (and HF_ENDPOINT, HF_HUB_OFFLINE), then run again."
        ) from None


class _QuietBar(tqdm):
    """huggingface_hub builds its download bars from this class; it stays hidden."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs["disable"] = True
        super().__init__(*args, **kwargs)


class HubSource(RemoteSource):
    """`org/name` on the Hub at an optional revision, with an optional token for private repos."""

    def __init__(
        self,
        repo_id: str,
        staging_dir: Path,
        *,
        token: str | None = None,
        revision: str | None = None,
        progress: bool = True,
    ) -> None:
        super().__init__(f"hub {repo_id}" + (f"@{revision}" if revision else ""), staging_dir, progress)
        self.repo_id = repo_id
        self.revision = revision
        self.token = token
        self._probed = False

    def identity(self) -> tuple[str, dict]:
        with self._translated("config.json"):
            commit = self._metadata("config.json").commit_hash
        return f"hf://{self.repo_id}", {"revision": self.revision or "main", "commit": commit}

    def _published_sha256(self, name: str) -> str | None:
        """The Hub's ETag of an LFS file is its sha256 (a small git file's is a sha1: not used)."""
        with self._translated(name):
            etag = (self._metadata(name).etag or "").strip('"').lower()
        return etag if SHA256.fullmatch(etag) else None

    def _read_file(self, name: str) -> bytes | None:
        # a scratch folder outside the output: a failed first request leaves nothing there
        with tempfile.TemporaryDirectory() as scratch, self._translated(name):
            try:
                return Path(self._hf_download(name, Path(scratch))).read_bytes()
            except RemoteEntryNotFoundError:
                return None

    def _has_file(self, name: str) -> bool:
        with self._translated(name):
            try:
                self._metadata(name)
                return True
            except RemoteEntryNotFoundError:
                return False

    def _size(self, name: str) -> int | None:
        with self._translated(name):
            return self._metadata(name).size

    def _tensor_shapes(self, name: str) -> dict[str, list[int]] | None:
        """huggingface_hub reads just the header with a Range request."""
        api = HfApi(token=self.token)
        with self._translated(name):
            try:
                tensors = api.parse_safetensors_file_metadata(self.repo_id, name, revision=self.revision).tensors
                return {n: list(info.shape) for n, info in tensors.items()}
            except RemoteEntryNotFoundError:
                return None
            except SafetensorsParsingError as exc:
                raise self._corrupt(name, str(exc), "the repo's copy is damaged; report it to its owner.") from None

    def _download(self, name: str) -> Path:
        with self._translated(name):
            return Path(self._hf_download(name, self.staging_dir))

    def _hf_download(self, name: str, local_dir: Path) -> str:
        return hf_hub_download(
            self.repo_id, name, revision=self.revision, token=self.token, local_dir=local_dir,
            tqdm_class=None if self.progress and sys.stderr.isatty() else _QuietBar,
        )

    def _metadata(self, name: str) -> HfFileMetadata:
        url = hf_hub_url(self.repo_id, name, revision=self.revision)
        return get_hf_file_metadata(url, token=self.token)

    def _probe(self, name: str) -> None:
        if not self._probed:
            check_hub_reachable(f"{name} of {self.repo_id}")
        self._probed = True

    @contextmanager
    def _translated(self, name: str) -> Iterator[None]:
        """huggingface_hub's errors, re-raised as ours with a message that says what to do."""
        self._probe(name)
        try:
            yield
        except RemoteEntryNotFoundError:
            raise SourceNotFound(f"{name} is not in {self.description}; check the repo id and revision.") from None
        except RevisionNotFoundError:
            raise SourceNotFound(
                f"revision {self.revision} of {self.repo_id} does not exist on the Hub; check the revision name."
            ) from None
        except GatedRepoError:
            raise SourceNotFound(
                f"{self.repo_id} is gated on the Hub; accept its terms there and pass a token that has access."
            ) from None
        except RepositoryNotFoundError:
            raise SourceNotFound(
                f"{self.repo_id} is not on the Hub or is private; check the id, or pass a token that can read it."
            ) from None
        except (LocalEntryNotFoundError, OfflineModeIsEnabled, httpx2.TransportError):
            raise SourceUnreachable(
                f"could not reach the Hub at {constants.ENDPOINT} for {name} of {self.repo_id}; "
                "check your connection (and HF_ENDPOINT, HF_HUB_OFFLINE), then run again."
            ) from None
        except HfHubHTTPError as exc:
            raise SourceUnreachable(
                f"the Hub answered HTTP {exc.response.status_code} for {name} of {self.repo_id}; "
                "check the token and try again later."
            ) from None
