"""What `shardstream` says when Ctrl-C (or SIGTERM) stops a command: whether running it again continues.

Work whose rerun continues where it stopped (a conversion, an answers file, training) runs inside
`rerun_continues()`; an interrupt there is told so. Anything else (one prompt, a server) has nothing to
continue: its rerun starts over, and the interrupt says only that.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

CONTINUES = "interrupted; re-run the same command to continue where it stopped."
STARTS_OVER = "interrupted."

_continues = False


@contextlib.contextmanager
def rerun_continues() -> Iterator[None]:
    """Inside, an interrupt is told that a rerun continues; an interrupt leaves it so, for `message()`."""
    global _continues
    before, _continues = _continues, True
    yield   # no `finally`: the KeyboardInterrupt passing through keeps what it stopped
    _continues = before


def message() -> str:
    """The line to print when the command was interrupted."""
    return CONTINUES if _continues else STARTS_OVER
