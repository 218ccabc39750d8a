"""Options that several commands share, declared once so each means the same everywhere.

`convert`, `generate` and `serve` all turn a checkpoint into a store (the latter two when given a
checkpoint rather than a store), so they take the same conversion options under the same names;
README.md "Options shared by every command" lists them. `--token` is the pipeline's shared secret
(`agent`, `coordinator`); the Hub token is `--hf-token` in every command that downloads. `generate`
and `coordinator --generate` sample a prompt with the same sampling options. Each of these families is
an option group (option_groups.py): the flags are its fields, and a command takes it as one value.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Optional
from urllib.parse import urlsplit

import typer
from typer._click.exceptions import UsageError   # typer's bundled click (typer is pinned)

from .errors import InvalidOption
from .sizes import parse_size

COMPRESSIONS = ("none", "4bit", "8bit", "int4")

# --token: convert's Hub token under its older name, accepted there unlisted so that existing scripts keep working
OldHfToken = Annotated[Optional[str], typer.Option("--token", hidden=True)]
TpCache = Annotated[Optional[str], typer.Option(
    help="With --tensor-parallel: the folder each rank writes its shares to when the store has no "
         "`shard --tp N` export (default: STORE/tp).")]


def refuse_tp_cache(tp_cache: str | None) -> None:
    """--tp-cache without --tensor-parallel is a mistake, not an option to ignore."""
    if tp_cache is not None:
        raise InvalidOption("--tp-cache goes with --tensor-parallel; leave it out.")


def compression(text: str | None, name: str = "--compression") -> str | None:
    """A compression as convert() takes it: None for none (given as None or "none"), else its name in
    lower case; anything else is refused, naming the option `name`."""
    if text is None:
        return None
    if not isinstance(text, str) or text.lower() not in COMPRESSIONS:
        raise InvalidOption(f"{name} must be one of {', '.join(COMPRESSIONS)}, not {text!r}.")
    return None if text.lower() == "none" else text.lower()


def model_id(source: str) -> str:
    """The name a served model goes by when none is given: its folder's name (`./store2` and
    `/data/store2` are `store2`), a URL's last segment; a Hub id as it is."""
    from pathlib import Path

    trimmed = source.rstrip("/")
    if trimmed.startswith(("http://", "https://")):
        return trimmed.rsplit("/", 1)[-1]
    path = Path(trimmed).expanduser()
    return path.resolve().name if path.exists() or trimmed.startswith((".", "/", "~")) else trimmed


def model_names(given: list[str] | None, source: str) -> list[str]:
    """The model ids of `--model-name` (repeated, or comma lists), the first the one answers name; `source`'s
    model_id when none is given."""
    return [name.strip() for value in (given or [model_id(source)]) for name in value.split(",") if name.strip()]


# --experts as typed, and the EngineOptions value each stands for
EXPERT_OPTIONS = {"with-block": "with_block", "on-demand": "on_demand"}
DEVICE_PATTERN = r"cpu|cuda(:\d+)?"   # --device


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


def one_of(names: list[str]) -> Callable:
    """A text option that is one of `names`."""
    return _checked(lambda value: value in names, f"one of {', '.join(names)}")


def matching(pattern: str, accepted: str) -> Callable:
    """A text option matching the regular expression `pattern` whole."""
    return _checked(lambda value: re.fullmatch(pattern, value) is not None, accepted)


def texts(param: typer.CallbackParam, value: list[str] | None) -> list[str] | None:
    """A repeatable text option, none of its values empty."""
    if value and not all(value):
        raise UsageError(f"{param.opts[0]} must be a non-empty text, not ''.")
    return value


def http_urls(param: typer.CallbackParam, value: str | None) -> str | None:
    """An option of http(s) URLs, comma-separated: each with a host and a port that is a number up to 65535."""
    for url in filter(None, (part.strip() for part in (value or "").split(","))):
        try:
            parts = urlsplit(url)
            ok = parts.scheme in ("http", "https") and bool(parts.hostname) and (parts.port or 0) >= 0
        except ValueError:   # a port that is no number or past 65535, a broken [IPv6] host
            ok = False
        if not ok:
            raise UsageError(f"{param.opts[0]} must name http(s)://HOST:PORT URLs, and {url!r} is not one.")
    return value


def _checked(ok: Callable[[object], bool], accepted: str) -> Callable:
    def check(param: typer.CallbackParam, value):
        if value is not None and not ok(value):
            shown = repr(value) if isinstance(value, str) else value
            raise UsageError(f"{param.opts[0]} must be {accepted}, not {shown}.")
        return value

    return check


def _compression_option(param: typer.CallbackParam, value: str | None) -> str | None:
    """--compression as it is parsed: normalized, or refused naming the option, as any value out of an
    option's range."""
    try:
        return compression(value, param.opts[0])
    except InvalidOption as error:
        raise UsageError(str(error)) from None


# Option groups (option_groups.py): each flag is declared once, as a field of the group that the commands
# taking it share; a command takes the group as one parameter, typer sees its fields.

@dataclass(frozen=True)
class ConversionOptions:
    """How a checkpoint becomes a store: the store's folder, and the options of `shardstream convert` that
    `generate`, `serve` and `AutoModel.from_pretrained` take to convert a checkpoint they are given (a store
    is used as it is). One value, checked when made: `compression` is None for none ("none" is taken too).
    Its fields are also the commands' flags."""

    store_path: Annotated[Optional[str], typer.Option(
        "--store-path", help="When converting: the store folder to convert into (default: a folder in "
                             "~/.cache/shardstream or $SHARDSTREAM_CACHE).")] = None
    sequential: Annotated[bool, typer.Option(
        "--sequential", help="When converting: one shard at a time; deletes each source shard after use.")] = False
    compression: Annotated[Optional[str], typer.Option(
        help="When converting: store weights as none, 4bit (NF4), 8bit (blockwise) or int4 (4-bit integers, "
             "multiplied in the CPU's integer dot products: faster there, not bit-compatible with NF4).",
        callback=_compression_option)] = "none"
    revision: Annotated[Optional[str], typer.Option(
        help="When converting from the Hub: the branch, tag or commit.", show_default="the default branch")] = None
    hf_token: Annotated[Optional[str], typer.Option(
        "--hf-token", envvar="HF_TOKEN", show_envvar=True,
        help="When converting from the Hub: a token for private or gated repos.")] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "compression", compression(self.compression, "compression"))


def conversion_options(conversion: ConversionOptions | None, given: ConversionOptions) -> ConversionOptions:
    """`conversion`, or the options given one by one (`given`, the keywords' value); both are refused."""
    if conversion is None:
        return given
    if given != ConversionOptions():
        raise InvalidOption("give the conversion's options as `conversion` or one by one, not both.")
    return conversion


@dataclass(frozen=True)
class EngineFlags:
    """The streaming engine's flags as typed (`generate`; `serve` all but --profile; a pipeline agent only
    --compute-dtype), made into one EngineOptions by front/cli.py `command_options`."""

    max_resident_memory: Annotated[str, typer.Option(
        help="Bytes of blocks kept in memory: auto, 0 (pure streaming) or a size like 2GB.",
        callback=size(auto=True))] = "auto"
    device: Annotated[str, typer.Option(help="cpu, cuda or cuda:N.",
                                        callback=matching(DEVICE_PATTERN, "cpu, cuda or cuda:N"))] = "cpu"
    max_host_memory: Annotated[str, typer.Option(
        help="With --device cuda: bytes of streamed blocks kept page-locked in host RAM after their first read, "
             "so a token only copies them to the GPU: auto (half the RAM available), 0 (read them every token) "
             "or a size like 16GB.", callback=size(auto=True))] = "auto"
    compute_dtype: Annotated[str, typer.Option(
        help="Dtype the model computes in: auto (the checkpoint's where the device multiplies it fast, else "
             "float32; stderr says which and why), float32, bfloat16 or float16.",
        callback=one_of(["auto", "float32", "bfloat16", "float16"]))] = "auto"
    experts: Annotated[str, typer.Option(
        help="MoE experts: with-block (read with their block) or on-demand (only those the router picks; the "
             "store's experts placed apart first: `shardstream shard STORE --experts`).",
        callback=one_of(list(EXPERT_OPTIONS)))] = "with-block"
    max_expert_memory: Annotated[str, typer.Option(
        help="With --experts on-demand: bytes of experts kept in memory between passes: auto (3/4 of the memory "
             "left; where that holds every expert, all are read at load), 0 (read every routed expert on every "
             "pass) or a size like 1GB (read as routed, the most used kept).",
        callback=size(auto=True))] = "auto"
    profile: Annotated[bool, typer.Option(
        "--profile", help="Print per-block read/wait/compute times and tokens per target pass.")] = False


@dataclass(frozen=True)
class Sampling:
    """The sampling of a prompt given on the command line (`generate --prompt`, `coordinator --generate`);
    an API request gives its own."""

    max_new_tokens: Annotated[int, typer.Option(help="Tokens to generate (per prompt).",
                                                callback=whole_number(1))] = 50
    temperature: Annotated[float, typer.Option(help="0 = greedy; above 0 samples.", callback=real_number(0))] = 0.0
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass.", callback=real_number(0, 1, above=True))] = 1.0
    top_k: Annotated[int, typer.Option(help="Sample from the k most likely tokens; 0 = no limit.",
                                       callback=whole_number(0))] = 0
    seed: Annotated[Optional[int], typer.Option(help="Seed for sampling.",
                                                callback=whole_number(-2**63, 2**64 - 1))] = None
    stop: Annotated[Optional[list[str]], typer.Option(
        "--stop", help="End at this text, left out of the output; repeatable.", callback=texts)] = None

    def keywords(self) -> dict:
        """serving/text.py generate_one's sampling keywords."""
        return dict(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                    top_k=self.top_k, seed=self.seed, stops=list(self.stop or []))

    def request_defaults(self) -> dict:
        """The sampling of each line of a prompts file that does not give its own (serving/offline.py)."""
        return dict(max_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                    top_k=self.top_k, stop=list(self.stop or []))
