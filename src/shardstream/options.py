"""Options that several commands share, declared once so each means the same everywhere.

`convert`, `generate` and `serve` all turn a checkpoint into a store (the latter two when given a
checkpoint rather than a store), so they take the same conversion options under the same names;
README.md "Options shared by every command" lists them. `--token` is the pipeline's shared secret
(`agent`, `coordinator`); the Hub token is `--hf-token` in every command that downloads. `generate`
and `coordinator --generate` sample a prompt with the same sampling options.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Annotated, Optional

import typer
from typer._click.exceptions import UsageError   # typer's bundled click (typer is pinned)

from .errors import InvalidOption
from .sizes import parse_size

COMPRESSIONS = ("none", "4bit", "8bit", "int4")

Compression = Annotated[str, typer.Option(
    help="When converting: store weights as none, 4bit (NF4), 8bit (blockwise) or int4 (4-bit integers, "
         "multiplied in the CPU's integer dot products: faster there, not bit-compatible with NF4).")]
Sequential = Annotated[bool, typer.Option(
    "--sequential", help="When converting: one shard at a time; deletes each source shard after use.")]
Revision = Annotated[Optional[str], typer.Option(
    help="When converting from the Hub: the branch, tag or commit.", show_default="the default branch")]
HfToken = Annotated[Optional[str], typer.Option(
    "--hf-token", envvar="HF_TOKEN", show_envvar=True,
    help="When converting from the Hub: a token for private or gated repos.")]
# --token: convert's Hub token under its older name, accepted there unlisted so that existing scripts keep working
OldHfToken = Annotated[Optional[str], typer.Option("--token", hidden=True)]
StorePath = Annotated[Optional[str], typer.Option(
    "--store-path", help="When converting: the store folder to convert into (default: a folder in "
                         "~/.cache/shardstream or $SHARDSTREAM_CACHE).")]
TpCache = Annotated[Optional[str], typer.Option(
    help="With --tensor-parallel: the folder each rank writes its shares to when the store has no "
         "`shard --tp N` export (default: STORE/tp).")]


def refuse_tp_cache(tp_cache: str | None) -> None:
    """--tp-cache without --tensor-parallel is a mistake, not an option to ignore."""
    if tp_cache is not None:
        raise InvalidOption("--tp-cache goes with --tensor-parallel; leave it out.")


def compression(text: str) -> str | None:
    """The --compression value as convert() takes it (None for none)."""
    value = text.lower()
    if value not in COMPRESSIONS:
        raise InvalidOption(f"--compression must be one of {', '.join(COMPRESSIONS)}, not {text!r}.")
    return None if value == "none" else value


def model_id(source: str) -> str:
    """The name a served model goes by when none is given: its folder's name (`./store2` and
    `/data/store2` are `store2`), a URL's last segment; a Hub id as it is."""
    from pathlib import Path

    trimmed = source.rstrip("/")
    if trimmed.startswith(("http://", "https://")):
        return trimmed.rsplit("/", 1)[-1]
    path = Path(trimmed).expanduser()
    return path.resolve().name if path.exists() or trimmed.startswith((".", "/", "~")) else trimmed


# Checks of option values, given to typer.Option as its `callback`: they run while the command line is
# parsed, before anything loads, and refuse a bad value in one sentence that names the option as typed
# and what it accepts (exit code 2, click's for a usage error).

def whole_number(low: int, high: int | None = None) -> Callable:
    """An integer option from `low` (to `high`)."""
    accepted = f"a whole number from {low} to {high}" if high is not None else f"a whole number of at least {low}"
    return _checked(lambda value: low <= value and (high is None or value <= high), accepted)


def real_number(low: float, high: float | None = None, *, above: bool = False) -> Callable:
    """A float option of at least `low` (above it, with `above`) and at most `high`; never nan or inf."""
    accepted = f"a finite number {'above' if above else 'of at least'} {low:g}" + (
        f" and at most {high:g}" if high is not None else "")
    return _checked(lambda value: math.isfinite(value) and (value > low if above else value >= low)
                    and (high is None or value <= high), accepted)


def size(*, auto: bool = False, zero: bool = True) -> Callable:
    """A size option ('2GB', '500MB'; `auto` too where that means something; 0 only where `zero`)."""
    def ok(value: str) -> bool:
        if auto and value == "auto":
            return True
        try:
            return parse_size(value, "") > 0 or zero
        except InvalidOption:
            return False

    accepted = "a size" + ("" if zero else " above 0") + " such as 500MB, 2GB or 2GiB" + (", or auto" if auto else "")
    return _checked(ok, accepted)


def _checked(ok: Callable[[object], bool], accepted: str) -> Callable:
    def check(param: typer.CallbackParam, value):
        if value is not None and not ok(value):
            shown = repr(value) if isinstance(value, str) else value
            raise UsageError(f"{param.opts[0]} must be {accepted}, not {shown}.")
        return value

    return check


# The sampling of a prompt given on the command line (`generate --prompt`, `coordinator --generate`);
# an API request gives its own.
MaxNewTokens = Annotated[int, typer.Option(help="Tokens to generate (per prompt).", callback=whole_number(1))]
Temperature = Annotated[float, typer.Option(help="0 = greedy; above 0 samples.", callback=real_number(0))]
TopP = Annotated[float, typer.Option(help="Nucleus sampling mass.", callback=real_number(0, 1, above=True))]
TopK = Annotated[int, typer.Option(help="Sample from the k most likely tokens; 0 = no limit.", callback=whole_number(0))]
Seed = Annotated[Optional[int], typer.Option(help="Seed for sampling.", callback=whole_number(-2**63, 2**64 - 1))]
Stop = Annotated[Optional[list[str]], typer.Option("--stop", help="End at this text, left out of the output; repeatable.")]
