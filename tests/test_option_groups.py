"""Option groups (option_groups.py): a group's fields are the flags of every command that takes it, parsed
into one value, with the fields' own help, defaults, envvars and parse-time checks. This module uses
`from __future__ import annotations`, as the commands do: the signature typer reads holds real objects."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Optional

import pytest
import typer
from typer.testing import CliRunner

from shardstream.option_groups import Part, with_groups
from shardstream.options import whole_number


@dataclass(frozen=True)
class Knobs:
    """A group as the commands declare theirs."""

    count: Annotated[int, typer.Option(help="How many.", callback=whole_number(1))] = 3
    name: Annotated[Optional[str], typer.Option(envvar="KNOBS_NAME", help="What it is called.")] = None
    loud: Annotated[bool, typer.Option("--loud", help="Say it loudly.")] = False
    tags: Annotated[Optional[list[str]], typer.Option("--tag", help="A tag; repeatable.")] = None


def _app(command) -> typer.Typer:
    app = typer.Typer(add_completion=False)
    app.command()(command)
    return app


def _run(command, *args: str, **env: str):
    return CliRunner().invoke(_app(command), list(args), env={"COLUMNS": "200", **env})


seen: list = []


@with_groups(knobs=Knobs)
def whole(path: str, knobs: Knobs = Knobs(), after: Annotated[int, typer.Option(help="Comes after.")] = 0) -> None:
    """Take every knob."""
    seen.append((path, knobs, after))


@with_groups(knobs=Part(Knobs, only=("count", "loud"), help={"count": "How many, told otherwise."}))
def partial(knobs: Knobs = Knobs()) -> None:
    """Take two knobs."""
    seen.append(knobs)


@pytest.fixture(autouse=True)
def _fresh():
    seen.clear()


def test_the_flags_are_parsed_into_the_groups_value():
    result = _run(whole, "p", "--count", "5", "--name", "x", "--loud", "--tag", "a", "--tag", "b", "--after", "2")
    assert result.exit_code == 0, result.output
    assert seen == [("p", Knobs(count=5, name="x", loud=True, tags=["a", "b"]), 2)]


def test_the_fields_defaults_and_envvars_apply():
    assert _run(whole, "p").exit_code == 0
    assert _run(whole, "p", KNOBS_NAME="from-env").exit_code == 0
    assert [value for _, value, _ in seen] == [Knobs(), Knobs(name="from-env")]


def test_a_fields_callback_refuses_at_parse_time():
    result = _run(whole, "p", "--count", "0")
    assert result.exit_code == 2 and seen == []
    assert "--count must be a whole number of at least 1, not 0." in result.output


def test_help_lists_the_fields_with_their_help_and_defaults():
    shown = _run(whole, "--help").output
    for text in ("--count", "How many.", "[default: 3]", "--name", "KNOBS_NAME", "--loud", "--tag", "--after"):
        assert text in shown, text
    assert shown.index("--count") < shown.index("--after"), "the fields stand where the group's parameter stood"


def test_a_part_takes_some_fields_and_may_retell_their_help():
    assert _run(partial, "--count", "2").exit_code == 0
    assert seen == [Knobs(count=2)]
    refused = _run(partial, "--name", "x")
    assert refused.exit_code == 2 and "No such option" in refused.output
    shown = _run(partial, "--help").output
    assert "How many, told otherwise." in shown and "--name" not in shown and "--tag" not in shown


def test_called_directly_the_command_takes_the_fields_one_by_one():
    whole("p", count=7, loud=True)
    partial()
    assert seen == [("p", Knobs(count=7, loud=True), 0), Knobs()]


def test_a_group_that_does_not_fit_the_command_is_refused_when_decorating():
    with pytest.raises(TypeError, match="Knobs has no field colour"):
        Part(Knobs, only=("colour",))
    with pytest.raises(TypeError, match="help is given for name"):
        Part(Knobs, only=("count",), help={"name": "x"})
    with pytest.raises(TypeError, match="has no parameter knobs"):
        with_groups(knobs=Knobs)(lambda other: None)
