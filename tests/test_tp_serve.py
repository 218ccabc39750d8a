"""`shardstream serve --tensor-parallel` as users start it: two gloo ranks under torchrun (`python -m
torch.distributed.run`) on 127.0.0.1, driven by the official `openai` client and raw HTTP.

The ranks start once for the module (with `--max-restarts 1`); the test that SIGKILLs rank 1 runs last.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import psutil
import pytest
import warm_python
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from shardstream.convert import convert
from shardstream.shard import place_experts
from shardstream.store import open_store
from test_serving_server import requests_in_flight_when
from tiny_models import COMMON, CONFIGS, char_tokenizer, save_checkpoint

SRC = Path(__file__).resolve().parents[1] / "src"
KEY = "tp-key"
CONTEXT = 512   # room for a request long enough to be in flight when a rank is killed
RESIDENT = re.compile(r"shardstream serve: (.+) keeps \d+ blocks? .*\(resident budget (\d+) MiB\)")
PROMPTS = ["Hello", "ROMEO:", "To be, or not to be", "a", "The quick brown fox", "Zz", "0123456789", "Once upon a time"]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}


def _tiny_store(folder: Path, family: str = "llama"):
    """The tiny model of the other tests (llama, or another family of tiny_models.py) with a longer context;
    (store, reference, tokenizer)."""
    settings = {**COMMON, **CONFIGS[family], "max_position_embeddings": CONTEXT}
    model_type = settings.pop("model_type")
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **settings)).eval()
    reference.save_pretrained(folder / "ckpt", max_shard_size="40KB")
    tokenizer = char_tokenizer()
    tokenizer.save_pretrained(folder / "ckpt")
    convert(folder / "ckpt", folder / "store", progress=False)
    return folder / "store", reference, tokenizer


class Ranks:
    """`torchrun --nproc-per-node 2 --max-restarts 1 -m shardstream serve STORE --tensor-parallel`."""

    def __init__(self, store: Path, log: Path, *options: str):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.process = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
             "--max-restarts", "1", "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
             "-m", "shardstream", "serve", str(store), "--tensor-parallel", "--port", str(self.port), "--no-progress",
             *options], stdout=subprocess.DEVNULL, stderr=log.open("w"), env=_env(), start_new_session=True)
        self.wait_ready()

    def wait_ready(self) -> list[int]:
        """Poll /health until it answers 200; the statuses seen before (0: nothing listening)."""
        seen, deadline = [], time.monotonic() + 240
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log.read_text()[-3000:]
            try:
                status = httpx.get(self.url + "/health", timeout=2).status_code
            except httpx.TransportError:
                status = 0
            if status == 200:
                return seen
            seen.append(status)
            time.sleep(0.2)
        raise AssertionError("the ranks did not start: " + self.log.read_text()[-3000:])

    def rank_pid(self, rank: int) -> int:
        """The pid of the worker torchrun started as `rank` (its RANK variable)."""
        for child in psutil.Process(self.process.pid).children(recursive=True):
            if child.environ().get("RANK") == str(rank):
                return child.pid
        raise AssertionError(f"no rank {rank} among torchrun's children")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)   # the session started for these ranks alone
            self.process.wait()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return _tiny_store(tmp_path_factory.mktemp("tp-serve"))


@pytest.fixture(scope="module")
def ranks(tiny, tmp_path_factory):
    store, reference, tokenizer = tiny
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:")
    # the ranks stream their shares (no block resident), written into a --tp-cache folder of their own
    cache = tmp_path_factory.mktemp("tp-cache")
    served = Ranks(store, tmp_path_factory.mktemp("log") / "serve.log", "--api-key", KEY, "--max-batch-size", "8",
                   "--model-name", "tiny", "--chat-template", str(template), "--max-resident-memory", "0",
                   "--tp-cache", str(cache))
    assert len(list(cache.glob("*/rank_*"))) == 2
    client = openai.OpenAI(base_url=served.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    yield served, client, reference, tokenizer
    served.stop()


def _greedy_ids(reference, tokenizer, prompt: str, new_tokens: int) -> list[int]:
    ids = torch.tensor([tokenizer(prompt)["input_ids"]])
    with torch.no_grad():
        out = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 do_sample=False, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def _greedy(reference, tokenizer, prompt: str, new_tokens: int) -> str:
    return tokenizer.decode(_greedy_ids(reference, tokenizer, prompt, new_tokens), skip_special_tokens=True)


def test_eight_concurrent_requests_get_the_greedy_text_of_transformers(ranks):
    served, client, reference, tokenizer = ranks

    def ask(prompt: str) -> str:
        return client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0).choices[0].text

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        texts = list(pool.map(ask, PROMPTS))
    assert texts == [_greedy(reference, tokenizer, prompt, 12) for prompt in PROMPTS]
    batched = [line for line in served.log.read_text().splitlines() if "POST /v1/completions 200" in line]
    assert len(batched) >= len(PROMPTS)


def test_streaming_logprobs_n_and_chat(ranks):
    served, client, reference, tokenizer = ranks
    expected_ids = _greedy_ids(reference, tokenizer, "Hello", 8)
    expected = tokenizer.decode(expected_ids, skip_special_tokens=True)
    chunks = list(client.completions.create(model="tiny", prompt="Hello", max_tokens=8, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    whole = client.completions.create(model="tiny", prompt="Hello", max_tokens=8, temperature=0, logprobs=2, n=2)
    assert [c.text for c in whole.choices] == [expected, expected]
    ids = torch.tensor([tokenizer("Hello")["input_ids"] + expected_ids])
    with torch.no_grad():
        scores = torch.log_softmax(reference(ids).logits[0, -len(expected_ids) - 1:-1].float(), -1)
    reference_logprobs = [scores[i, t].item() for i, t in enumerate(expected_ids)]
    for choice in whole.choices:
        assert choice.logprobs.token_logprobs == pytest.approx(reference_logprobs, abs=1e-4)
        assert all(len(top) == 2 for top in choice.logprobs.top_logprobs)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                          temperature=0, logprobs=True, top_logprobs=1)
    assert chat.choices[0].message.content == _greedy(reference, tokenizer, "user: Hi\nassistant:", 5)
    assert len(chat.choices[0].logprobs.content) == 5
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=served.url + "/v1", api_key="wrong", max_retries=0).models.list()


@pytest.mark.parametrize("options, sentence", [
    (["--tp-cache", "cache"], "--tp-cache goes with --tensor-parallel; leave it out."),
    (["--tensor-parallel", "--max-host-memory", "1GB"], "--max-host-memory applies only with --device cuda; leave it out."),
    (["--tp-timeout", "60"], "--tp-timeout goes with --tensor-parallel; leave it out, or add --tensor-parallel."),
])
def test_options_that_do_not_go_with_tensor_parallel_are_one_sentence(tiny, options, sentence):
    store, _, _ = tiny
    done = warm_python.run([sys.executable, "-m", "shardstream", "serve", str(store), *options],
                           capture_output=True, text=True, env=_env(), timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert sentence in " ".join(done.stderr.split())


def test_a_rank_started_with_another_store_is_one_sentence_on_each_rank(tiny, tmp_path):
    """Ranks started without torchrun (a program may): each process's whole output is the refusal."""
    store, _, _ = tiny
    other = tmp_path / "other"
    save_checkpoint("llama", other / "ckpt", seed=1)
    char_tokenizer().save_pretrained(other / "ckpt")
    convert(other / "ckpt", other / "store", progress=False)
    master = str(_free_port())
    processes = [subprocess.Popen([sys.executable, "-m", "shardstream", "serve", str(path), "--tensor-parallel",
                                   "--port", str(_free_port()), "--no-progress"],
                                  env={**_env(), "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": master},
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for rank, path in enumerate([store, other / "store"])]
    for process in processes:
        _, stderr = process.communicate(timeout=240)
        assert process.returncode == 1, stderr
        assert "Traceback" not in stderr
        sentence = " ".join(stderr.split())
        assert f"rank 1 opened {other / 'store'}, another model than rank 0's {store}" in sentence
        assert "start every rank with a copy of the same store" in sentence


def _resident_budgets(process: subprocess.Popen, log: Path, count: int) -> dict[str, int]:
    """The resident budget (MiB) each model in `log` said it keeps blocks within, by who said it
    ("the model", "rank 1 of 2"), once `count` have said it."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert process.poll() is None, log.read_text()[-3000:]
        said = {who: int(mib) for who, mib in RESIDENT.findall(log.read_text())}
        if len(said) == count:
            return said
        time.sleep(0.2)
    raise AssertionError("no resident budget said: " + log.read_text()[-3000:])


def test_auto_residency_of_a_serving_rank_is_its_share_of_serves(tiny, tmp_path):
    """`--max-resident-memory auto` when serving batches: one process keeps blocks within a quarter of what
    generate's `auto` takes, leaving the rest to the KV caches; two ranks on one machine share its memory,
    so each keeps them within half of that, not within generate's share."""
    store, _, _ = tiny
    log = tmp_path / "alone.log"
    with log.open("w") as written:
        alone = warm_python.popen([sys.executable, "-m", "shardstream", "serve", str(store), "--port",
                                   str(_free_port()), "--no-progress", "--max-batch-size", "8"],
                                  stdout=subprocess.DEVNULL, stderr=written, env=_env())
    try:
        one = _resident_budgets(alone, log, 1)["the model"]
    finally:
        alone.terminate()
        alone.wait(timeout=60)
    served = Ranks(store, tmp_path / "ranks.log", "--max-batch-size", "8", "--tp-cache", str(tmp_path / "cache"))
    try:
        ranks = _resident_budgets(served.process, served.log, 2)
    finally:
        served.stop()
    assert ranks.keys() == {"rank 0 of 2", "rank 1 of 2"}
    for budget in ranks.values():   # the memory available moves a little between the starts
        assert 0.3 * one < budget < 0.8 * one, (one, ranks)


def test_ranks_serving_experts_on_demand_answer_transformers_greedy_text(tmp_path):
    """`serve --tensor-parallel --experts on-demand` on a Mixtral whose experts are placed apart: each rank reads
    its own experts as the router picks them; concurrent requests get transformers' greedy text, and /health
    says what rank 0's experts read."""
    store, reference, tokenizer = _tiny_store(tmp_path, "mixtral")
    place_experts(open_store(store), {"hot": "."})
    served = Ranks(store, tmp_path / "serve.log", "--experts", "on-demand", "--max-batch-size", "4",
                   "--model-name", "tiny", "--tp-cache", str(tmp_path / "cache"))
    try:
        client = openai.OpenAI(base_url=served.url + "/v1", api_key="-", max_retries=0, timeout=120)
        with ThreadPoolExecutor(4) as pool:
            texts = list(pool.map(lambda p: client.completions.create(model="tiny", prompt=p, max_tokens=8,
                                                                        temperature=0).choices[0].text, PROMPTS[:4]))
        health = httpx.get(served.url + "/health", timeout=10).json()
    finally:
        served.stop()
    assert texts == [_greedy(reference, tokenizer, prompt, 8) for prompt in PROMPTS[:4]]
    assert health["experts"]["loads"] > 0
    assert [path.name for path in sorted((tmp_path / "cache").glob("*/rank_*"))] == [
        "rank_0_of_2_experts_apart", "rank_1_of_2_experts_apart"]


def test_sigkill_of_rank_1_mid_request_is_a_503_and_the_restarted_group_answers_the_same(ranks):
    served, client, reference, tokenizer = ranks
    before = client.completions.create(model="tiny", prompt="Hello", max_tokens=10, temperature=0).choices[0].text
    long = CONTEXT - 40
    assert 2 not in _greedy_ids(reference, tokenizer, "Hello", long)   # no EOS: the request runs its length
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": long, "temperature": 0}
    events, whole, answered = requests_in_flight_when(served.url, body, lambda: os.kill(served.rank_pid(1), signal.SIGKILL),
                                                      {"Authorization": f"Bearer {KEY}"})
    assert answered < 30   # a reply, not a hang until a timeout
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    # rank 0 learns it from gloo (the connection to rank 1 closed), or first from torchrun's SIGTERM
    assert error["message"].startswith(("the tensor-parallel group failed", "this server is stopping (SIGTERM")), error
    assert error["code"] == "tensor_parallel_unavailable" and error["type"] == "server_error"   # as the 503's
    assert whole["status"] == 503
    assert whole["body"]["error"]["code"] == "tensor_parallel_unavailable"
    assert "retry once /health answers 200" in whole["body"]["error"]["message"]

    seen = served.wait_ready()   # torchrun (--max-restarts 1) started the group again, on the same port
    assert 503 in seen           # "starting" while the new ranks loaded
    again = client.completions.create(model="tiny", prompt="Hello", max_tokens=10, temperature=0).choices[0].text
    assert again == before == _greedy(reference, tokenizer, "Hello", 10)
    log = served.log.read_text()
    assert "exiting with code 1" in log or "this server is stopping (SIGTERM" in log
