"""The `generate` command and the OpenAI-compatible server, on a tiny llama with a character tokenizer."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from shardstream.errors import InvalidOption
from shardstream.stream import AutoModel
from shardstream.stream.generate_cli import generate_command
from shardstream.stream.server import _StopFilter, create_app
from shardstream.stream.text import load_tokenizer
from tiny_models import llama_store_with_tokenizer

PROMPT = "Hello, world"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(store path, reference model, tokenizer)."""
    return llama_store_with_tokenizer(tmp_path_factory.mktemp("cli"))


def _greedy_text(reference, tokenizer, prompt: str, new_tokens: int) -> str:
    ids = tokenizer(prompt, return_tensors="pt")
    out = reference.generate(**ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)


def test_generate_command_prints_the_greedy_continuation(tiny, capsys):
    store, reference, tokenizer = tiny
    generate_command(str(store), prompt=PROMPT, max_new_tokens=8, max_resident_memory="0")
    expected = _greedy_text(reference, tokenizer, PROMPT, 8)
    assert expected.strip() and capsys.readouterr().out.strip() == expected.strip()


def test_generate_command_sampling_is_repeatable_with_a_seed(tiny, capsys):
    store, _, _ = tiny
    outputs = []
    for _ in range(2):
        generate_command(str(store), prompt=PROMPT, max_new_tokens=12, temperature=1.5, seed=7)
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1]


def test_generate_command_refuses_a_prompt_beyond_the_context(tiny):
    store, _, _ = tiny
    with pytest.raises(InvalidOption, match="context"):
        generate_command(str(store), prompt="x" * 70, max_new_tokens=2)


@pytest.fixture(scope="module")
def server(tiny):
    store, reference, tokenizer = tiny
    model = AutoModel.from_pretrained(store, max_resident_memory=0)
    app = create_app(model, load_tokenizer(model), "tiny-llama")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    running = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=running.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not running.started and time.monotonic() < deadline:
        time.sleep(0.05)
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
        yield client, reference, tokenizer
    running.should_exit = True
    thread.join(timeout=10)
    model.close()


def _events(response: httpx.Response) -> list:
    lines = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_models_lists_the_served_model(server):
    client, _, _ = server
    assert client.get("/v1/models").json()["data"][0]["id"] == "tiny-llama"


def test_completion_whole_and_streamed_equal_the_reference(server):
    client, reference, tokenizer = server
    expected = _greedy_text(reference, tokenizer, PROMPT, 6)
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    whole = client.post("/v1/completions", json=body).json()
    assert whole["choices"][0]["text"] == expected
    assert whole["usage"] == {"prompt_tokens": len(PROMPT), "completion_tokens": 6, "total_tokens": len(PROMPT) + 6}
    streamed = client.post("/v1/completions", json={**body, "stream": True})
    assert streamed.headers["content-type"].startswith("text/event-stream")
    chunks = _events(streamed)
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")


def test_stop_strings_end_generation_and_are_left_out(server):
    client, reference, tokenizer = server
    full = _greedy_text(reference, tokenizer, PROMPT, 20)
    stop = full[8:10]
    want = full[:full.index(stop)]
    body = {"prompt": PROMPT, "max_tokens": 20, "temperature": 0, "stop": [stop, "never in the text"]}
    whole = client.post("/v1/completions", json=body).json()
    assert whole["choices"][0]["text"] == want and whole["choices"][0]["finish_reason"] == "stop"
    assert whole["usage"]["completion_tokens"] < 20   # generation itself ended at the stop string
    chunks = _events(client.post("/v1/completions", json={**body, "stream": True}))
    assert "".join(c["choices"][0]["text"] for c in chunks) == want
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    unstopped = client.post("/v1/completions", json={**body, "stop": "never in the text"}).json()["choices"][0]
    assert unstopped["text"] == full and unstopped["finish_reason"] == "length"


def test_stop_filter_holds_back_a_possible_stop_string_across_pieces():
    stops = _StopFilter(["END"])
    assert [stops.feed(p) for p in ["abcE", "N", "Dxyz", "more"]] == ["ab", "c", "", ""]
    assert stops.stopped and stops.flush() == ""
    plain = _StopFilter(["END"])
    assert plain.feed("hello E") + plain.feed("N") + plain.flush() == "hello EN" and not plain.stopped


def test_chat_uses_the_plain_fallback_without_a_template(server):
    client, reference, tokenizer = server
    messages = [{"role": "user", "content": "Hi"}]
    expected = _greedy_text(reference, tokenizer, "user: Hi\nassistant:", 5)
    reply = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 5, "temperature": 0}).json()
    assert reply["object"] == "chat.completion"
    assert reply["choices"][0]["message"] == {"role": "assistant", "content": expected}
    streamed = client.post("/v1/chat/completions",
                           json={"messages": messages, "max_tokens": 5, "temperature": 0, "stream": True})
    assert "".join(c["choices"][0]["delta"]["content"] for c in _events(streamed)) == expected


@pytest.mark.parametrize("path,body,status,words", [
    ("/v1/completions", {"max_tokens": 4}, 422, "prompt"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 0}, 422, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 422, "role"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 100}, 400, "at most 62 new tokens"),
    ("/v1/completions", {"prompt": "Hi", "stop": ["a", "b", "c", "d", "e"]}, 422, "at most 4 stop strings"),
    ("/v1/completions", {"prompt": "Hi", "stop": ""}, 422, "none of them empty"),
])
def test_malformed_requests_get_a_clear_error(server, path, body, status, words):
    client, _, _ = server
    response = client.post(path, json=body)
    assert response.status_code == status
    assert words in response.text


def test_invalid_json_is_refused(server):
    client, _, _ = server
    response = client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 422
