"""The `generate` command on a tiny llama with a character tokenizer (the server: test_serving_server.py)."""

from __future__ import annotations

import json
import signal
import subprocess
import time

import pytest
import warm_python

from shardstream.errors import InvalidOption
from shardstream.front.generate_cli import generate_command
from test_data_cli import _default_sigint
from tiny_models import endless_llama_store, llama_store_with_tokenizer

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


def test_a_prompt_the_tokenizer_makes_nothing_of_is_refused(tiny):
    store, _, _ = tiny
    with pytest.raises(InvalidOption, match="the prompt gives no tokens with this model's tokenizer"):
        generate_command(str(store), prompt="\u20ac\u20ac", max_new_tokens=2)   # the char tokenizer knows no euro sign


def test_a_long_prompt_gets_our_error_without_transformers_warning_first(tiny, capfd, caplog):
    """transformers warns "Token indices sequence length is longer..." when a tokenizer with a
    model_max_length encodes a longer text; our own context check says what to do, so only it speaks."""
    store, _, _ = tiny
    config = store / "tokenizer_config.json"
    original = config.read_text()
    config.write_text(json.dumps({**json.loads(original), "model_max_length": 64}))
    try:
        with pytest.raises(InvalidOption, match="context"):
            generate_command(str(store), prompt="x" * 70, max_new_tokens=2)
    finally:
        config.write_text(original)
    assert "Token indices sequence length" not in capfd.readouterr().err + caplog.text


def test_generate_command_stops_at_a_stop_string_and_leaves_it_out(tiny, capsys):
    store, reference, tokenizer = tiny
    expected = _greedy_text(reference, tokenizer, PROMPT, 12)
    stop = expected[4:6]
    generate_command(str(store), prompt=PROMPT, max_new_tokens=12, stop=["never there", stop])
    assert capsys.readouterr().out.rstrip("\n") == expected[:expected.index(stop)]


def test_generate_command_top_k_one_is_greedy(tiny, capsys):
    store, reference, tokenizer = tiny
    generate_command(str(store), prompt=PROMPT, max_new_tokens=8, temperature=1.5, top_k=1, seed=3)
    assert capsys.readouterr().out.strip() == _greedy_text(reference, tokenizer, PROMPT, 8).strip()
    with pytest.raises(InvalidOption, match="top_k must be >= 0"):
        generate_command(str(store), prompt=PROMPT, temperature=1.0, top_k=-1)


def test_generate_command_with_a_draft_prints_the_same_text_and_tokens_per_pass(tiny, capsys):
    store, reference, tokenizer = tiny
    generate_command(str(store), prompt=PROMPT, max_new_tokens=16, draft=str(store), draft_tokens=4,
                     profile=True, no_progress=True)
    captured = capsys.readouterr()
    assert captured.out.strip() == _greedy_text(reference, tokenizer, PROMPT, 16).strip()
    assert "16 new tokens in 4 target passes (weight reads): 4.00 tokens per pass" in captured.err


@pytest.mark.parametrize("options, words", [
    ({}, "either --prompt or --prompts-file"),
    ({"prompt": PROMPT, "prompts_file": "p.txt", "output": "a.jsonl"}, "either --prompt or --prompts-file"),
    ({"prompts_file": "p.txt"}, "--prompts-file needs --output"),
    ({"prompt": PROMPT, "output": "a.jsonl"}, "--output goes with --prompts-file"),
    ({"prompts_file": "p.txt", "output": "a.jsonl", "draft": "d"}, "--draft works with --prompt only"),
    ({"prompt": PROMPT, "draft": "d", "draft_tokens": 0}, "--draft-tokens must be at least 1"),
    ({"prompt": PROMPT, "max_host_memory": "1GB"}, "--max-host-memory applies only with --device cuda"),
    ({"prompt": PROMPT, "max_host_memory": "lots"}, "--max-host-memory"),
    ({"prompt": PROMPT, "max_expert_memory": "1GB"}, "--max-expert-memory applies only with --experts on-demand"),
])
def test_generate_command_refuses_conflicting_options(tiny, options, words):
    store, _, _ = tiny
    with pytest.raises(InvalidOption, match=words):
        generate_command(str(store), **options)


def test_a_prompt_that_is_not_utf8_is_one_line_and_exit_1(tiny):
    """A Latin-1 byte in --prompt (as a shell in another locale passes it) is one line naming it, not a traceback."""
    shardstream = warm_python.SCRIPT
    done = subprocess.run([shardstream, "generate", str(tiny[0]), "--prompt", b"caf\xe9"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        "error: --prompt is not UTF-8 text (byte 0xE9 at character 3); give the prompt in UTF-8, or convert it "
        "first (iconv -t UTF-8)."]


@pytest.mark.parametrize("command", [
    ["generate", "--prompt", "hi"],
    ["generate", "--prompts-file", "PROMPTS", "--output", "ANSWERS"],
    ["serve", "--port", "0"],
    ["generate", "--prompt", "hi", "--tensor-parallel"],
    ["serve", "--port", "0", "--tensor-parallel"],
])
def test_a_store_without_tokenizer_files_is_one_line_and_exit_1_before_loading(tmp_path, command):
    """transformers builds an empty tokenizer from a folder with none of its files (a checkpoint written
    without them, as scripts/real_shapes.py writes), and its empty prompt was a reshape traceback. The
    commands that need text say so before the model loads: with a block's file gone too, the tokenizer is
    what they name, and the model's compute dtype (said as it loads) is never said."""
    from shardstream.convert import convert
    from tiny_models import save_checkpoint

    save_checkpoint("qwen2", tmp_path / "ckpt")
    store = tmp_path / "store"
    convert(tmp_path / "ckpt", store, progress=False)
    (store / "mid" / "0" / "weights.safetensors").unlink()
    (tmp_path / "prompts.txt").write_text("hi\n")
    names = {"PROMPTS": str(tmp_path / "prompts.txt"), "ANSWERS": str(tmp_path / "answers.jsonl")}
    done = warm_python.run([warm_python.SCRIPT, command[0], str(store), *(names.get(a, a) for a in command[1:]),
                            "--no-progress"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        f"error: the store at {store} has no usable tokenizer files (none of tokenizer.json, "
        "vocab.json, vocab.txt, tokenizer.model, spiece.model); copy tokenizer.json and tokenizer_config.json "
        "from the checkpoint into it."]


@pytest.fixture(scope="module")
def endless(tmp_path_factory):
    return endless_llama_store(tmp_path_factory.mktemp("endless"), 4096)[0]


@pytest.mark.parametrize("mode, said", [
    ("prompt", "interrupted."),
    ("prompts-file", "interrupted; re-run the same command to continue where it stopped."),
])
def test_ctrl_c_on_generate_says_whether_running_it_again_continues(endless, tmp_path, mode, said):
    """One prompt leaves nothing a rerun continues (it was told to re-run "to continue where it stopped");
    an answers file keeps the answers written, and its rerun goes on from them."""
    prompts, answers = tmp_path / "prompts.jsonl", tmp_path / "answers.jsonl"
    prompts.write_text('{"prompt": "Hi", "max_tokens": 1}\n{"prompt": "Hello"}\n')
    given = ["--prompt", "Hello"] if mode == "prompt" else ["--prompts-file", str(prompts), "--output", str(answers),
                                                           "--batch-size", "1"]
    shardstream = warm_python.SCRIPT
    process = subprocess.Popen([shardstream, "generate", str(endless), *given, "--max-new-tokens", "4000",
                                "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=_default_sigint)
    try:
        if mode == "prompt":
            assert process.stdout.read(1)   # its tokens are coming
        else:
            deadline = time.monotonic() + 120
            while not (answers.exists() and answers.read_text()):   # the first answer is written
                assert process.poll() is None and time.monotonic() < deadline
                time.sleep(0.1)
        process.send_signal(signal.SIGINT)
        interrupted = time.monotonic()
        _, err = process.communicate(timeout=60)
        stopped_after = time.monotonic() - interrupted
    finally:
        process.kill()
    assert process.returncode == 130 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == said
    # the answer in flight is ended, not run out: its 4000 tokens take far longer than this
    assert stopped_after < 10, stopped_after
