"""`shardstream generate`: one prompt with tokens printed as they come, or a prompts file answered
in batches into a JSON-lines file; optionally with a draft model for speculative decoding."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from ..errors import InvalidOption
from ..option_groups import with_groups
from ..options import ConversionOptions, EngineFlags, Sampling, TpCache, refuse_tp_cache, whole_number
from .cli import Source, command_options, open_model

if TYPE_CHECKING:
    from ..stream.engine_options import EngineOptions


@with_groups(sampling=Sampling, engine=EngineFlags, conversion=ConversionOptions)
def generate_command(
    source: Source,
    prompt: Annotated[Optional[str], typer.Option(help="Text to continue.")] = None,
    sampling: Sampling = Sampling(),
    draft: Annotated[Optional[str], typer.Option(help="Draft model for speculative decoding: store, checkpoint folder or Hub id, opened with this model's --compute-dtype, --hf-token, --compression and --sequential.")] = None,
    draft_tokens: Annotated[Optional[int], typer.Option(help="Tokens the draft proposes per target pass (default: 8 when the model streams blocks, else adaptive).",
                                                        callback=whole_number(1))] = None,
    prompts_file: Annotated[Optional[Path], typer.Option(help="Answer every prompt of a .txt (one a line) or .jsonl file, in batches (prompt i sampled with --seed + i).")] = None,
    output: Annotated[Optional[Path], typer.Option(help="JSON-lines answers of --prompts-file; a rerun resumes it.")] = None,
    batch_size: Annotated[int, typer.Option(help="Prompts decoded together with --prompts-file.",
                                            callback=whole_number(1))] = 64,
    engine: EngineFlags = EngineFlags(),
    conversion: ConversionOptions = ConversionOptions(),
    no_progress: Annotated[bool, typer.Option("--no-progress", help="Draw no progress bars.")] = False,
    tensor_parallel: Annotated[bool, typer.Option("--tensor-parallel", help="Run as one rank of `torchrun --nproc-per-node N` (docs/TENSOR_PARALLEL.md); rank 0 prints.")] = False,
    tp_cache: TpCache = None,
) -> None:
    """Generate text from a prompt (tokens printed as produced) or from a file of prompts."""
    from ..serving.text import check_tokenizer_files

    check_tokenizer_files(source)
    if tensor_parallel:
        from .tp_generate import generate_tp, refuse_unsupported

        _check_utf8(prompt or "")
        given = {"--draft": draft, "--prompts-file": prompts_file, "--output": output, "--profile": engine.profile or None}
        refuse_unsupported([name for name, value in given.items() if value is not None])
        if prompt is None:
            raise InvalidOption("--tensor-parallel answers one --prompt; give --prompt TEXT.")
        options = command_options(engine)   # one sequence
        generate_tp(source, prompt, sampling, engine.device, not no_progress, options, conversion, tp_cache)
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
        # the batches end with a line of throughput, not a per-block table per step (offline.answer_file)
        options = command_options(replace(engine, profile=False),
                                  batch_size=min(batch_size, max(1, len(prompts) - done)))
        with rerun_continues(), open_model(source, conversion, options, engine.device, not no_progress) as model:
            answer_file(model, prompts_file, prompts, done, output, batch_size, sampling.request_defaults(),
                        sampling.seed, not no_progress)
        return
    if output is not None:
        raise InvalidOption("--output goes with --prompts-file; with --prompt the text is printed.")
    _check_utf8(prompt)
    _one_prompt(source, prompt, sampling, draft, draft_tokens, command_options(engine), engine.device,
                not no_progress, conversion)


def _check_utf8(prompt: str) -> None:
    """A byte that is not UTF-8 reaches Python as a lone surrogate (surrogateescape), which no tokenizer takes."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as error:
        byte = ord(prompt[error.start]) - 0xDC00   # surrogateescape's code for the byte
        raise InvalidOption(f"--prompt is not UTF-8 text (byte 0x{byte:02X} at character {error.start}); "
                            "give the prompt in UTF-8, or convert it first (iconv -t UTF-8).") from None


def _one_prompt(source: str, prompt: str, sampling: Sampling, draft: str | None, draft_tokens: int | None,
                engine: EngineOptions, device: str, progress: bool, conversion: ConversionOptions) -> None:
    import sys
    from contextlib import ExitStack

    from .draft import PassReport, draft_options, open_draft
    from ..serving.text import generate_one, load_tokenizer

    with ExitStack() as stack:
        model = stack.enter_context(open_model(source, conversion, engine, device, progress))
        tokenizer = load_tokenizer(model)

        def assisted() -> dict:
            draft_model = stack.enter_context(open_draft(draft, device, draft_tokens, progress, model, conversion))
            return draft_options(tokenizer, model, draft_model)

        new = generate_one(model, tokenizer, prompt, **sampling.keywords(),
                           more_options=assisted if draft is not None else None)
        if engine.profiling_mode:
            print(PassReport(new.shape[1], model.forward_passes).line(), file=sys.stderr)
