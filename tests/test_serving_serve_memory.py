"""`shardstream serve` under a real memory cap (memcap: a cgroup that counts the page cache) with many
concurrent clients: the batch takes only what fits, the others wait, every answer equals the model's
greedy answer alone, and the server is alive after; one
request that asks for a whole context of tokens ends where the memory does, and the server lives.

The model is scaled down from the benchmark's (4 fp32 blocks of 51 MB, larger than what the cap leaves,
so blocks are read with O_DIRECT into two buffers that only appear on the first pass)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from shardstream.convert import convert
from test_serving_server import _free_port
from tiny_models import char_tokenizer

MEMCAP = Path("/work/shared/tools/memcap")
CAP = "450M"       # the server's ~280 MB of Python, torch and uvicorn, two 51 MB read buffers, and ~70 MB left
CLIENTS = 32
DISTINCT = 4       # prompts, each asked by CLIENTS / DISTINCT clients (the references are computed alone)
NEW_TOKENS = 8
LONG_CAP = "400M"  # the server's Python, torch and uvicorn, and about 80 MiB for the KV cache of the model below
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


def _memcap_missing() -> str | None:
    if not MEMCAP.is_file():
        return f"needs {MEMCAP}"
    if os.geteuid() != 0:
        return "memcap needs root to create a cgroup"
    if not Path("/sys/fs/cgroup/memory").is_dir() and not Path("/sys/fs/cgroup/cgroup.controllers").is_file():
        return "needs a cgroup memory controller"
    return None


pytestmark = pytest.mark.skipif(_memcap_missing() is not None, reason=_memcap_missing() or "")


@pytest.fixture(scope="module")
def store(module_tmp_path):
    folder = module_tmp_path / "capped"
    config = AutoConfig.for_model("llama", hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                                  num_attention_heads=16, num_key_value_heads=16, vocab_size=128,
                                  max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
                                  tie_word_embeddings=False)
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    reference.save_pretrained(folder / "ckpt")
    tokenizer = char_tokenizer()
    tokenizer.save_pretrained(folder / "ckpt")
    convert(folder / "ckpt", folder / "store", progress=False)
    return folder / "store", reference, tokenizer


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as reply:
        return json.loads(reply.read())


def _wait_healthy(server: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + 120
    while True:
        assert server.poll() is None, log.read_text()
        try:
            urllib.request.urlopen(url + "/health", timeout=1).read()
            return
        except OSError:
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.3)


def test_32_concurrent_clients_under_a_memory_cap_all_get_their_greedy_answer(store, tmp_path):
    path, reference, tokenizer = store
    distinct = [f"Client {i}: " + "to be or not to be, " * (1 + i % 3) for i in range(DISTINCT)]
    alone = {}
    for prompt in distinct:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        out = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                 do_sample=False, pad_token_id=0)
        alone[prompt] = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    prompts = [distinct[i % DISTINCT] for i in range(CLIENTS)]

    port = _free_port()
    log = tmp_path / "serve.log"
    server = subprocess.Popen(
        [str(MEMCAP), CAP, "--cold", str(path), "--", str(Path(sys.executable).with_name("shardstream")), "serve",
         str(path), "--port", str(port), "--max-batch-size", str(CLIENTS), "--quiet", "--no-progress"],
        stdout=subprocess.DEVNULL, stderr=log.open("w"))
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(server, url, log)

        def ask(prompt: str) -> str:
            reply = _post(url + "/v1/completions", {"prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0})
            return reply["choices"][0]["text"]

        with ThreadPoolExecutor(CLIENTS) as pool:
            answers = list(pool.map(ask, prompts))
        assert server.poll() is None, log.read_text()
        assert answers == [alone[p] for p in prompts]
        urllib.request.urlopen(url + "/health", timeout=5).read()
    finally:
        server.terminate()
        server.wait(timeout=60)
    text = log.read_text()
    assert "batch limited by memory" in text, text   # the bound that applied is said, and it was memory


@pytest.fixture(scope="module")
def long_context_store(module_tmp_path):
    """A model whose KV cache is large and its weights small: 1 MiB of float32 keys and values a token (8
    layers of 16 heads of 1,024), 17 MB of weights, a 32,768-token context (a whole context of cache is
    32 GiB) and no end-of-sequence token, so that only the context or the memory ends a request."""
    folder = module_tmp_path / "long"
    config = AutoConfig.for_model("llama", hidden_size=16, intermediate_size=32, num_hidden_layers=8,
                                  num_attention_heads=16, num_key_value_heads=16, head_dim=1024, vocab_size=128,
                                  max_position_embeddings=32768, bos_token_id=1, eos_token_id=None,
                                  tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder / "ckpt")
    tokenizer = char_tokenizer()
    tokenizer.eos_token = None
    tokenizer.save_pretrained(folder / "ckpt")
    convert(folder / "ckpt", folder / "store", progress=False)
    (folder / "chat.jinja").write_text(CHAT_TEMPLATE)
    return folder


def test_a_request_without_max_tokens_ends_with_length_where_memory_ends_and_the_server_lives(long_context_store,
                                                                                           tmp_path):
    """The `openai` client sends no max_tokens unless told; chat's default is the rest of the context. Its
    KV cache was reserved for all of it at once ("running it anyway") and the kernel killed the server
    within a second. Now the cache grows as tokens come, the request ends with finish_reason "length"
    where the memory left holds no more, and a prompt whose own cache cannot fit is a 503 in one sentence."""
    store = long_context_store / "store"
    port = _free_port()
    log = tmp_path / "serve.log"
    server = subprocess.Popen(
        [str(MEMCAP), LONG_CAP, "--cold", str(store), "--", str(Path(sys.executable).with_name("shardstream")),
         "serve", str(store), "--port", str(port), "--chat-template", str(long_context_store / "chat.jinja"),
         "--model-name", "qst", "--no-progress"], stdout=subprocess.DEVNULL, stderr=log.open("w"))
    url = f"http://127.0.0.1:{port}"
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
    try:
        _wait_healthy(server, url, log)
        reply = client.chat.completions.create(model="qst", messages=[{"role": "user", "content": "Hi"}])
        assert server.poll() is None, log.read_text()
        assert reply.choices[0].finish_reason == "length"
        assert 0 < reply.usage.completion_tokens < 1000, reply.usage   # far short of the context: memory ended it
        with pytest.raises(openai.APIStatusError) as refused:
            client.completions.create(model="qst", prompt="a" * 2000, max_tokens=1)
        assert refused.value.status_code == 503 and refused.value.code == "insufficient_memory"
        assert "a prompt of 2000 tokens needs" in refused.value.message
        again = client.completions.create(model="qst", prompt="Hi", max_tokens=4)
        assert again.usage.completion_tokens == 4 and server.poll() is None
    finally:
        server.terminate()
        server.wait(timeout=60)
    text = log.read_text()
    assert f"ended a sequence after {reply.usage.completion_tokens} tokens with finish_reason \"length\"" in text, text
