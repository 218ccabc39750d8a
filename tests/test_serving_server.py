"""`shardstream serve` as a real process on 127.0.0.1, driven by the official `openai` client and raw
httpx: the OpenAI surface (answered or refused by name), errors, API key, batching, disconnects."""

from __future__ import annotations

import http.client
import json
import select
import signal
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import warm_python
import torch

from shardstream.serving.stops import StopFilter
from tiny_models import endless_llama_store, llama_store_with_tokenizer

KEY = "test-key"
PROMPT = "Hello, world"
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
SHARDSTREAM = warm_python.SCRIPT   # the console script


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Served:
    """A `shardstream serve` subprocess; its stderr goes to a file the tests read."""

    def __init__(self, store: Path, log: Path, *options: str):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        with log.open("w") as written:
            self.process = warm_python.popen([SHARDSTREAM, "serve", str(store), "--port", str(self.port),
                                              "--max-resident-memory", "0", "--no-progress", *options],
                                             stdout=subprocess.DEVNULL, stderr=written)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.process.poll() is None, log.read_text()
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.2)
        raise AssertionError("the server did not start: " + log.read_text())

    def stop(self) -> str:
        self.process.terminate()
        self.process.wait(timeout=30)
        return self.log.read_text()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return llama_store_with_tokenizer(tmp_path_factory.mktemp("serve"))


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    store, reference, tokenizer = tiny
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    served = Served(store, tmp_path_factory.mktemp("log") / "serve.log", "--model-name", "tiny-llama,tiny-alias",
                    "--api-key", KEY, "--chat-template", str(template), "--max-batch-size", "8",
                    "--max-request-size", "4MB")
    http = httpx.Client(base_url=served.url, timeout=60, headers={"Authorization": f"Bearer {KEY}"})
    client = openai.OpenAI(base_url=served.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    yield served, http, client, reference, tokenizer
    http.close()
    served.stop()


def _greedy(reference, tokenizer, prompt: str | list[int], new_tokens: int) -> str:
    ids = torch.tensor([tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else prompt])
    out = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def _events(response: httpx.Response) -> list[dict]:
    lines = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_models_health_and_aliases(server):
    served, http, client, _, _ = server
    assert [m.id for m in client.models.list()] == ["tiny-llama", "tiny-alias"]
    assert httpx.get(served.url + "/health").status_code == 200          # no key needed
    reply = client.completions.create(model="tiny-alias", prompt=PROMPT, max_tokens=2, temperature=0)
    assert reply.model == "tiny-llama"


def test_a_kept_alive_connection_is_not_held_by_nagle(server):
    """Replies on one connection come without waiting for the client's delayed ACK (40 ms on Linux):
    serve's listener is a TCP socket asyncio sets TCP_NODELAY on (listener.py). The fastest of 6 is
    compared, so a loaded machine slowing some of them cannot fail it; with Nagle on, each took 44 ms."""
    served, _, _, _, _ = server
    seconds = []
    with httpx.Client(base_url=served.url, timeout=10) as http:
        for _ in range(6):
            started = time.perf_counter()
            http.get("/health").raise_for_status()
            seconds.append(time.perf_counter() - started)
    assert min(seconds[1:]) < 0.03, seconds


def test_an_idle_kept_alive_connection_outlives_a_client_pools_expiry(server):
    """httpx drops a pooled connection after 5 s idle; a server that closed it at 5 s too could close it
    under a request just sent (the client reads "Server disconnected"). After 6 s idle the connection is
    still open, and answers the next request on it."""
    served, _, _, _, _ = server
    connection = http.client.HTTPConnection("127.0.0.1", served.port, timeout=10)
    try:
        connection.request("GET", "/health")
        assert connection.getresponse().read() == b'{"status":"ok"}'
        time.sleep(6)
        assert select.select([connection.sock], [], [], 0)[0] == []   # a closed connection reads as readable
        opened = connection.sock
        connection.request("GET", "/health")
        assert connection.getresponse().status == 200 and connection.sock is opened
    finally:
        connection.close()


def test_completion_whole_and_streamed_equal_the_reference(server):
    _, http, client, reference, tokenizer = server
    expected = _greedy(reference, tokenizer, PROMPT, 6)
    whole = client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=6, temperature=0)
    assert whole.choices[0].text == expected
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(PROMPT), 6)
    chunks = list(client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=6, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].usage.completion_tokens == 6 and not chunks[-1].choices


def test_prompt_forms_and_n_make_one_choice_each(server):
    _, http, client, reference, tokenizer = server
    ids = tokenizer("ROMEO:")["input_ids"]
    forms = {"ROMEO:": 1, ("ROMEO:", "JULIET:"): 2, tuple(ids): 1, (tuple(ids), tuple(ids)): 2}
    for prompt, count in forms.items():
        as_json = json.loads(json.dumps(prompt))
        reply = client.completions.create(model="tiny-llama", prompt=as_json, max_tokens=4, temperature=0, n=2)
        assert [c.index for c in reply.choices] == list(range(2 * count))
    reply = client.completions.create(model="tiny-llama", prompt=["ROMEO:", "JULIET:"], max_tokens=4, temperature=0)
    assert [c.text for c in reply.choices] == [_greedy(reference, tokenizer, p, 4) for p in ["ROMEO:", "JULIET:"]]
    assert reply.usage.prompt_tokens == len("ROMEO:") + len("JULIET:")
    sampled = client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=8, temperature=1.5, n=3,
                                        seed=5)
    again = client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=8, temperature=1.5, n=3, seed=5)
    assert [c.text for c in sampled.choices] == [c.text for c in again.choices]
    assert len({c.text for c in sampled.choices}) > 1


def test_logprobs_and_echo_match_transformers_log_softmax(server):
    _, http, client, reference, tokenizer = server
    reply = client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3,
                                      echo=True)
    choice = reply.choices[0]
    choice_lp = choice.logprobs
    prompt = torch.tensor([tokenizer(PROMPT)["input_ids"]])
    ids = reference.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, do_sample=False,
                             pad_token_id=0)
    assert choice_lp.tokens == [tokenizer.decode([t]) for t in ids[0]]
    with torch.no_grad():
        logprobs = torch.log_softmax(reference(ids).logits[0].float(), -1)
    assert choice.text.startswith(PROMPT) and choice_lp.token_logprobs[0] is None
    want = [logprobs[i - 1, ids[0, i]].item() for i in range(1, ids.shape[1])]
    assert choice_lp.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
    last_top = choice_lp.top_logprobs[-1]
    best = torch.topk(logprobs[-2], 3)
    want_top = {tokenizer.decode([t]): v for t, v in zip(best.indices.tolist(), best.values.tolist())}
    assert last_top == pytest.approx(want_top, abs=1e-4)      # (tokens that decode alike share one key)
    assert choice_lp.text_offset == [len("".join(choice_lp.tokens[:i])) for i in range(len(choice_lp.tokens))]
    chat = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=3, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 for c in content)
    assert content[0].logprob == pytest.approx(content[0].top_logprobs[0].logprob, abs=1e-5)   # greedy: the best


def test_echo_gives_the_prompt_back_and_offsets_index_the_text(server):
    """A text prompt comes back as sent; a special token (here a BOS sent as an id) is in `tokens` but not in
    the text, and every token's `text_offset` points at it in the text, whole and streamed."""
    _, http, client, reference, tokenizer = server
    ids = [tokenizer.bos_token_id, *tokenizer(PROMPT)["input_ids"]]
    body = dict(model="tiny-llama", prompt=ids, max_tokens=4, temperature=0, logprobs=1, echo=True)
    whole = client.completions.create(**body).choices[0]
    assert whole.text == PROMPT + _greedy(reference, tokenizer, ids, 4)
    tokens, offsets = whole.logprobs.tokens, whole.logprobs.text_offset
    assert tokens[0] == "<s>" and offsets[0] == 0 and whole.logprobs.token_logprobs[0] is None
    assert _at_offsets(whole.text, offsets[1:], tokens[1:]) == tokens[1:]
    chunks = [c.choices[0] for c in client.completions.create(**body, stream=True)]
    assert chunks[0].text == PROMPT and "".join(c.text for c in chunks) == whole.text
    streamed = [(o, t) for c in chunks[1:] if c.logprobs for o, t in zip(c.logprobs.text_offset, c.logprobs.tokens)]
    assert streamed == list(zip(offsets[-4:], tokens[-4:]))
    texted = client.completions.create(**{**body, "prompt": PROMPT}).choices[0]
    assert texted.text == PROMPT + _greedy(reference, tokenizer, PROMPT, 4)
    assert _at_offsets(texted.text, texted.logprobs.text_offset, texted.logprobs.tokens) == texted.logprobs.tokens


def _at_offsets(text: str, offsets: list[int], tokens: list[str]) -> list[str]:
    """What `text` holds where each token is said to start, as long as the token."""
    return [text[o:o + len(t)] for o, t in zip(offsets, tokens)]


def test_stop_strings_end_generation_and_are_left_out(server):
    _, http, client, reference, tokenizer = server
    full = _greedy(reference, tokenizer, PROMPT, 20)
    stop = full[8:10]
    want = full[:full.index(stop)]
    body = dict(model="tiny-llama", prompt=PROMPT, max_tokens=20, temperature=0, stop=[stop, "never in the text"])
    whole = client.completions.create(**body)
    assert whole.choices[0].text == want and whole.choices[0].finish_reason == "stop"
    assert whole.usage.completion_tokens < 20
    chunks = list(client.completions.create(**body, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want and chunks[-1].choices[0].finish_reason == "stop"


def test_chat_template_parts_n_and_role_delta(server):
    _, http, client, reference, tokenizer = server
    expected = _greedy(reference, tokenizer, "user: Hi\nassistant:", 5)
    parts = [{"type": "text", "text": "H"}, {"type": "text", "text": "i"}]
    reply = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": parts}],
                                           max_tokens=5, temperature=0, n=2)
    assert [c.message.content for c in reply.choices] == [expected, expected]
    chunks = list(client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=5, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected


@pytest.mark.parametrize("path,body,status,param,words", [
    ("/v1/completions", {"max_tokens": 4}, 400, "prompt", "must provide a 'prompt'"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 0}, 400, "max_tokens", "max_tokens"),
    ("/v1/completions", {"prompt": "Hi", "temperature": 5}, 400, "temperature", "less than or equal to 2"),
    ("/v1/completions", {"prompt": "Hi", "top_p": 1.5}, 400, "top_p", "top_p"),
    ("/v1/completions", {"prompt": "Hi", "suffix": "end"}, 400, "suffix", "suffix"),
    ("/v1/completions", {"prompt": "Hi", "best_of": 3}, 400, "best_of", "best_of"),
    ("/v1/completions", {"prompt": "Hi", "logit_bias": {"5": 1}}, 400, "logit_bias", "logit_bias"),
    ("/v1/completions", {"prompt": "Hi", "tools": []}, 400, "tools", "unrecognized request argument supplied: tools"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 100}, 400, "max_tokens", "set max_tokens to at most 62"),
    ("/v1/completions", {"prompt": "Hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "at most 4 stop strings"),
    ("/v1/completions", {"prompt": "Hi", "model": "gpt-4"}, 404, "model", "'gpt-4' does not exist"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role", "role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "text": None}]}]},
     400, "messages[0].content", "type 'image_url'"),
    # ids outside the vocabulary (the char tokenizer has 98 tokens) named one by one, as one sentence
    ("/v1/completions", {"prompt": [5, 500, 6]}, 400, "prompt", "prompt has token id 500 at position 1, outside"),
    ("/v1/completions", {"prompt": [[5], [6, -1]]}, 400, "prompt[1]", "prompt[1] has token id -1 at position 1"),
    ("/v1/completions", {"prompt": [5, 98]}, 400, "prompt", "(ids 0 to 97)"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "response_format": {"type": "json_object"}},
     400, "response_format", "response_format type 'json_object' is not supported"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 0, "logprobs": 0}, 400, "max_tokens", "only with echo"),
    ("/v1/completions", {"prompt": "\u00e9"}, 400, "prompt", "prompt gives no tokens"),   # the tokenizer lacks é
])
def test_bad_requests_get_openai_shaped_errors(server, path, body, status, param, words):
    _, http, _, _, _ = server
    response = http.post(path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and words in error["message"]


def test_invalid_json_and_unknown_model_through_the_client(server):
    served, http, client, _, _ = server
    response = http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json"
    for path in ("/v1/completions", "/v1/chat/completions"):   # was "you must provide a 'None' parameter."
        response = http.post(path, headers={"content-type": "application/json"})
        assert response.status_code == 400
        assert response.json()["error"]["message"] == "the request body is empty; send a JSON object."
    for body, kind in ((b"[1, 2]", "application/json"), (b'"x"', "application/json"),
                       (b'{"prompt": "x"}', "text/plain")):   # each was "Input should be a valid dictionary ..."
        response = http.post("/v1/completions", content=body, headers={"content-type": kind})
        assert response.status_code == 400 and response.json()["error"]["message"] == (
            "the request body is not a JSON object; send one, with Content-Type: application/json.")
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=2)
    assert caught.value.code == "model_not_found"


def test_api_key_is_required_when_set(server):
    served, _, _, _, _ = server
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        response = httpx.get(served.url + "/v1/models", headers=headers)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=served.url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_a_disconnected_client_frees_the_server(server):
    """n=8 fills the whole batch (--max-batch-size 8): a newcomer waits for a free slot, so it is only
    fast when the disconnected client's sequences really left the batch."""
    served, http, _, _, _ = server
    busy = {"model": "tiny-llama", "prompt": "x", "max_tokens": 62, "temperature": 0, "n": 8}
    small = {"model": "tiny-llama", "prompt": "y", "max_tokens": 2, "temperature": 0}
    started = time.monotonic()
    assert http.post("/v1/completions", json=busy).status_code == 200
    whole = time.monotonic() - started
    for stream in (False, True):
        with httpx.Client(base_url=served.url, headers=http.headers, timeout=whole / 6) as impatient:
            if stream:   # read the first events, then hang up
                with impatient.stream("POST", "/v1/completions", json={**busy, "stream": True}) as response:
                    next(response.iter_lines())
            else:
                with pytest.raises(httpx.ReadTimeout):
                    impatient.post("/v1/completions", json=busy)
        started = time.monotonic()
        assert http.post("/v1/completions", json=small).status_code == 200
        assert time.monotonic() - started < whole / 2, (stream, whole)
    # the streamed one is logged too (it was not: its last event is never sent), with what it generated
    disconnected = [line for line in served.log.read_text().splitlines() if line.endswith("(client disconnected)")]
    assert len(disconnected) == 1 and disconnected[0].startswith("POST /v1/completions 200 "), disconnected
    assert int(disconnected[0].split()[3]) >= len("x"), disconnected   # its prompt, and what it generated


def test_concurrent_clients_get_their_own_answers(server):
    served, http, client, reference, tokenizer = server
    prompts = [f"{chr(65 + i)}{PROMPT[: i % 7 + 1]}" for i in range(16)]
    expected = [_greedy(reference, tokenizer, p, 8) for p in prompts]

    def ask(i: int) -> str:
        if i % 2:
            chunks = client.completions.create(model="tiny-llama", prompt=prompts[i], max_tokens=8, temperature=0,
                                               stream=True)
            return "".join(c.choices[0].text for c in chunks)
        return client.completions.create(model="tiny-llama", prompt=prompts[i], max_tokens=8, temperature=0).choices[0].text

    with ThreadPoolExecutor(16) as pool:
        assert list(pool.map(ask, range(16))) == expected
    assert http.get("/health").status_code == 200


def test_request_lines_and_a_port_in_use(server, tiny):
    served, http, client, _, _ = server
    client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=3, temperature=0)
    log = served.log.read_text()
    assert f"listening on http://127.0.0.1:{served.port}" in log
    assert f"POST /v1/completions 200 {len(PROMPT) + 3} tokens" in log
    store = tiny[0]
    taken = warm_python.run([SHARDSTREAM, "serve", str(store), "--port", str(served.port)], capture_output=True,
                            text=True, timeout=60)
    assert taken.returncode == 1 and "pick another --port" in taken.stderr + taken.stdout
    assert "Traceback" not in taken.stderr


def test_chat_without_a_template_is_refused(tiny, tmp_path):
    served = Served(tiny[0], tmp_path / "plain.log", "--quiet")
    try:
        response = httpx.post(served.url + "/v1/chat/completions",
                              json={"messages": [{"role": "user", "content": "Hi"}]})
        assert response.status_code == 400 and "--chat-template" in response.json()["error"]["message"]
    finally:
        log = served.stop()
    assert "POST" not in log and "stopped" in log


def test_a_chat_template_that_is_no_template_is_refused_before_serve_starts(tiny, tmp_path):
    """A template Jinja cannot parse was taken, and then every chat request was a 500 with a traceback in
    the log; a template that fails on the messages it is given is a 400 saying so."""
    from transformers import AutoTokenizer

    from shardstream.errors import InvalidOption
    from shardstream.serving.text import chat_prompt

    broken = tmp_path / "broken.jinja"
    broken.write_text("{{ bos_token }}\n{% for m in messages %")
    refused = warm_python.run([SHARDSTREAM, "serve", str(tiny[0]), "--port", "0", "--chat-template", str(broken)],
                              capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    assert f"--chat-template {broken} line 2: unexpected 'end of template'; fix the Jinja template." in refused.stderr
    tokenizer = AutoTokenizer.from_pretrained(tiny[0])
    with pytest.raises(InvalidOption, match="the chat template cannot format these messages: .* 'nonexistent'"):
        chat_prompt(tokenizer, [{"role": "user", "content": "Hi"}], "{{ messages[0].nonexistent.foo }}")


def test_stop_filter_holds_back_a_possible_stop_string_across_pieces():
    stops = StopFilter(["END"])
    assert [stops.feed(p) for p in ["abcE", "N", "Dxyz", "more"]] == ["ab", "c", "", ""]
    assert stops.stopped and stops.flush() == ""
    plain = StopFilter(["END"])
    assert plain.feed("hello E") + plain.feed("N") + plain.flush() == "hello EN" and not plain.stopped


def _peak_rss(process: subprocess.Popen) -> int:
    """The server's peak resident memory so far (VmHWM), in bytes."""
    for line in Path(f"/proc/{process.pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def test_an_oversized_body_is_refused_with_413_before_it_is_read(server):
    """A body is never read whole to be refused: past the limit
    (--max-request-size 4MB here) a body is a 413 at once, declared (the client) or chunked (no
    Content-Length), and the server holds none of it; the connection still serves the next request."""
    served, http, client, _, _ = server
    before = _peak_rss(served.process)
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as caught:
        client.completions.create(model="tiny-llama", prompt="a" * 20_000_000, max_tokens=1)
    assert caught.value.status_code == 413 and time.monotonic() - started < 10
    assert caught.value.code == "request_too_large"
    assert "limit of 4000000 bytes (serve --max-request-size)" in caught.value.message
    chunked = http.post("/v1/completions", content=iter([b'{"prompt": "', b"a" * 5_000_000, b'"}']),
                        headers={"content-type": "application/json"})
    assert chunked.status_code == 413 and "is over this server's limit" in chunked.json()["error"]["message"]
    assert _peak_rss(served.process) - before < 30_000_000
    assert http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}).status_code == 200


def test_a_prompt_too_long_for_the_context_is_refused_before_tokenizing(server):
    """2 MB of text cannot fit 64 tokens (no token is longer than 5 characters): refused by its length
    in characters, without the 2 million token ids tokenizing it would build."""
    served, http, client, _, _ = server
    before = _peak_rss(served.process)
    for path, body in (("/v1/completions", {"prompt": "a" * 2_000_000}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a" * 2_000_000}]})):
        response = http.post(path, json=body)
        error = response.json()["error"]
        assert response.status_code == 400 and error["code"] == "context_length_exceeded"
        assert "has 2000000 characters, more than this model's context of 64 tokens can hold" in error["message"]
    assert _peak_rss(served.process) - before < 30_000_000


def test_a_lone_surrogate_is_a_400_naming_the_field(server):
    """JSON can carry "\\ud800" (as a JavaScript client sends half an emoji), which is no Unicode text: it
    was a 500 with the tokenizer's message. (The Python client cannot send one: it encodes to UTF-8.)"""
    _, http, _, _, _ = server
    for path, body, param, words in (
            ("/v1/completions", {"prompt": "ab\ud800c"}, "prompt", "prompt has a lone surrogate (U+D800) at character 2"),
            ("/v1/completions", {"prompt": ["ok", "\udcff"]}, "prompt[1]", "prompt[1] has a lone surrogate"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi \ud83d"}]}, "messages[0].content",
             "messages[0].content has a lone surrogate (U+D83D)")):
        response = http.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
        error = response.json()["error"]
        assert response.status_code == 400 and error["param"] == param and words in error["message"], response.text


def test_max_tokens_0_with_echo_scores_the_prompt(server):
    """The legacy way to score a prompt: its logprobs and no completion (it was refused; and
    `max_tokens or 16` would have made 0 into 16 tokens)."""
    _, http, client, reference, tokenizer = server
    reply = client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=0, echo=True, logprobs=0,
                                      temperature=0)
    choice = reply.choices[0]
    ids = torch.tensor([tokenizer(PROMPT)["input_ids"]])
    with torch.no_grad():
        logprobs = torch.log_softmax(reference(ids).logits[0].float(), -1)
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert choice.logprobs.tokens == list(PROMPT) and choice.logprobs.token_logprobs[0] is None
    want = [logprobs[i - 1, ids[0, i]].item() for i in range(1, ids.shape[1])]
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(PROMPT), 0)
    plain = client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=0, echo=True)
    assert plain.choices[0].text == PROMPT and plain.choices[0].logprobs is None


def test_response_format_text_is_accepted(server):
    """OpenAI's default response format, which some clients always send."""
    _, http, client, reference, tokenizer = server
    reply = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=3, temperature=0, response_format={"type": "text"})
    assert reply.choices[0].message.content == _greedy(reference, tokenizer, "user: Hi\nassistant:", 3)



@pytest.fixture(scope="module")
def endless(tmp_path_factory):
    return endless_llama_store(tmp_path_factory.mktemp("endless"), 4096)[0]


def requests_in_flight_when(url: str, body: dict, interrupt, headers: dict | None = None) -> tuple[list[str], dict, float]:
    """Sends `body` streamed and whole; once the streamed one decodes, `interrupt()`. Returns the streamed
    reply's events after that, the whole reply (status, body) and the seconds until the streamed one ended."""
    whole: dict = {}

    def ask_whole() -> None:
        reply = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=120)
        whole.update(status=reply.status_code, body=reply.json())

    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, headers=headers,
                      timeout=120) as stream:
        lines = stream.iter_lines()
        for line in lines:   # until the first generated text: the request is decoding
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                break
        asking = threading.Thread(target=ask_whole)
        asking.start()
        time.sleep(0.3)
        interrupt()
        interrupted = time.monotonic()
        events = [line[6:] for line in lines if line.startswith("data: ")]
        answered = time.monotonic() - interrupted
    asking.join(120)
    return events, whole, answered


def test_a_signal_stops_serve_promptly_and_answers_the_requests_in_flight(endless, tmp_path):
    """Ctrl-C waited for every request in flight (78 s for two of 200 tokens of a 0.5B model). Now the
    requests get a 503 `server_stopping` (an error event when streamed) and the server stops at once."""
    served = Served(endless, tmp_path / "serve.log")
    try:
        events, whole, answered = requests_in_flight_when(
            served.url, {"prompt": "Hello", "max_tokens": 4000, "temperature": 0},
            lambda: served.process.send_signal(signal.SIGINT))
        started = time.monotonic()
        served.process.wait(timeout=60)
        stopped = answered + time.monotonic() - started
    finally:
        served.process.kill()
    assert answered < 5 and stopped < 20, (answered, stopped)   # 4,000 tokens took a minute
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "server_stopping" and error["message"].startswith("this server is stopping (SIGINT)")
    assert whole["status"] == 503 and whole["body"]["error"]["code"] == "server_stopping"
    assert served.process.returncode == 0 and served.log.read_text().rstrip().endswith("shardstream serve: stopped")


def test_a_second_signal_stops_serve_at_once(endless, tmp_path):
    """The first signal waits (a while) for a request still being sent; a second one stops the server at once
    (it did nothing: the server waited for that request for ever)."""
    served = Served(endless, tmp_path / "serve.log")
    try:
        with socket.create_connection(("127.0.0.1", served.port)) as client:
            client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                           b"Transfer-Encoding: chunked\r\n\r\n5\r\n{\"pro\r\n")   # and the rest never comes
            time.sleep(0.5)
            served.process.send_signal(signal.SIGINT)
            time.sleep(1)
            assert served.process.poll() is None   # waiting for that request's body
            served.process.send_signal(signal.SIGINT)
            again = time.monotonic()
            served.process.wait(timeout=30)
            assert time.monotonic() - again < 2
    finally:
        served.process.kill()
    assert served.process.returncode == 128 + signal.SIGINT
    assert "shardstream serve: SIGINT again; stopped at once" in served.log.read_text()


def test_health_reports_what_experts_on_demand_read_and_what_their_cache_saved(tmp_path):
    """`serve --experts on-demand`: /health counts the expert files read, the routings served from memory and
    the reads begun ahead of the router; the same request again reads fewer (the experts it routes to were
    kept)."""
    from shardstream.convert import convert
    from tiny_models import char_tokenizer, save_checkpoint

    save_checkpoint("mixtral", tmp_path / "ckpt")
    char_tokenizer().save_pretrained(tmp_path / "ckpt")
    store = tmp_path / "store"
    convert(tmp_path / "ckpt", store, progress=False)
    warm_python.run([SHARDSTREAM, "shard", str(store), "--experts"], check=True, capture_output=True, timeout=240)
    served = Served(store, tmp_path / "serve.log", "--experts", "on-demand")
    try:
        started = httpx.get(served.url + "/health").json()["experts"]   # after the engine's warm-up pass
        body = {"model": "store", "prompt": "hello there", "max_tokens": 4, "temperature": 0}
        first = httpx.post(served.url + "/v1/completions", json=body, timeout=60).json()
        after_one = httpx.get(served.url + "/health").json()["experts"]
        assert after_one["loads"] == after_one["misses"] > started["loads"]
        assert after_one["bytes_read"] > started["bytes_read"]
        assert httpx.post(served.url + "/v1/completions", json=body, timeout=60).json()["choices"] == first["choices"]
        after_two = httpx.get(served.url + "/health").json()["experts"]
        assert after_two["hits"] > after_one["hits"]
        assert after_two["loads"] - after_one["loads"] < after_one["loads"] - started["loads"]
        assert 0 < after_two["hit_rate"] <= 1 and after_two["held_bytes"] <= after_two["budget_bytes"]
        assert 0 < after_two["guessed_right"] <= after_two["guesses"] and after_two["guess_wasted_bytes"] >= 0
    finally:
        served.stop()
