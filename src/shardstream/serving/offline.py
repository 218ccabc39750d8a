"""Offline batches: a prompts file in, one JSON answer a line out, resumable after a crash.

Every prompt runs through the continuous-batching engine, so each block read serves the whole
batch. Answers are written in input order, each line flushed and fsynced before the next, so a
crash leaves a prefix of whole lines (at worst one torn last line, dropped on resume). A rerun
keeps the lines that match the prompts file and carries on after them.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import InvalidOption, OutputMismatch

SAMPLING_FIELDS = {"max_tokens": int, "temperature": (int, float), "top_p": (int, float), "top_k": int,
                   "seed": int, "stop": list}
WINDOW = 4  # batches' worth of prompts sorted by length together (bounds the answers held for in-order writing)


@dataclass(frozen=True)
class Prompt:
    index: int
    text: str
    id: str | int | None = None
    fields: dict = field(default_factory=dict)   # per-prompt overrides of the command's sampling options


def read_prompts(path: Path) -> list[Prompt]:
    """txt: one prompt a line (blank lines skipped); jsonl: {"prompt": ..., optional id and sampling fields}."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise InvalidOption(f"--prompts-file {path} cannot be read ({error}); give a UTF-8 .txt or .jsonl file.") from None
    if path.suffix == ".jsonl":
        prompts = [_json_prompt(path, number, line) for number, line in enumerate(lines, 1) if line.strip()]
        prompts = [Prompt(i, p.text, p.id, p.fields) for i, p in enumerate(prompts)]
    elif path.suffix == ".txt":
        prompts = [Prompt(i, line) for i, line in enumerate(line for line in lines if line.strip())]
    else:
        raise InvalidOption(f"--prompts-file {path} must end in .txt (one prompt a line) or .jsonl.")
    if not prompts:
        raise InvalidOption(f"--prompts-file {path} holds no prompts; write one prompt a line.")
    return prompts


def _json_prompt(path: Path, number: int, line: str) -> Prompt:
    where = f"{path} line {number}"
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        raise InvalidOption(f"{where} is not valid JSON; write one {{\"prompt\": ...}} object a line.") from None
    if not isinstance(record, dict) or not isinstance(record.get("prompt"), str) or not record["prompt"]:
        raise InvalidOption(f"{where} needs a non-empty string field \"prompt\".")
    unknown = set(record) - set(SAMPLING_FIELDS) - {"prompt", "id"}
    if unknown:
        raise InvalidOption(f"{where} has unknown fields {sorted(unknown)}; allowed: id, prompt, {', '.join(SAMPLING_FIELDS)}.")
    for name, kind in SAMPLING_FIELDS.items():
        if name in record and (not isinstance(record[name], kind) or isinstance(record[name], bool)):
            raise InvalidOption(f"{where}: field {name!r} has the wrong type ({record[name]!r}).")
    if not all(isinstance(s, str) for s in record.get("stop", [])):
        raise InvalidOption(f"{where}: field 'stop' must be a list of strings.")
    fields = {k: v for k, v in record.items() if k in SAMPLING_FIELDS}
    return Prompt(0, record["prompt"], record.get("id"), fields)


def resume(output: Path, prompts: list[Prompt]) -> int:
    """How many answers `output` already holds; drops a torn last line, refuses another file's answers."""
    if output.is_dir():
        raise InvalidOption(f"--output {output} is a folder; give the .jsonl file the answers go to, "
                            f"such as {output / 'answers.jsonl'}.")
    if not output.exists():
        return 0
    data = output.read_bytes()
    whole = data[:data.rfind(b"\n") + 1]
    lines = whole.decode("utf-8", errors="replace").splitlines()
    for number, line in enumerate(lines):
        try:
            answer = json.loads(line)
        except json.JSONDecodeError:
            answer = None
        if (not isinstance(answer, dict) or number >= len(prompts) or answer.get("index") != number
                or answer.get("prompt") != prompts[number].text):
            raise OutputMismatch(
                f"--output {output} line {number + 1} is not the answer to prompt {number} of this prompts file; "
                "choose another --output, or delete the file to start over."
            )
    if len(whole) < len(data):
        with open(output, "r+b") as file:
            file.truncate(len(whole))
            os.fsync(file.fileno())
    return len(lines)


def length_order(prompts: list[Prompt], lengths: list[int], batch_size: int) -> list[Prompt]:
    """Windows of WINDOW batches, each sorted by prompt length: batches of like lengths pad less,
    and answers wait at most one window to be written in input order."""
    size = batch_size * WINDOW
    order = []
    for start in range(0, len(prompts), size):
        window = range(start, min(start + size, len(prompts)))
        order += sorted((prompts[i] for i in window), key=lambda p: lengths[p.index])
    return order


class AnswerWriter:
    """Appends answers in input order; each line is flushed and fsynced before the next."""

    def __init__(self, output: Path):
        output.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(output, "a", encoding="utf-8")

    def write(self, answer: dict) -> None:
        self._file.write(json.dumps(answer, ensure_ascii=False) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()


class Progress:
    """Prompts done and tokens/s on stderr; not drawn when stderr is not a terminal or when asked."""

    def __init__(self, total: int, done: int, enabled: bool):
        from tqdm import tqdm

        self.tokens, self.started = 0, time.perf_counter()
        self._bar = tqdm(total=total, initial=done, unit="prompt", desc="prompts",
                         disable=not (enabled and sys.stderr.isatty()))

    def advance(self, tokens: int) -> None:
        self.tokens += tokens
        rate = self.tokens / max(time.perf_counter() - self.started, 1e-9)
        self._bar.set_postfix_str(f"{rate:.1f} tok/s", refresh=False)
        self._bar.update(1)

    def close(self) -> None:
        self._bar.close()


def run_batch(prompts: list[Prompt], done: int, answer: Callable[[Prompt], dict], abort: Callable[[], None],
              output: Path, batch_size: int, lengths: list[int], progress: bool) -> Progress:
    """Answer prompts[done:] with `batch_size` in flight, writing each answer in input order.
    On an error or Ctrl-C, `abort` (closing the engine) ends the answers still running."""
    bar = Progress(len(prompts), done, progress)
    writer = AnswerWriter(output)
    pool = ThreadPoolExecutor(max_workers=batch_size, thread_name_prefix="offline")
    futures: dict[int, Future] = {}
    try:
        for prompt in length_order(prompts[done:], lengths, batch_size):
            future = pool.submit(answer, prompt)
            future.add_done_callback(lambda f: f.cancelled() or f.exception() or bar.advance(f.result()["completion_tokens"]))
            futures[prompt.index] = future
        for index in range(done, len(prompts)):
            writer.write(futures[index].result())   # kept in `futures` until written: Ctrl-C while waiting aborts it
            del futures[index]
        return bar
    finally:
        for future in futures.values():
            future.cancel()
        if futures:
            abort()
        pool.shutdown(wait=True)
        writer.close()
        bar.close()


class Answerer:
    """One prompt through the engine: its tokens, its stop strings, its JSON answer line."""

    def __init__(self, engine, tokenizer, defaults: dict, seed: int | None):
        self.engine, self.tokenizer, self.defaults, self.seed = engine, tokenizer, defaults, seed

    def __call__(self, prompt: Prompt) -> dict:
        from .protocol import NO_TOKEN, SamplingParams
        from .stops import StopFilter

        options = {**self.defaults, **prompt.fields}
        seed = options.get("seed", None if self.seed is None else self.seed + prompt.index)
        ids = self.tokenizer(prompt.text)["input_ids"]
        sequence = self.engine.submit(ids, SamplingParams(
            max_new_tokens=options["max_tokens"], temperature=options["temperature"], top_p=options["top_p"],
            top_k=options["top_k"], seed=seed))
        stops = StopFilter(options["stop"])
        tokens: list[int] = []
        text, shown, finish = "", "", None
        for event in sequence:
            if not stops.stopped and event.token != NO_TOKEN:
                tokens.append(event.token)
                decoded = self.tokenizer.decode(tokens, skip_special_tokens=True)
                if not decoded.endswith("\ufffd"):  # a character split over tokens: wait for the rest
                    text += stops.feed(decoded[len(shown):])
                    shown = decoded
                if stops.stopped:
                    sequence.cancel("stop")
            finish = event.finish_reason or finish
        if not stops.stopped:
            text += stops.feed(self.tokenizer.decode(tokens, skip_special_tokens=True)[len(shown):])
        text += stops.flush()
        answer = {"index": prompt.index, "prompt": prompt.text, "text": text, "finish_reason": finish,
                  "prompt_tokens": len(ids), "completion_tokens": len(tokens)}
        return answer if prompt.id is None else {"id": prompt.id, **answer}


def pending(prompts_file: Path, output: Path, batch_size: int) -> tuple[list[Prompt], int]:
    """`generate --prompts-file`, before any model opens: the prompts, and how many `output` holds already."""
    if batch_size < 1:
        raise InvalidOption(f"--batch-size must be at least 1, not {batch_size}.")
    prompts = read_prompts(prompts_file)
    return prompts, resume(output, prompts)


def answer_file(model, prompts_file: Path, prompts: list[Prompt], done: int, output: Path, batch_size: int,
                defaults: dict, seed: int | None, progress: bool) -> None:
    """Answer the prompts after the first `done` with `model` (a streaming model), after checking them all.
    Ends with a line of throughput on stderr (a per-block table per batch step would drown it)."""
    from .batching import BatchEngine
    from .text import eos_ids, load_tokenizer, pad_id, sampling_options

    tokenizer = load_tokenizer(model)
    lengths = []
    for prompt in prompts:
        options = {**defaults, **prompt.fields}
        ids = tokenizer(prompt.text, return_tensors="pt")["input_ids"]
        try:
            sampling_options(options["max_tokens"], options["temperature"], options["top_p"], tokenizer, options["top_k"])
            model.check_length(ids, options["max_tokens"])
        except InvalidOption as error:
            raise InvalidOption(f"{prompts_file} prompt {prompt.index}: {error}") from None
        lengths.append(ids.shape[1])
    engine = BatchEngine(model, eos_token_ids=eos_ids(model, tokenizer), pad_token_id=pad_id(tokenizer),
                         max_batch_size=batch_size)
    try:
        bar = run_batch(prompts, done, Answerer(engine, tokenizer, defaults, seed), engine.close, output,
                        batch_size, lengths, progress)
    finally:
        engine.close()
    seconds = time.perf_counter() - bar.started
    print(f"answered {len(prompts) - done} prompts ({done} were already in {output}): {bar.tokens} tokens in "
          f"{seconds:.1f} s, {bar.tokens / max(seconds, 1e-9):.1f} tok/s, {engine.forward_passes} passes over the "
          f"weights", file=sys.stderr)
