"""Fixtures for the training-data tests: a tiny model folder, corpora, a real PostgreSQL server.

Imported explicitly by the test_data_* modules (tests/conftest.py belongs to the lead).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import warm_python

REPO = Path(__file__).resolve().parent.parent
WORDS = "the a model data chunk block tracker worker lease epoch train step loss token shard stream".split()

# A minimal main CLI: mounts our commands and, like the real one, prints our errors without a traceback.
CLI = """
import sys, typer
from shardstream.data.cli import train_command, data_app
from shardstream.errors import ShardstreamError
app = typer.Typer(pretty_exceptions_enable=False)
app.command("train")(train_command)
app.add_typer(data_app, name="data")
try:
    app(args=sys.argv[1:], prog_name="shardstream")
except ShardstreamError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(1)
"""


def run_cli(*args: str, timeout: float = 240, **popen) -> subprocess.CompletedProcess:
    """`shardstream ...` as a real process (forked warm: tests/warm_python.py)."""
    return warm_python.run([sys.executable, "-c", CLI, *map(str, args)], capture_output=True, text=True,
                           timeout=timeout, cwd=REPO, **popen)


def sample_texts(n: int) -> list[str]:
    return [f"sample {i} " + " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(3 + i % 5)) for i in range(n)]


def write_txt(path: Path, n: int) -> Path:
    path.write_text("\n".join(sample_texts(n)) + "\n")
    return path


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A folder with config.json (Llama, hidden 32, 2 layers) and a word-level tokenizer; no weights."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("tiny-model")
    vocab = {tok: i for i, tok in enumerate(["[UNK]", "[PAD]", "[EOS]", "sample", *WORDS, *map(str, range(10))])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]", eos_token="[EOS]")
    tokenizer.save_pretrained(folder)
    LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=2, max_position_embeddings=64, pad_token_id=1, eos_token_id=2,
                bos_token_id=2).save_pretrained(folder)
    return folder


def _pg_bindir() -> Path:
    """Where initdb and pg_ctl live: PATH, then `pg_config --bindir`, then Debian's versioned folders."""
    candidates = [Path(p).parent for p in [shutil.which("initdb")] if p]
    if shutil.which("pg_config"):
        candidates.append(Path(subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True).stdout.strip()))
    candidates += sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)
    for folder in candidates:
        if (folder / "initdb").exists() and (folder / "pg_ctl").exists():
            return folder
    raise RuntimeError("PostgreSQL server binaries (initdb, pg_ctl) not found; install them (Debian: apt-get install postgresql).")


@contextmanager
def throwaway_postgres() -> Iterator[str]:
    """A PostgreSQL server on 127.0.0.1 and a free port, deleted afterwards; yields the URL without a database."""
    bindir = _pg_bindir()
    root = Path(tempfile.mkdtemp(prefix="shardstream-pg-"))
    as_postgres = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    if as_postgres:  # initdb refuses to run as root
        shutil.chown(root, "postgres", "postgres")
    data = root / "data"
    try:
        subprocess.run([*as_postgres, bindir / "initdb", "-D", data, "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync"],
                       check=True, capture_output=True)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        options = f"-p {port} -k {root} -h 127.0.0.1 -c fsync=off -c max_connections=50"
        subprocess.run([*as_postgres, bindir / "pg_ctl", "-D", data, "-l", root / "log", "-w", "-o", options, "start"],
                       check=True, capture_output=True)
        yield f"postgresql://postgres@127.0.0.1:{port}"
    finally:
        subprocess.run([*as_postgres, bindir / "pg_ctl", "-D", data, "-m", "immediate", "-w", "stop"], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[str]:
    with throwaway_postgres() as url:
        yield url


@pytest.fixture
def postgres_url(postgres_server: str) -> str:
    """A fresh database on the session's server."""
    import psycopg

    name = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(f"{postgres_server}/postgres", autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return f"{postgres_server}/{name}"


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]
