"""How every `shardstream` command's help reads: click's usage line and no type column for flags.

Typer writes usage as `{source} {out}` and gives every switch a `<bool>` column; our commands use
these classes (`cls=Command`) so `--help` reads `Usage: shardstream convert [OPTIONS] SOURCE OUT`
and a switch is just its name. Policy for switches: each is one plain flag that changes the default
(`--sequential`, `--no-progress`), never a `--x/--no-x` pair.
"""

from __future__ import annotations

from typing import Any

from typer import Context
from typer.core import TyperCommand, TyperGroup

# typer bundles its own click; parameters are told apart by `param_type_name`, not by class.
Param = Any


def _usage(param: Param) -> str:
    name = param.name.upper() + ("..." if param.nargs != 1 else "")
    return name if param.required else f"[{name}]"


def _hide_flag_types(params: list[Param]) -> list[Param]:
    for param in params:
        if param.param_type_name == "option" and param.is_flag and param.metavar is None:
            param.metavar = ""   # typer shows the metavar, when set, instead of `<bool>`
    return params


class Command(TyperCommand):
    def collect_usage_pieces(self, ctx: Context) -> list[str]:
        arguments = [_usage(p) for p in self.get_params(ctx) if p.param_type_name == "argument"]
        return [self.options_metavar, *arguments] if self.options_metavar else arguments

    def get_params(self, ctx: Context) -> list[Param]:
        return _hide_flag_types(super().get_params(ctx))


class Group(TyperGroup):
    def get_params(self, ctx: Context) -> list[Param]:
        return _hide_flag_types(super().get_params(ctx))
