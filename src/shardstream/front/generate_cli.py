"""`shardstream generate`: one prompt with tokens printed as they come, or a prompts file answered
in batches into a JSON-lines file; optionally with a draft model for speculative decoding."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from ..errors import InvalidOption
from ..options import (Compression, HfToken, Revision, Sequential, StorePath, TpCache, real_number, refuse_tp_cache,
                       whole_number)
from .cli import (ComputeDtype, Converting, Device, Experts, HostMemory, Resident, Source, command_options, open_model,
                  refuse_experts_with_tp)

if TYPE_CHECKING:
    from ..stream.engine_options import EngineOptions


def generate_command(
    source: Source,
    prompt: Annotated[Optional[str], typer.Option(help="Text to continue.")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens to generate (per prompt).",
                                                callback=whole_number(1))] = 50,
    temperature: Annotated[float, typer.Option(help="0 = greedy; above 0 samples.", callback=real_number(0))] = 0.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass.", callback=real_number(0, 1, above=True))] = 1.0,
    top_k: Annotated[int, typer.Option(help="Sample from the k most likely tokens; 0 = no limit.",
                                       callback=whole_number(0))] = 0,
    seed: Annotated[Optional[int], typer.Option(help="Seed for sampling (prompt i of a file uses seed + i).",
                                                callback=whole_number(-2**63, 2**64 - 1))] = None,
    stop: Annotated[Optional[list[str]], typer.Option("--stop", help="End at this text, left out of the output; repeatable.")] = None,
    draft: Annotated[Optional[str], typer.Option(help="Draft model for speculative decoding: store, checkpoint folder or Hub id, opened with this model's --compute-dtype, --hf-token, --compression and --sequential.")] = None,
    draft_tokens: Annotated[Optional[int], typer.Option(help="Tokens the draft proposes per target pass (default: 8 when the model streams blocks, else adaptive).",
                                                        callback=whole_number(1))] = None,
    prompts_file: Annotated[Optional[Path], typer.Option(help="Answer every prompt of a .txt (one a line) or .jsonl file, in batches.")] = None,
    output: Annotated[Optional[Path], typer.Option(help="JSON-lines answers of --prompts-file; a rerun resumes it.")] = None,
    batch_size: Annotated[int, typer.Option(help="Prompts decoded together with --prompts-file.",
                                            callback=whole_number(1))] = 64,
    max_resident_memory: Resident = "auto",
    device: Device = "cpu",
    max_host_memory: HostMemory = "auto",
    compute_dtype: ComputeDtype = "auto",
    experts: Experts = "with-block",
    store_path: StorePath = None,
    sequential: Sequential = False,
    compression: Compression = "none",
    revision: Revision = None,
    hf_token: HfToken = None,
    profile: Annotated[bool, typer.Option("--profile", help="Print per-block read/wait/compute times and tokens per target pass.")] = False,
    no_progress: Annotated[bool, typer.Option("--no-progress", help="Draw no progress bars.")] = False,
    tensor_parallel: Annotated[bool, typer.Option("--tensor-parallel", help="Run as one rank of `torchrun --nproc-per-node N` (docs/TENSOR_PARALLEL.md); rank 0 prints.")] = False,
    tp_cache: TpCache = None,
) -> None:
    """Generate text from a prompt (tokens printed as produced) or from a file of prompts."""
    stops = list(stop or [])
    converting = Converting(sequential, compression, revision, hf_token)
    if tensor_parallel:
        from .tp_generate import generate_tp

        _check_utf8(prompt or "")
        refuse_experts_with_tp(experts)
        given = {"--draft": draft, "--prompts-file": prompts_file, "--output": output, "--profile": profile or None}
        generate_tp(source, prompt, max_new_tokens, temperature, top_p, top_k, seed, stops, device, store_path,
                    not no_progress, [name for name, value in given.items() if value is not None], compute_dtype,
                    converting, max_resident_memory, max_host_memory, tp_cache)
        return
    refuse_tp_cache(tp_cache)
    if (prompt is None) == (prompts_file is None):
        raise InvalidOption("give either --prompt or --prompts-file (with --output).")
    if prompts_file is not None:
        if output is None:
            raise InvalidOption("--prompts-file needs --output, the .jsonl file the answers go to.")
        if draft is not None:
            raise InvalidOption("--draft works with --prompt only: speculative decoding runs one sequence at a "
                                "time (see docs/STREAMING.md); drop --draft to batch the prompts file.")
        from ..interrupted import rerun_continues
        from ..serving.offline import answer_file, pending

        prompts, done = pending(prompts_file, output, batch_size)
        engine = command_options(max_resident_memory, max_host_memory, device, compute_dtype, experts,
                                 batch_size=min(batch_size, max(1, len(prompts) - done)))
        with rerun_continues(), open_model(source, store_path, engine, device, not no_progress, converting) as model:
            answer_file(model, prompts_file, prompts, done, output, batch_size, dict(
                max_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, stop=stops),
                seed, not no_progress)
        return
    if output is not None:
        raise InvalidOption("--output goes with --prompts-file; with --prompt the text is printed.")
    _check_utf8(prompt)
    engine = command_options(max_resident_memory, max_host_memory, device, compute_dtype, experts, profile)
    _one_prompt(source, prompt, max_new_tokens, temperature, top_p, top_k, seed, stops, draft, draft_tokens,
                engine, device, store_path, not no_progress, converting)


def _check_utf8(prompt: str) -> None:
    """A byte that is not UTF-8 reaches Python as a lone surrogate (surrogateescape), which no tokenizer takes."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as error:
        byte = ord(prompt[error.start]) - 0xDC00   # surrogateescape's code for the byte
        raise InvalidOption(f"--prompt is not UTF-8 text (byte 0x{byte:02X} at character {error.start}); "
                            "give the prompt in UTF-8, or convert it first (iconv -t UTF-8).") from None


def _one_prompt(source: str, prompt: str, max_new_tokens: int, temperature: float, top_p: float, top_k: int,
                seed: int | None, stops: list[str], draft: str | None, draft_tokens: int | None,
                engine: EngineOptions, device: str, store_path: str | None, progress: bool,
                converting: Converting) -> None:
    import sys
    from contextlib import ExitStack

    from .draft import PassReport, draft_options, open_draft
    from ..serving.stops import stop_streamer
    from ..serving.text import encode, load_tokenizer, sampling_options, set_seed

    with ExitStack() as stack:
        model = stack.enter_context(open_model(source, store_path, engine, device, progress, converting))
        tokenizer = load_tokenizer(model)
        inputs = encode(tokenizer, prompt)
        options = sampling_options(max_new_tokens, temperature, top_p, tokenizer, top_k)
        if stops:
            options.update(stop_strings=stops, tokenizer=tokenizer)
        if draft is not None:
            options.update(draft_options(tokenizer, model, stack.enter_context(open_draft(draft, device, draft_tokens, progress, model, converting))))
        set_seed(seed)
        out = model.generate(**inputs, **options, streamer=stop_streamer(tokenizer, stops))
        if engine.profiling_mode:
            print(PassReport(out.shape[1] - inputs["input_ids"].shape[1], model.forward_passes).line(), file=sys.stderr)
