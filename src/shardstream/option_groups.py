"""Option groups: flags that several commands take, declared once as the fields of a frozen dataclass.

typer reads a command's options from its signature, one parameter each, so a flag shared by several
commands would be listed in each of them. A group is a frozen dataclass whose fields carry the typer
declaration (`Annotated[str, typer.Option(...)] = "auto"`); `with_groups` shows typer the command with
the group's fields in place of one parameter, and calls it with the group's value built from them.
Flag names, help texts, defaults, envvars and parse-time callbacks are the fields' own.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable, Mapping
from copy import copy
from dataclasses import dataclass, field
from typing import Annotated, Any, TypeVar

from typer.models import ParameterInfo

Command = TypeVar("Command", bound=Callable[..., Any])


@dataclass(frozen=True)
class Part:
    """A group as one command takes it: the fields named in `only` (every field when empty) but those in
    `leave_out`, some of them told with the help text in `help` (field name -> text) instead of their own.
    A field left out keeps its default in the value."""

    group: type
    only: tuple[str, ...] = ()
    leave_out: tuple[str, ...] = ()
    help: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        every = {f.name for f in dataclasses.fields(self.group)}
        unknown = sorted({*self.only, *self.leave_out, *self.help} - every)
        if unknown:
            raise TypeError(f"{self.group.__name__} has no field {', '.join(unknown)}.")
        untaken = sorted(set(self.help) - set(self.names))
        if untaken:
            raise TypeError(f"help is given for {', '.join(untaken)}, which this part of "
                            f"{self.group.__name__} does not take.")

    @property
    def names(self) -> tuple[str, ...]:
        """The fields taken, in the group's order."""
        return tuple(f.name for f in dataclasses.fields(self.group)
                     if (not self.only or f.name in self.only) and f.name not in self.leave_out)

    def parameters(self) -> list[inspect.Parameter]:
        """The taken fields as keyword parameters typer reads: their declared annotation (evaluated: typer
        needs the objects) and default."""
        hints = typing.get_type_hints(self.group, include_extras=True)
        fields = {f.name: f for f in dataclasses.fields(self.group)}
        return [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=_default(fields[name]),
                                  annotation=_retold(hints[name], self.help[name]) if name in self.help else hints[name])
                for name in self.names]


def with_groups(**groups: type | Part) -> Callable[[Command], Command]:
    """Decorate a command whose parameters named here each take a group's value (the group, or a `Part` of
    it): typer sees the group's fields as the command's options, where that parameter stands, and the
    command is called with the value. Called directly, the decorated command takes the fields one by one
    too, as typer passes them."""
    parts = {name: group if isinstance(group, Part) else Part(group) for name, group in groups.items()}

    def decorate(command: Command) -> Command:
        shown = _signature(command, parts)

        @functools.wraps(command)
        def run(*args, **kwargs):
            given = shown.bind(*args, **kwargs)
            given.apply_defaults()
            values = dict(given.arguments)
            for name, part in parts.items():
                values[name] = part.group(**{field_name: values.pop(field_name) for field_name in part.names})
            return command(**values)

        run.__signature__ = shown   # what typer reads, and the type hints it asks for
        run.__annotations__ = {p.name: p.annotation for p in shown.parameters.values() if p.annotation is not p.empty}
        return typing.cast(Command, run)

    return decorate


def _signature(command: Callable, parts: dict[str, Part]) -> inspect.Signature:
    """`command`'s signature with each grouped parameter replaced by its fields, its annotations evaluated:
    typer takes a `__signature__` as it is, and a module with `from __future__ import annotations` holds
    them as strings. The parameters from the first group on are keyword-only, so that defaults may come in
    any order."""
    signature = inspect.signature(command, eval_str=True)
    missing = sorted(set(parts) - set(signature.parameters))
    if missing:
        raise TypeError(f"{command.__name__} has no parameter {', '.join(missing)} to take a group.")
    parameters: list[inspect.Parameter] = []
    keyword_only = False
    for parameter in signature.parameters.values():
        if parameter.name in parts:
            parameters += parts[parameter.name].parameters()
            keyword_only = True
        else:
            parameters.append(parameter.replace(kind=inspect.Parameter.KEYWORD_ONLY) if keyword_only else parameter)
    return signature.replace(parameters=parameters)


def _default(declared: dataclasses.Field) -> Any:
    if declared.default is not dataclasses.MISSING:
        return declared.default
    if declared.default_factory is not dataclasses.MISSING:
        return declared.default_factory()
    return inspect.Parameter.empty


def _retold(annotation: Any, text: str) -> Any:
    """`annotation` (an `Annotated` typer declaration) with its help text replaced by `text`."""
    if typing.get_origin(annotation) is not Annotated:
        raise TypeError(f"{annotation!r} declares no typer option whose help could be replaced.")
    base, *metadata = typing.get_args(annotation)
    return Annotated[(base, *(_with_help(item, text) for item in metadata))]


def _with_help(item: Any, text: str) -> Any:
    if not isinstance(item, ParameterInfo):
        return item
    told = copy(item)
    told.help = text
    return told
