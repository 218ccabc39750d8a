"""`shardstream serve`: the OpenAI-compatible HTTP API over one streaming model, on the batch engine.

The port is bound before the model loads, so a port in use is said at once, not after a long load.
A signal (Ctrl-C, SIGTERM) stops it promptly: the requests in flight get a 503 (an error event when
streamed), the step in progress gets STOP_S seconds to end, and a second signal ends it at once.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Annotated, Optional

import typer

from ..errors import InvalidOption, ServerStopping
from ..option_groups import Part, with_groups
from ..options import (ConversionOptions, EngineFlags, TpCache, model_names, real_number, refuse_tp_cache, size,
                       whole_number)
from ..sizes import parse_size
from ..serving.endpoint import (Endpoint, bind, log_batch_bounds, read_template, say, say_resident, server_class,
                                stop_on_signals)
from ..switches import API_KEY
from .cli import Source, command_options, open_model

TP_TIMEOUT_S = 300.0   # --tp-timeout: a collective that waits longer means a rank hangs
STOP_S = 10.0          # how long a stop waits for the last replies, then for the engine's step in progress
# serve's --max-resident-memory is told with what its `auto` leaves to the batch
RESIDENT = ("Bytes of blocks kept in memory: auto (with --max-batch-size above 1, out of a quarter of the share that "
            "generate's auto takes: the rest is for the batch), 0 (pure streaming) or a size like 2GB. With "
            "--tensor-parallel, each rank's: the CPU ranks of one machine divide its memory for auto.")


@with_groups(engine=Part(EngineFlags, leave_out=("profile",), help={"max_resident_memory": RESIDENT}),
             conversion=ConversionOptions)
def serve_command(
    source: Source,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on (0: any free one, printed).",
                                      callback=whole_number(0, 65535))] = 8000,
    model_name: Annotated[Optional[list[str]], typer.Option(
        help="Model id(s) clients send as `model` (repeat, or a comma list), all listed by "
             "/v1/models; answers name the first. Default: the store's folder name (a Hub id as given). Any other id is a 404 "
             "model_not_found.")] = None,
    max_batch_size: Annotated[int, typer.Option(help="Most sequences decoded together (each choice of each "
                                                     "request is one); fewer while the memory left cannot hold "
                                                     "their KV caches: the others wait, and stderr says which "
                                                     "bound applied.", callback=whole_number(1))] = 32,
    api_key: Annotated[Optional[str], typer.Option(
        envvar=API_KEY.name, help="Require 'Authorization: Bearer KEY' on every path but /health.")] = None,
    chat_template: Annotated[Optional[Path], typer.Option(
        help="A Jinja chat template file, for a model whose tokenizer has none (else chat is refused).")] = None,
    max_request_size: Annotated[str, typer.Option(
        help="Largest request body accepted (a size like 8MB); a larger one is refused with 413 before it is "
             "read.", callback=size(zero=False))] = "8MB",
    quiet: Annotated[bool, typer.Option("--quiet", help="No line per request.")] = False,
    no_progress: Annotated[bool, typer.Option("--no-progress", help="No progress bar while loading.")] = False,
    engine: EngineFlags = EngineFlags(),
    conversion: ConversionOptions = ConversionOptions(),
    tensor_parallel: Annotated[bool, typer.Option(
        "--tensor-parallel", help="Run as one rank of `torchrun --nproc-per-node N` (docs/TENSOR_PARALLEL.md): "
                                  "rank 0 serves, the other ranks bind no port.")] = False,
    tp_cache: TpCache = None,
    tp_timeout: Annotated[Optional[float], typer.Option(
        help="With --tensor-parallel: seconds a rank waits for the others in a collective before the group counts "
             "as lost (also while a checkpoint is converted at start). Default: 300.",
        callback=real_number(0, above=True))] = None,
) -> None:
    """Serve an OpenAI-compatible API (/v1/completions, /v1/chat/completions, /v1/models, /health)."""
    endpoint = Endpoint(host, port, model_names(model_name, source), max_batch_size, api_key,
                        read_template(chat_template), parse_size(max_request_size, "--max-request-size"), quiet)
    from ..serving.text import check_tokenizer_files

    check_tokenizer_files(source)
    if tensor_parallel:
        timeout = TP_TIMEOUT_S if tp_timeout is None else tp_timeout
        from .tp_serve import serve_tp

        options = command_options(engine)   # for one sequence
        serve_tp(source, endpoint, engine.device, options, conversion, not no_progress, timeout, tp_cache)
        return
    refuse_tp_cache(tp_cache)
    if tp_timeout is not None:
        raise InvalidOption("--tp-timeout goes with --tensor-parallel; leave it out, or add --tensor-parallel.")
    options = command_options(engine, batch_size=max_batch_size)
    listener = bind(host, port)
    from ..listener import server_config
    from ..serving.openai_api import RequestLog
    from ..serving.batching import BatchEngine
    from ..serving.text import eos_ids, load_tokenizer, pad_id

    log_batch_bounds()
    with listener, open_model(source, conversion, options, engine.device, not no_progress) as model:
        say_resident(model)
        tokenizer = load_tokenizer(model)
        engine = BatchEngine(model, eos_token_ids=eos_ids(model, tokenizer), pad_token_id=pad_id(tokenizer),
                             max_batch_size=max_batch_size)
        app = endpoint.app(model, tokenizer, engine)
        say(endpoint.listening(listener.getsockname()[1]))
        server = server_class()(server_config(app if quiet else RequestLog(app), timeout_graceful_shutdown=STOP_S))

        def stop(number: signal.Signals) -> None:
            engine.abort(ServerStopping(f"this server is stopping ({number.name}); send the request again once it "
                                        "is started again."))
            server.should_exit = True

        stop_on_signals(stop)
        try:
            server.run(sockets=[listener])
        finally:
            if not engine.close(STOP_S):
                say("shardstream serve: stopped, leaving the pass in progress unfinished")
                os._exit(0)   # the engine's thread still uses the model: do not close it under the thread
            say("shardstream serve: stopped")
