"""`shardstream --help`, `--version`, `-h` and argument errors answer without loading torch; help reads right."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

HEAVY = ("torch", "transformers", "datasets", "numpy", "safetensors", "fastapi", "pyarrow", "uvicorn")
# CPU seconds of the child (user + sys): steady under load, where wall time is not. About 0.5 s
# on the 2-core dev machine under load, 3.9 s when torch and transformers were imported up front.
CPU_LIMIT_S = 1.0
WALL_LIMIT_S = 10.0   # only catches a hang or a sleep; a loaded machine stretches wall time many times


def _cpu_of_children() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _shardstream(*args: str, cwd: Path | None = None) -> tuple[subprocess.CompletedProcess, float, float]:
    """Run `shardstream ARGS`; returns the result, its CPU seconds and its wall seconds."""
    env = {**os.environ, "COLUMNS": "200"}
    cpu, start = _cpu_of_children(), time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "shardstream.cli", *args], capture_output=True, text=True,
                            timeout=120, env=env, cwd=cwd)
    return result, _cpu_of_children() - cpu, time.perf_counter() - start


def test_building_the_app_imports_nothing_heavy():
    code = ("import sys, typer; from shardstream.cli import app; typer.main.get_command(app); "
            f"print([m for m in {HEAVY!r} if m in sys.modules])")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize("args", [["--help"], ["-h"], ["--version"], ["convert", "-h"], ["train", "--help"],
                                  ["convert"], ["train", "--no-such-flag"]])
def test_help_version_and_argument_errors_are_fast(args):
    result, cpu, wall = min((_shardstream(*args) for _ in range(2)), key=lambda r: r[1])  # best of two
    assert result.returncode in (0, 2), result.stderr
    assert "Traceback" not in result.stderr
    assert cpu < CPU_LIMIT_S and wall < WALL_LIMIT_S, f"shardstream {' '.join(args)}: {cpu:.2f} s CPU, {wall:.2f} s wall"


@pytest.mark.parametrize("args, message", [
    (["generate", "store", "--max-new-tokens", "abc"], "Invalid value for '--max-new-tokens'"),
    (["convert"], "Missing argument 'source'"),
    (["train", "--no-such-flag"], "No such option: --no-such-flag"),
    (["nope"], "No such command 'nope'"),
])
def test_an_argument_error_is_one_line_and_exit_2(args, message):
    result = _shardstream(*args)[0]
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith(f"error: {message}") and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.rstrip().endswith(" -h`)")


def test_version_and_short_help():
    from shardstream import __version__

    assert _shardstream("--version")[0].stdout.strip() == f"shardstream {__version__}"
    assert "Usage: shardstream [OPTIONS] COMMAND" in _shardstream("-h")[0].stdout


def test_help_shows_usage_names_flags_and_defaults_truthfully():
    convert = _shardstream("convert", "--help")[0].stdout
    assert "Usage: shardstream convert [OPTIONS] SOURCE OUT" in convert
    assert "<bool>" not in convert and "--no-sequential" not in convert
    assert "(no warning)" in convert  # --layer-memory-warning says what its absence means
    train = _shardstream("train", "--help")[0].stdout
    assert "<bool>" not in train
    for flag in ("--stop-after-epoch", "--parallel-independent", "--iterate", "--ddp"):
        line = next(line for line in train.splitlines() if f" {flag} " in line)
        assert "[default:" not in line and f"--no-{flag[2:]}" not in line, line


def test_the_command_gives_torch_huge_pages_for_large_tensors_unless_the_user_says_otherwise():
    """main() sets THP_MEM_ALLOC_ENABLE before torch loads; torch then advises huge pages on a 64 MiB
    tensor (seen in /proc/self/smaps where the kernel allows them). A user's own value is kept."""
    probe = ("import os, sys; from shardstream.cli import use_huge_pages_for_tensors; use_huge_pages_for_tensors(); "
             "import torch; t = torch.ones(16 << 20); "
             "huge = sum(int(l.split()[1]) for l in open('/proc/self/smaps') if l.startswith('AnonHugePages')); "
             "print(os.environ['THP_MEM_ALLOC_ENABLE'], huge > 0)")
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=env, check=True)
    mode_file = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    mode = mode_file.read_text() if mode_file.exists() else "[never]"
    assert result.stdout.split() == ["1", str("[never]" not in mode)]
    kept = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                          env={**env, "THP_MEM_ALLOC_ENABLE": "0"}, check=True)
    assert kept.stdout.split()[0] == "0"
    if "[madvise]" in mode:   # huge pages only where asked for: none without the setting
        assert kept.stdout.split()[1] == "False"


@pytest.mark.parametrize("given, expected", [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_importing_shardstream_makes_openmp_threads_sleep_unless_told_otherwise(given, expected):
    """Before torch loads its OpenMP runtime, so that its threads wait without spinning (see __init__.py);
    a user's own OMP_WAIT_POLICY stays."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"} | ({"OMP_WAIT_POLICY": given} if given else {})
    code = "import os, shardstream; print(os.environ['OMP_WAIT_POLICY'])"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env, check=True)
    assert result.stdout.strip() == expected


def test_an_error_naming_a_path_with_brackets_prints_it_as_it_is(tmp_path):
    """A message is text, not rich markup: a path like `runs[/old]` (or a library's "[/__w/...]") used to end
    in a MarkupError traceback, or lose the bracketed part."""
    folder = tmp_path / "runs[/old]" / "nostore"
    result = _shardstream("generate", str(folder), "--prompt", "hi")[0]
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.startswith(f"error: {folder} does not exist;"), result.stderr
