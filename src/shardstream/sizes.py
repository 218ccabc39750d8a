"""Byte sizes as users type them ('1GB', '500M', '2GiB'): one parser shared by every command.

A module of its own so that the main CLI and the command modules it mounts both import it
without importing each other.
"""

from __future__ import annotations

from .errors import InvalidOption

SIZE_UNITS = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9,
              "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "T": 10**12, "TB": 10**12}


def parse_size(text: str, option: str) -> int:
    """'1GB', '500M', '2GiB' or a plain byte count; `option` names the flag in the error."""
    cleaned = text.strip().upper().replace(" ", "")
    number = cleaned.rstrip("KMGTIB")
    unit = cleaned[len(number):]
    try:
        size = int(float(number) * SIZE_UNITS[unit])
    except (ValueError, KeyError, OverflowError):   # OverflowError: "inf"
        size = -1
    if size < 0:
        raise InvalidOption(f"{option} takes a size such as 1GB, 500MB or 2GiB, not {text!r}.")
    return size


def format_size(nbytes: int) -> str:
    """For messages: GB where that reads as more than 0.00, else MB (else kB)."""
    if nbytes >= 10**9:
        return f"{nbytes / 1e9:.2f} GB"
    if nbytes >= 10**6:
        return f"{nbytes / 1e6:.1f} MB"
    return f"{nbytes / 1e3:.0f} kB"
