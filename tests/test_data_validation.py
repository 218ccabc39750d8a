"""Validate first, create last: a `train` or `data` command that fails leaves nothing behind.

Real `shardstream` subprocesses in a scratch working directory; each checks the message and that
no file or folder appeared.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conftest_data import tiny_model, write_txt  # noqa: F401  (fixtures)
import warm_python

from shardstream.data.tracker import open_tracker, sqlite_path
from shardstream.errors import InvalidOption, TrackerNotFound

CLI = [sys.executable, "-m", "shardstream.cli"]


def _fails(cwd: Path, *args: str) -> str:
    """Run `shardstream ARGS` in `cwd`; it must fail with one line on stderr and exit 1. Returns that line."""
    result = warm_python.run([*CLI, *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    return result.stderr


def _tree(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


def test_train_with_a_bad_model_or_dataset_creates_nothing(tmp_path, tiny_model):
    write_txt(tmp_path / "corpus.txt", 16)
    before = _tree(tmp_path)
    message = _fails(tmp_path, "train", "--model", "./nomodel", "--dataset-file", "corpus.txt", "--output", "out/a",
                     "--cache-dir", "cache")
    assert "nomodel has no config.json" in message
    message = _fails(tmp_path, "train", "--model", tiny_model, "--dataset-file", "./missing", "--output", "out/a",
                     "--cache-dir", "cache")
    assert "dataset file ./missing does not exist" in message
    assert _tree(tmp_path) == before  # no --output, no tracker, no cache


def test_train_with_a_wrong_text_field_creates_nothing(tmp_path, tiny_model):
    (tmp_path / "corpus.jsonl").write_text("".join(f'{{"body": "sample {i} the model"}}\n' for i in range(20)))
    before = _tree(tmp_path)
    message = _fails(tmp_path, "train", "--model", tiny_model, "--dataset-file", "corpus.jsonl", "--output", "out",
                     "--cache-dir", "cache")
    assert "has no 'text' field; pass --text-field with one of ['body']" in message
    assert _tree(tmp_path) == before   # no chunk_tracker.sqlite, no --output, no cache


def test_train_that_fails_before_its_first_save_removes_the_tracker_it_made(tmp_path, tiny_model):
    # The first sample is fine (so the checks pass); line 3 is not JSON: reading the first block fails mid-run.
    (tmp_path / "corpus.jsonl").write_text('{"text": "sample 1 the model"}\n{"text": "sample 2"}\n{"text": broken\n')
    message = _fails(tmp_path, "train", "--model", tiny_model, "--dataset-file", "corpus.jsonl", "--output", "out",
                     "--cache-dir", "cache")
    assert "corpus.jsonl line 3 is not JSON" in message
    assert not (tmp_path / "out").exists()


def test_data_status_on_a_missing_tracker_says_so_and_creates_nothing(tmp_path):
    message = _fails(tmp_path, "data", "status", "--tracker", "./nope/chunk_tracker.sqlite")
    assert "does not exist" in message and "nope/chunk_tracker.sqlite" in message
    _fails(tmp_path, "data", "export", "--tracker", "sqlite:///nope/t.sqlite", "--output", "state.json")
    assert _tree(tmp_path) == set()


def test_sqlite_urls_follow_sqlalchemy(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert sqlite_path("sqlite:///data/t.sqlite") == Path("data/t.sqlite")          # three slashes: relative
    assert sqlite_path("sqlite:////abs/t.sqlite") == Path("/abs/t.sqlite")          # four: absolute
    assert sqlite_path("runs/t.sqlite") == Path("runs/t.sqlite") and sqlite_path("postgresql://u@h/db") is None
    for bad in ("sqlite://host/t.sqlite", "sqlite://", "sqlite:///", "mysql://h/db"):
        with pytest.raises(InvalidOption, match="sqlite:///"):
            sqlite_path(bad)
    with pytest.raises(TrackerNotFound, match="does not exist"):
        open_tracker(f"sqlite:///{tmp_path}/absent.sqlite", must_exist=True)   # sqlite:////tmp/...
    with open_tracker(f"sqlite:///{tmp_path}/made.sqlite") as tracker:
        tracker.setup("src", 8, 4)
    assert (tmp_path / "made.sqlite").is_file() and not (tmp_path / "tmp").exists()


def test_data_commands_name_a_folder_or_an_unreadable_state_and_leave_nothing(tmp_path):
    """`data export --output FOLDER` and to an unwritable place were tracebacks; `--tracker FOLDER` was said
    not to exist; an import of a state file that cannot be read left an empty tracker behind."""
    with open_tracker(str(tmp_path / "t.sqlite")) as tracker:
        tracker.setup("corpus.txt", 100, 10)
    (tmp_path / "out").mkdir()
    assert "--output out is a folder; give the JSON file to write, such as out/chunk_tracker_state.json" in _fails(
        tmp_path, "data", "export", "--tracker", "t.sqlite", "--output", "out")
    assert "cannot write --output /proc/x.json (" in _fails(
        tmp_path, "data", "export", "--tracker", "t.sqlite", "--output", "/proc/x.json")
    assert f"tracker {tmp_path / 'out'} is a folder; pass its SQLite file" in _fails(
        tmp_path, "data", "status", "--tracker", "out")
    before = _tree(tmp_path)
    assert "tracker state file missing.json cannot be read" in _fails(
        tmp_path, "data", "import", "--tracker", "new.sqlite", "--state", "missing.json")
    assert _tree(tmp_path) == before


def test_a_tracker_of_another_dataset_is_refused(tmp_path):
    """It was taken: a run on a 1000-sample file trained the 200-sample file's blocks, and said it had."""
    with open_tracker(str(tmp_path / "t.sqlite")) as tracker:
        tracker.setup("/data/corpus-a.txt", 100, 10)
        tracker.setup("/mnt/elsewhere/corpus-a.txt", 100, 10)   # the same data where another machine keeps it
        with pytest.raises(InvalidOption, match="was made for the dataset /data/corpus-a.txt, not big.txt; pass that "
                                                "--dataset-file"):
            tracker.setup("big.txt", 100, 10)


def test_a_model_folder_missing_weight_files_its_index_names_is_refused_up_front(tmp_path):
    """transformers' FileNotFoundError traceback came once the run had started."""
    from shardstream.data.model import check_model_folder

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors.index.json").write_text(
        '{"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}')
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"")
    with pytest.raises(InvalidOption, match=f"model folder {tmp_path} lacks 1 of the 2 weight files its "
                                            "model.safetensors.index.json names \\(first: model-00001-of-00002"):
        check_model_folder(str(tmp_path))
    (tmp_path / "model.safetensors.index.json").write_text("[]")
    with pytest.raises(InvalidOption, match="is not a weight index"):
        check_model_folder(str(tmp_path))
