"""Offline batches: `shardstream generate --prompts-file`, its answers file, and resuming after a SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from shardstream.errors import InvalidOption, OutputMismatch
from shardstream.front.generate_cli import generate_command
from shardstream.serving.offline import Prompt, length_order, read_prompts, resume
from tiny_models import llama_store_with_tokenizer
import warm_python

PROMPTS = ["Hello, world", "abc", "The quick brown fox jumps", "x", "Streaming is fun", "0123456789 0123"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return llama_store_with_tokenizer(tmp_path_factory.mktemp("offline"))


def _cli(*args: str, **kwargs) -> subprocess.CompletedProcess | subprocess.Popen:
    command = [sys.executable, "-m", "shardstream.cli", "generate", *args, "--no-progress"]
    if kwargs.pop("background", False):
        return warm_python.popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    return warm_python.run(command, capture_output=True, text=True, timeout=300)


def _greedy_alone(reference, tokenizer, prompt: str, new_tokens: int) -> str:
    ids = tokenizer(prompt, return_tensors="pt")
    out = reference.generate(**ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)


def test_txt_and_jsonl_prompts_are_read_with_their_fields(tmp_path):
    txt = tmp_path / "p.txt"
    txt.write_text("first\n\nsecond\n")
    assert [(p.index, p.text) for p in read_prompts(txt)] == [(0, "first"), (1, "second")]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "a", "id": "q1", "max_tokens": 3, "stop": ["."]}\n\n{"prompt": "b"}\n')
    prompts = read_prompts(jsonl)
    assert prompts[0] == Prompt(0, "a", "q1", {"max_tokens": 3, "stop": ["."]}) and prompts[1].index == 1


@pytest.mark.parametrize("name, body, words", [
    ("p.jsonl", '{"prompt": "a"}\nnot json\n', "p.jsonl line 2 is not valid JSON"),
    ("p.jsonl", '{"text": "a"}\n', 'line 1 needs a non-empty string field "prompt"'),
    ("p.jsonl", '{"prompt": "a", "temprature": 1}\n', "line 1 has unknown fields \\['temprature'\\]"),
    ("p.jsonl", '{"prompt": "a", "max_tokens": "9"}\n', "line 1: field 'max_tokens' has the wrong type"),
    ("p.csv", "a\n", "must end in .txt"),
    ("p.txt", "\n\n", "holds no prompts"),
])
def test_a_bad_prompts_file_is_refused_with_its_line(tmp_path, name, body, words):
    (tmp_path / name).write_text(body)
    with pytest.raises(InvalidOption, match=words):
        read_prompts(tmp_path / name)


def _answer(index: int, text: str) -> str:
    return json.dumps({"index": index, "prompt": text, "text": "...", "finish_reason": "length"}) + "\n"


def test_resume_keeps_whole_answers_and_drops_a_torn_last_line(tmp_path):
    prompts = [Prompt(i, t) for i, t in enumerate(PROMPTS)]
    output = tmp_path / "a.jsonl"
    assert resume(output, prompts) == 0
    whole = _answer(0, PROMPTS[0]) + _answer(1, PROMPTS[1])
    output.write_text(whole + _answer(2, PROMPTS[2])[:17])
    assert resume(output, prompts) == 2 and output.read_text() == whole


def test_resume_refuses_an_output_of_another_prompts_file(tmp_path):
    output = tmp_path / "a.jsonl"
    output.write_text(_answer(0, "something else"))
    with pytest.raises(OutputMismatch, match="a.jsonl line 1 is not the answer to prompt 0 of this prompts file"):
        resume(output, [Prompt(0, PROMPTS[0])])


def test_resume_refuses_an_output_that_is_a_folder(tmp_path):
    """It was an IsADirectoryError traceback."""
    with pytest.raises(InvalidOption, match=f"--output {tmp_path} is a folder; give the .jsonl file the answers go to"):
        resume(tmp_path, [Prompt(0, PROMPTS[0])])


def test_length_order_sorts_within_windows_only():
    prompts = [Prompt(i, "x" * n) for i, n in enumerate([5, 1, 3, 9, 2, 8, 7, 4, 6])]
    lengths = [len(p.text) for p in prompts]
    order = [p.index for p in length_order(prompts, lengths, batch_size=1)]  # windows of 4 prompts
    assert order == [1, 2, 0, 3, 4, 7, 6, 5, 8]


def test_the_command_answers_every_prompt_in_input_order_like_generate_alone(tiny, tmp_path):
    store, reference, tokenizer = tiny
    (tmp_path / "p.jsonl").write_text("".join(
        json.dumps({"prompt": p, **({"id": "last", "max_tokens": 3} if i == len(PROMPTS) - 1 else {})}) + "\n"
        for i, p in enumerate(PROMPTS)))
    generate_command(str(store), prompts_file=tmp_path / "p.jsonl", output=tmp_path / "a.jsonl", batch_size=4,
                     max_new_tokens=8, no_progress=True)
    answers = [json.loads(line) for line in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert [a["index"] for a in answers] == list(range(len(PROMPTS)))
    for answer, prompt in zip(answers, PROMPTS):
        tokens = 3 if answer.get("id") == "last" else 8
        assert answer["prompt"] == prompt
        assert answer["text"] == _greedy_alone(reference, tokenizer, prompt, tokens)
        assert answer["finish_reason"] == "length" and answer["completion_tokens"] == tokens
        assert answer["prompt_tokens"] == len(tokenizer(prompt)["input_ids"])
    assert answers[-1]["id"] == "last"


def test_a_stop_string_ends_one_answer(tiny, tmp_path):
    store, reference, tokenizer = tiny
    expected = _greedy_alone(reference, tokenizer, PROMPTS[0], 12)
    stop = expected[5:7]
    (tmp_path / "p.txt").write_text(PROMPTS[0] + "\n")
    generate_command(str(store), prompts_file=tmp_path / "p.txt", output=tmp_path / "a.jsonl", max_new_tokens=12,
                     stop=[stop], no_progress=True)
    answer = json.loads((tmp_path / "a.jsonl").read_text())
    assert answer["text"] == expected[:expected.index(stop)] and answer["finish_reason"] == "stop"


def test_a_user_mistake_is_one_line_and_exit_1(tiny, tmp_path):
    store, _, _ = tiny
    (tmp_path / "p.txt").write_text("hello\n")
    (tmp_path / "a.jsonl").write_text(_answer(0, "other"))
    result = _cli(str(store), "--prompts-file", str(tmp_path / "p.txt"), "--output", str(tmp_path / "a.jsonl"))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "is not the answer to prompt 0 of this prompts file" in result.stderr


def test_resume_after_a_sigkill_gives_the_file_of_an_uninterrupted_run(tiny, tmp_path):
    store, _, _ = tiny
    prompts = tmp_path / "p.txt"
    prompts.write_text("".join(f"{PROMPTS[i % len(PROMPTS)]} {i}\n" for i in range(24)))
    args = [str(store), "--prompts-file", str(prompts), "--batch-size", "4", "--max-new-tokens", "16",
            "--temperature", "0.9", "--seed", "5", "--max-resident-memory", "0"]
    generate_command(str(store), prompts_file=prompts, output=tmp_path / "whole.jsonl", batch_size=4,
                     max_new_tokens=16, temperature=0.9, seed=5, max_resident_memory="0", no_progress=True)
    output = tmp_path / "resumed.jsonl"
    process = _cli(*args, "--output", str(output), background=True)
    deadline = time.monotonic() + 120
    while not (output.exists() and output.read_text().count("\n") >= 4) and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    lines = output.read_text().count("\n")
    assert 4 <= lines < 24, "the run must be killed midway"
    again = _cli(*args, "--output", str(output))
    assert again.returncode == 0, again.stderr
    assert output.read_text() == (tmp_path / "whole.jsonl").read_text()
