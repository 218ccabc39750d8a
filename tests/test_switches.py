"""Every SHARDSTREAM_* environment variable is declared and read in switches.py, and documented."""

from __future__ import annotations

import re
from pathlib import Path

from shardstream import switches
from shardstream.switches import ALL, Switch

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "src" / "shardstream"


def test_no_module_but_switches_names_a_variable_in_code():
    """A quoted SHARDSTREAM_ name outside switches.py is a switch read or set past it (docstrings and help
    texts may still mention them)."""
    quoted = re.compile(r"""["']SHARDSTREAM_""")
    offenders = [f"{path.relative_to(ROOT)}:{number}" for path in SOURCE.rglob("*.py") if path.name != "switches.py"
                 for number, line in enumerate(path.read_text().splitlines(), 1) if quoted.search(line)]
    assert offenders == []


def test_every_switch_is_one_row_of_the_troubleshooting_table():
    text = (ROOT / "docs" / "TROUBLESHOOTING.md").read_text()
    for switch in ALL:
        default = f"`{switch.default}`" if switch.default else "unset"
        assert f"| `{switch.name}` | {default} | {switch.what} |" in text, switch.name
    mentioned = set(re.findall(r"SHARDSTREAM_[A-Z0-9_]+", "".join(p.read_text() for p in SOURCE.rglob("*.py"))))
    assert mentioned == {s.name for s in ALL}, "a variable mentioned in the code but not declared, or the reverse"
    assert len({s.name for s in ALL}) == len(ALL) == len([v for v in vars(switches).values() if isinstance(v, Switch)])


def test_an_empty_value_counts_as_unset_and_only_0_turns_a_switch_off(monkeypatch):
    switch = Switch("SHARDSTREAM_TEST_ONLY", "1", "")
    monkeypatch.setenv(switch.name, "")
    assert switch.get() == "1" and not switch.off()
    monkeypatch.setenv(switch.name, "0")
    assert switch.off()
    monkeypatch.setenv(switch.name, "no")
    assert not switch.off()
    assert switch.pop() == "no" and switch.get() == "1"
