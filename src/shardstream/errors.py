"""Every error shardstream raises on purpose.

Each class is also a builtin exception, so callers can catch `ValueError` or `OSError` without
knowing ours. Messages are one sentence that names the file or field and says what to do; the CLI
prints them without a traceback.
"""


class ShardstreamError(Exception):
    """Base class: a user-facing problem with a message that says what to do."""


class SourceNotFound(ShardstreamError, FileNotFoundError):
    """The checkpoint source (folder, URL, Hub id) or one of its files does not exist."""


class SourceUnreachable(ShardstreamError, ConnectionError):
    """A remote source or peer could not be reached."""


class CorruptShard(ShardstreamError, ValueError):
    """A checkpoint shard is truncated, malformed or does not match its index."""


class UntrustedPath(ShardstreamError, ValueError):
    """An index or manifest names a file outside its folder (absolute path or '..')."""


class UnsupportedModel(ShardstreamError, ValueError):
    """The model's architecture or tensors cannot be handled."""


class ConfigMismatch(ShardstreamError, ValueError):
    """config.json has a field of the wrong type, or one its checkpoint's tensors contradict."""


class StoreCorrupt(ShardstreamError, ValueError):
    """A store file or the manifest fails its checksum or its header checks."""


class StoreIncomplete(ShardstreamError, FileNotFoundError):
    """The store lacks a manifest, a part or a file that the manifest names."""


class PartNotFound(ShardstreamError, LookupError):
    """A part name that the store does not have."""


class DiskSpaceError(ShardstreamError, OSError):
    """Not enough free disk space to finish the job."""


class InvalidOption(ShardstreamError, ValueError):
    """An option or argument with a value that cannot work."""


class TrackerCorrupt(ShardstreamError, ValueError):
    """The chunk tracker database or its exported state file is unreadable or malformed."""


class TrackerUnavailable(ShardstreamError, ConnectionError):
    """The chunk tracker's database server cannot be reached."""


class DatasetError(ShardstreamError, ValueError):
    """A training dataset cannot be read: missing files, unknown format or missing text field."""


class WorkerFailed(ShardstreamError, RuntimeError):
    """A training worker process exited with an error."""


class PlanInfeasible(ShardstreamError, ValueError):
    """No split of the model's blocks over the devices fits their memory budgets."""


class AuthenticationFailed(ShardstreamError, PermissionError):
    """A pipeline agent or coordinator refused the bearer token."""


class DraftMismatch(ShardstreamError, ValueError):
    """A speculative-decoding draft that cannot serve the target model (another tokenizer)."""


class OutputMismatch(ShardstreamError, ValueError):
    """An offline-batch output file that belongs to another prompts file (or is not one of ours)."""


class TrackerNotFound(ShardstreamError, FileNotFoundError):
    """A command that reads a tracker was pointed at one that does not exist (it is never created then)."""


class RankMismatch(ShardstreamError, ValueError):
    """Tensor-parallel ranks that did not open the same model (another store, other TP slices)."""


class AgentBusy(ShardstreamError, PermissionError):
    """A pipeline agent serves another coordinator, which still answers; it is taken only when told to."""


class StageGone(ShardstreamError, LookupError):
    """A pipeline agent no longer holds the stage a message was sent for (restarted, re-planned, taken over)."""


class PipelineUnavailable(ShardstreamError, ConnectionError):
    """The pipeline cannot answer now: its stages are being deployed, or were lost and cannot be re-deployed."""


class GroupLost(ShardstreamError, ConnectionError):
    """A tensor-parallel rank died or stopped answering (or torchrun stopped the group): the group cannot
    compute until torchrun starts it again."""


class InsufficientMemory(ShardstreamError, MemoryError):
    """The memory this process may use cannot hold what streaming needs at once (one piece of a block), so
    the kernel would kill it in the middle of a pass."""


class StoreBusy(ShardstreamError, BlockingIOError):
    """Another process is writing the store (converting, sharding or relocating into it) right now."""


class ServerStopping(ShardstreamError, ConnectionError):
    """`serve` was told to stop (Ctrl-C, SIGTERM) while a request was in flight: the request is answered with
    this (a 503) rather than waited for."""
