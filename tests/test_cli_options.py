"""One vocabulary of options and names across commands, each command run as a user runs
it: a subprocess, real servers on 127.0.0.1 (a Hub stand-in for the token and the revision)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import warm_python

from http_server import serve_hub
from test_cli_convert import CLI, run_cli
from test_serving_server import _free_port
from tiny_models import char_tokenizer, llama_store_with_tokenizer, save_checkpoint

SECRET = "hub-secret"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("options") / "ckpt"
    save_checkpoint("llama", folder)
    char_tokenizer().save_pretrained(folder)
    return folder


def test_serve_names_the_model_after_its_folder(tmp_path):
    store, _, _ = llama_store_with_tokenizer(tmp_path)
    store.rename(tmp_path / "store2")
    port = _free_port()
    log = tmp_path / "serve.log"
    with log.open("w") as written:
        process = warm_python.popen([*CLI, "serve", "./store2", "--port", str(port), "--no-progress"], cwd=tmp_path,
                                    stdout=subprocess.DEVNULL, stderr=written)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            try:
                models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=1)
                break
            except httpx.TransportError:
                time.sleep(0.2)
    finally:
        process.terminate()
        process.wait(timeout=30)
    assert [m["id"] for m in models.json()["data"]] == ["store2"]
    assert "(model store2;" in log.read_text()


def test_generate_converts_with_converts_options(checkpoint, tmp_path):
    src = tmp_path / "src"
    subprocess.run(["cp", "-r", str(checkpoint), str(src)], check=True)
    result = run_cli("generate", "src", "--store-path", "store", "--sequential", "--compression", "4bit",
                     "--prompt", "hi", "--max-new-tokens", "2", "--no-progress", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "store" / "manifest.json").read_text())["compression"] == "4bit"
    assert not list(src.glob("*.safetensors")), "--sequential deletes the shards, as in convert"
    assert (src / "config.json").exists()


def test_the_hub_token_is_hf_token_in_every_command_that_downloads(checkpoint, tmp_path):
    with serve_hub({"tiny-org/private": checkpoint}, token=SECRET, revision="v2") as (url, _):
        env = {**os.environ, "HF_ENDPOINT": url.rstrip("/"), "HF_HOME": str(tmp_path / "hf")}
        env.pop("HF_TOKEN", None)

        def run(*args: str, **extra: str) -> subprocess.CompletedProcess:
            return subprocess.run([*CLI, *args, "--no-progress"], cwd=tmp_path, env={**env, **extra},
                                  capture_output=True, text=True, timeout=300)

        refused = run("convert", "tiny-org/private", "a", "--revision", "v2")
        assert refused.returncode == 1 and "pass a token" in refused.stderr, refused.stderr
        for args, extra in [
            (["convert", "tiny-org/private", "b", "--revision", "v2", "--hf-token", SECRET], {}),
            (["convert", "tiny-org/private", "c", "--revision", "v2", "--token", SECRET], {}),   # the old spelling
            (["generate", "tiny-org/private", "--store-path", "d", "--revision", "v2", "--prompt", "hi",
              "--max-new-tokens", "1"], {"HF_TOKEN": SECRET}),
        ]:
            done = run(*args, **extra)
            assert done.returncode == 0, (args, done.stderr)
    for command in ("convert", "generate", "serve"):
        shown = run_cli(command, "-h", cwd=tmp_path, check=True).stdout
        assert "--hf-token" in shown and "HF_TOKEN" in shown and "--token " not in shown, command
        assert "--revision" in shown and "--compression" in shown and "--sequential" in shown, command



def test_a_draft_opens_with_the_models_token_and_compute_dtype(checkpoint, tmp_path):
    """`--draft` from a gated Hub repo: the model's --hf-token reaches it, and it computes in the model's
    --compute-dtype, each said in its own line."""
    with serve_hub({"tiny-org/draft": checkpoint}, token=SECRET) as (url, _):
        env = {**os.environ, "HF_ENDPOINT": url.rstrip("/"), "HF_HOME": str(tmp_path / "hf"),
               "SHARDSTREAM_CACHE": str(tmp_path / "cache")}
        env.pop("HF_TOKEN", None)
        done = subprocess.run([*CLI, "generate", str(checkpoint), "--store-path", "target", "--prompt", "hi",
                               "--max-new-tokens", "2", "--draft", "tiny-org/draft", "--hf-token", SECRET,
                               "--compute-dtype", "bfloat16", "--no-progress"],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "shardstream: compute dtype: bfloat16 (asked for; the checkpoint is float32)" in done.stderr, done.stderr
    assert "shardstream: draft: compute dtype: bfloat16 (asked for; the checkpoint is float32)" in done.stderr, done.stderr


SIZE = "a size such as 500MB, 2GB or 2GiB, or auto"


@pytest.mark.parametrize("command, option, value, refusal", [
    ("serve", "--port", "70000", "a whole number from 0 to 65535, not 70000"),
    ("serve", "--port", "-1", "a whole number from 0 to 65535, not -1"),
    ("serve", "--max-batch-size", "0", "a whole number of at least 1, not 0"),
    ("serve", "--max-request-size", "0", "a size above 0 such as 500MB, 2GB or 2GiB, not '0'"),
    ("serve", "--max-resident-memory", "-1GB", f"{SIZE}, not '-1GB'"),
    ("serve", "--max-host-memory", "inf", f"{SIZE}, not 'inf'"),
    ("serve", "--tp-timeout", "nan", "a finite number above 0, not nan"),
    ("generate", "--max-new-tokens", "0", "a whole number of at least 1, not 0"),
    ("generate", "--temperature", "nan", "a finite number of at least 0, not nan"),
    ("generate", "--temperature", "inf", "a finite number of at least 0, not inf"),
    ("generate", "--top-p", "0", "a finite number above 0 and at most 1, not 0.0"),
    ("generate", "--top-k", "-1", "a whole number of at least 0, not -1"),
    ("generate", "--seed", str(2**64), f"a whole number from {-2**63} to {2**64 - 1}, not {2**64}"),
    ("generate", "--draft-tokens", "0", "a whole number of at least 1, not 0"),
    ("generate", "--batch-size", "0", "a whole number of at least 1, not 0"),
    ("generate", "--max-resident-memory", "lots", f"{SIZE}, not 'lots'"),
    ("generate", "--max-host-memory", "-5", f"{SIZE}, not '-5'"),
    ("generate", "--max-expert-memory", "most", f"{SIZE}, not 'most'"),
    ("serve", "--max-expert-memory", "-1MB", f"{SIZE}, not '-1MB'"),
    ("generate", "--device", "tpu", "cpu, cuda or cuda:N, not 'tpu'"),
    ("generate", "--compute-dtype", "int8", "one of auto, float32, bfloat16, float16, not 'int8'"),
    ("generate", "--experts", "whatever", "one of with-block, on-demand, not 'whatever'"),
    ("generate", "--stop", "", "a non-empty text, not ''"),
    ("convert", "--compression", "3bit", "one of none, 4bit, 8bit, int4, not '3bit'"),
    ("convert", "--min-free-space", "abc", "a size such as 500MB, 2GB or 2GiB, not 'abc'"),
    ("shard", "--tp", "0", "a whole number of at least 1, not 0"),
    ("train", "--lr", "-1", "a finite number above 0, not -1.0"),
    ("train", "--lr", "nan", "a finite number above 0, not nan"),
    ("train", "--seq-len", "-5", "a whole number of at least 1, not -5"),
    ("train", "--seq-len", "0", "a whole number of at least 1, not 0"),
    ("train", "--workers", "0", "a whole number of at least 1, not 0"),
    ("train", "--steps", "0", "a whole number of at least 1, not 0"),
    ("train", "--batch-size", "0", "a whole number of at least 1, not 0"),
    ("agent", "--port", "70000", "a whole number from 0 to 65535, not 70000"),
    ("agent", "--data-port", "70000", "a whole number from 0 to 65535, not 70000"),   # was taken as port 4464
    ("coordinator", "--serve-port", "-1", "a whole number from 0 to 65535, not -1"),
    ("agent", "--name", "", "a name that is not empty nor starts or ends with a space, not ''"),
])
def test_an_option_value_out_of_range_is_refused_before_anything_loads(tmp_path, command, option, value, refusal):
    """`--port 70000` was a 42-line OverflowError, `--temperature nan` a 54-line traceback and `inf` was
    taken; `--max-batch-size 0` was refused once the model had loaded, naming `max_batch_size`; `train --lr -1`
    and `--seq-len -5` were tracebacks, `--seq-len 0` and `--workers 0` were taken, and `--stop ''` ended
    every answer before its first token. The store here does not exist: a check made after opening it would
    say that instead."""
    nowhere, out = str(tmp_path / "nowhere"), str(tmp_path / "out")
    given = {"generate": [nowhere, "--prompt", "hi"], "convert": [nowhere, out],
             "train": ["--model", nowhere, "--dataset-file", nowhere, "--output", out],
             "agent": ["--name", "a", "--token", "t"], "coordinator": ["--model", nowhere, "--token", "t"],
             }.get(command, [nowhere])
    result = run_cli(command, *given, option, value, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr == f"error: {option} must be {refusal}. (see `shardstream {command} -h`)\n"


@pytest.mark.parametrize("command, option, url", [
    ("agent", "--join", "http://127.0.0.1:abc"),   # a traceback in the joining thread, and the agent ran on
    ("coordinator", "--urls", "http://127.0.0.1:notaport"),
    ("coordinator", "--urls", "http://127.0.0.1:8008,http://[::1"),
    ("coordinator", "--urls", "http://127.0.0.1:99999"),
    ("coordinator", "--urls", "pi.local:8008"),
])
def test_a_url_that_is_no_url_is_refused_before_anything_starts(tmp_path, command, option, url):
    given = ["--name", "a", "--token", "t"] if command == "agent" else ["--model", str(tmp_path), "--token", "t"]
    result = run_cli(command, *given, option, url, cwd=tmp_path)
    bad = url.rsplit(",", 1)[-1]
    assert result.returncode == 2, result.stderr
    assert result.stderr == (f"error: {option} must name http(s)://HOST:PORT URLs, and {bad!r} is not one. "
                             f"(see `shardstream {command} -h`)\n")


def test_max_expert_memory_reaches_the_engine():
    """`--max-expert-memory` becomes the engine's `max_expert_memory` (0: every routed expert read on every pass)."""
    from shardstream.front.cli import command_options
    from shardstream.options import EngineFlags

    assert command_options(EngineFlags(experts="on-demand", max_expert_memory="0")).max_expert_memory == 0
    assert command_options(EngineFlags(experts="on-demand", max_expert_memory="1MiB")).max_expert_memory == 1 << 20
    assert command_options(EngineFlags(experts="on-demand")).max_expert_memory == "auto"
