"""`shardstream agent` and `shardstream coordinator`; the lead mounts both on the main typer app.

`python -m shardstream.pipeline.cli agent ...` runs them without the main app (tests, scripts).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional
from urllib.parse import urlsplit

import typer

from ..errors import InvalidOption
from ..option_groups import Part, with_groups
from ..options import EngineFlags, Sampling, http_urls, matching, model_names, whole_number
from ..switches import API_KEY, TOKEN

if TYPE_CHECKING:
    from .coordinator import CoordinatorOptions

Token = Annotated[str, typer.Option(help="Shared secret; every request carries it as a bearer token.",
                                    envvar=TOKEN.name)]
# the most tokens of KV cache a plan budgets for without --context-length (a model's own length when shorter)
DEFAULT_CONTEXT = 2048
# an agent's --compute-dtype is told with what `auto` picks on the CPUs agents run on
AGENT_COMPUTE_DTYPE = ("dtype this agent's stages compute in: auto (bfloat16 where the CPU has bf16 instructions, "
                       "else float32 products from the stored bf16 bytes), float32, bfloat16 or float16.")


@with_groups(engine=Part(EngineFlags, only=("compute_dtype",), help={"compute_dtype": AGENT_COMPUTE_DTYPE}))
def agent_command(
    name: Annotated[str, typer.Option(help="This device's name in plans and --pipeline-order.",
                                      callback=matching(r"\S(.*\S)?", "a name that is not empty nor starts or ends with a space"))],
    token: Token,
    port: Annotated[int, typer.Option(help="Control-plane HTTP port (0: any free one; see --ready-file).",
                                      callback=whole_number(0, 65535))] = 8008,
    host: Annotated[str, typer.Option(help="Address to listen on (0.0.0.0: every interface, to serve other machines).")] = "127.0.0.1",
    data_port: Annotated[Optional[int], typer.Option(help="ZeroMQ port for activations (default: --port + 1, or any free one with --port 0).",
                                                     callback=whole_number(0, 65535))] = None,
    cache_dir: Annotated[Path, typer.Option(help="Where downloaded stages are kept.")] = Path.home() / ".cache" / "shardstream" / "stages",
    advertise: Annotated[bool, typer.Option("--advertise", help="Announce this agent by mDNS (needs zeroconf).")] = False,
    ready_file: Annotated[Optional[Path], typer.Option(help="Once bound, write {\"port\", \"data_port\"} here as JSON.")] = None,
    threads: Annotated[Optional[int], typer.Option(help="torch threads for this agent's stage (default: torch's, one per core); "
                                                       "agents sharing a host should split its cores.")] = None,
    quiet: Annotated[bool, typer.Option("--quiet", help="No line per request (the start and stop lines stay).")] = False,
    max_memory: Annotated[Optional[str], typer.Option(help="Memory this agent process may use in all, e.g. 700MiB or 2GB, as "
                                                           "if in a container that size: it offers the coordinator this less "
                                                           "what the process holds already (Python, torch), or less where its "
                                                           "cgroup or the host's free RAM has less; the plan takes "
                                                           "--mem-fraction of the offer. Planned for, not enforced.")] = None,
    join: Annotated[Optional[str], typer.Option(help="Join the running coordinator at this URL (its --serve-port), "
                                                     "e.g. http://pc.local:8090: it re-plans with this agent (taking it "
                                                     "from any other coordinator) and prints the new plan.",
                                                callback=http_urls)] = None,
    engine: EngineFlags = EngineFlags(),
) -> None:
    """Run a pipeline agent: it loads the stage the coordinator assigns and runs its blocks."""
    import signal

    import uvicorn
    import zmq

    from ..atomic import write_json_atomic
    from ..listener import listening, server_config
    from ..sizes import parse_size
    from ..stream.compute_dtype import parse_compute_dtype
    from ..stream.engine_options import EngineOptions
    from .discovery import advertise_host
    from .local import follow_parent

    follow_parent()
    if not token:
        raise InvalidOption(f"--token is empty; give the agent a shared secret (or set {TOKEN.name}).")
    limit = parse_size(max_memory, "--max-memory") if max_memory is not None else None
    parse_compute_dtype(engine.compute_dtype, "--compute-dtype")
    if threads is not None:
        if threads < 1:
            raise InvalidOption(f"--threads must be at least 1, not {threads}.")
        import torch

        torch.set_num_threads(threads)
    listener = listening(host, port, "the agent", "--port")
    if data_port is None:   # --port 0 asks for free ports: the data port too, not the bound port + 1
        data_port = port + 1 if port else 0
    port = listener.getsockname()[1]
    from .agent import Agent, create_agent_app   # the stages' engine: after a port in use is said at once

    try:
        agent = Agent(name, token, cache_dir, data_port, limit, EngineOptions(compute_dtype=engine.compute_dtype))
    except zmq.ZMQError as error:
        raise InvalidOption(f"the agent cannot bind its data port {data_port} ({error}); pick another --data-port.") from None
    if limit is not None:
        _warn_on_max_memory(max_memory, limit)
    announcer = None
    try:
        if advertise:
            from .discovery import advertise as announce

            announcer = announce(name, port, host)
        if ready_file:
            write_json_atomic(ready_file, {"port": port, "data_port": agent.data_port})
        typer.echo(f"agent {name} listening on http://{host}:{port} (data port {agent.data_port})")
        for stop_signal in (signal.SIGINT, signal.SIGTERM):   # uvicorn re-raises the signal it stopped for:
            signal.signal(stop_signal, _exit_quietly)          # exit through `finally`, not by the signal
        server = uvicorn.Server(server_config(create_agent_app(agent, not quiet)))
        refused: list[Exception] = []
        if join:
            own = host if host not in ("0.0.0.0", "::", "") else advertise_host(urlsplit(join).hostname or "127.0.0.1")
            threading.Thread(target=_join, args=(server, join, f"http://{own}:{port}", token, name, refused),
                             name="join", daemon=True).start()
        server.run(sockets=[listener])
        if refused:
            raise refused[0]
    finally:
        agent.close()
        typer.echo(f"agent {name} stopped")
        if announcer is not None:
            announcer.close()


def _warn_on_max_memory(given: str, limit: int) -> None:
    """--max-memory bounds the whole process: one below what it holds already leaves nothing to plan with."""
    import psutil

    from .planner import format_bytes

    held = psutil.Process().memory_info().rss
    if held >= limit:
        typer.echo(f"warning: --max-memory {given} is less than the {format_bytes(held)} this agent holds already "
                   "(Python, torch); it offers the coordinator no memory.", err=True)


def _exit_quietly(signum: int, frame) -> None:
    raise SystemExit(0)


def _join(server, coordinator: str, own_url: str, token: str, name: str, refused: list[Exception]) -> None:
    """Once the agent listens, ask the coordinator to take it in; print the new plan, or stop the
    agent with the coordinator's reason (kept in `refused`)."""
    import time

    import httpx

    from ..errors import SourceUnreachable
    from .server import JOIN_TIMEOUT

    while not server.started:
        time.sleep(0.05)
    url = coordinator.rstrip("/") + "/v1/agents/join"
    try:
        response = httpx.post(url, json={"url": own_url}, headers={"Authorization": f"Bearer {token}"},
                              timeout=JOIN_TIMEOUT)
    except (httpx.HTTPError, httpx.InvalidURL) as error:
        refused.append(SourceUnreachable(f"the coordinator at {coordinator} could not be reached ({error}); check "
                                         "--join (its --serve-port) and that it runs."))
    else:
        if response.status_code == 200:
            typer.echo(f"agent {name} joined the coordinator at {coordinator} (plan epoch {response.json()['epoch']}):\n"
                       f"{response.json()['table']}")
            return
        refused.append(InvalidOption(
            f"{coordinator} answers no join (HTTP 404): it is not a coordinator's --serve-port; give --join that URL."
            if response.status_code == 404 else
            f"the coordinator at {coordinator} refused to take agent {name} in (HTTP {response.status_code}): "
            f"{_message(response)}"))
    server.should_exit = True


def _message(response) -> str:
    """The sentence in an OpenAI-shaped error (or the body as it is)."""
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:200]


@dataclass(frozen=True)
class Planning:
    """How the coordinator plans the model over the agents: coordinator.CoordinatorOptions, as flags."""

    pipeline_order: Annotated[Optional[str], typer.Option(
        help="Comma-separated agent names in stage order.")] = None
    mem_fraction: Annotated[float, typer.Option(help="Share of each agent's available RAM the plan may use.")] = 0.5
    min_prefix: Annotated[int, typer.Option(
        help="Blocks the first stage (the one with the embeddings) holds at least, on whichever agent it lands: "
             "agents early in --pipeline-order may still be left out (0: no minimum).")] = 0
    context_length: Annotated[Optional[int], typer.Option(
        help="Tokens of KV cache to budget for (default: the model's max_position_embeddings, at most "
             f"{DEFAULT_CONTEXT}).", callback=whole_number(1))] = None
    objective: Annotated[str, typer.Option(help="latency (one stream) or throughput (bottleneck stage).")] = "latency"
    probe_bytes: Annotated[int, typer.Option(
        help="Bytes each agent fetches from each other to measure bandwidth (0: assume 1 Gbit/s).")] = 4 * 2**20
    no_streaming: Annotated[bool, typer.Option(
        "--no-streaming", help="Refuse when the stages do not fit in the agents' memory, instead of letting agents "
                               "stream their blocks from disk (priced by each agent's measured disk read "
                               "speed).")] = False
    work_dir: Annotated[Path, typer.Option(
        help="Where plan.json and the stage packages go.")] = Path("shardstream-pipeline")

    def options(self, root: Path) -> CoordinatorOptions:
        """The coordinator's options these flags give for the store at `root` (imported here: coordinator.py
        loads transformers)."""
        from .coordinator import CoordinatorOptions

        return CoordinatorOptions(
            self.work_dir, mem_fraction=self.mem_fraction, context_length=_context_length(root, self.context_length),
            min_prefix=self.min_prefix, objective=self.objective,
            pipeline_order=self.pipeline_order.split(",") if self.pipeline_order else None,
            bandwidth_probe_bytes=self.probe_bytes, streaming=not self.no_streaming)


@dataclass(frozen=True)
class Serving:
    """Where and how the coordinator serves the OpenAI API (--serve-port)."""

    serve_port: Annotated[Optional[int], typer.Option(
        help="Serve /v1/completions on this port and keep running (0: any free one, printed).",
        callback=whole_number(0, 65535))] = None
    host: Annotated[str, typer.Option(
        help="Address the coordinator listens on (0.0.0.0: every interface; agents fetch stages from it, so "
             "remote agents need it exposed).")] = "127.0.0.1"
    api_key: Annotated[Optional[str], typer.Option(
        envvar=API_KEY.name, help="With --serve-port: require 'Authorization: Bearer KEY' on the API (every path "
                                  "but /health and the agents' /stages, which want --token); without it the API "
                                  "wants --token.")] = None
    model_name: Annotated[Optional[list[str]], typer.Option(
        help="With --serve-port: model id(s) clients send as `model` (repeat, or a comma list), all listed "
             "by /v1/models; answers name the first. Default: the --model folder's name, as serve names it. Any other id is a "
             "404 model_not_found.")] = None
    chat_template: Annotated[Optional[Path], typer.Option(
        help="With --serve-port: a Jinja chat template file, for a model whose tokenizer has none (else chat is "
             "refused).")] = None


@with_groups(planning=Planning, serving=Serving, sampling=Sampling)
def coordinator_command(
    model: Annotated[Path, typer.Option(help="The store folder (output of `shardstream convert`).")],
    token: Token,
    urls: Annotated[Optional[str], typer.Option(help="Comma-separated agent URLs, e.g. http://pi.local:8008.",
                                                callback=http_urls)] = None,
    discover: Annotated[float, typer.Option(help="Also look for agents by mDNS for this many seconds.")] = 0.0,
    planning: Planning = Planning(),
    package: Annotated[bool, typer.Option("--package", help="Package the stages and load them on the agents.")] = False,
    serving: Serving = Serving(),
    generate: Annotated[Optional[str], typer.Option(help="Generate from this prompt (as --max-new-tokens, --temperature, --top-p, --top-k, --seed and --stop say), print it, exit.")] = None,
    sampling: Sampling = Sampling(),
    take_over: Annotated[bool, typer.Option("--take-over", help="Take the agents from the coordinator they serve "
                                            "(that one then answers 503 until they are free again); without it an "
                                            "agent serving another live coordinator is refused.")] = False,
) -> None:
    """Plan the model over the agents; with --package, --generate or --serve-port also deploy and run it."""
    from ..store import open_store
    from ..serving.endpoint import read_template
    from ..serving.text import check_tokenizer_files, generate_one, load_tokenizer
    from .client import AgentClient
    from .coordinator import Coordinator
    from .discovery import advertise_host
    from .discovery import discover as find
    from .generation import PipelineModel
    from .server import BackgroundServer, coordinator_app

    found = list(dict.fromkeys([u.strip() for u in (urls or "").split(",") if u.strip()]
                               + (find(discover) if discover else [])))   # an agent listed twice is one agent
    if not found:
        raise InvalidOption(
            "no agents: give --urls, or --discover SECONDS to find agents started with --advertise"
            + (f" (none answered mDNS within {discover:g} s)." if discover else ".")
        )
    store = open_store(model)
    if generate or serving.serve_port is not None:
        check_tokenizer_files(store.root)
    coordinator = Coordinator(store, [AgentClient(u, token) for u in found], planning.options(store.root))
    try:
        serves = serving.serve_port is not None
        if not (package or generate or serves):
            coordinator.profile()
            typer.echo(coordinator.save_plan(list(coordinator.agents)).table())
            return
        pipeline = PipelineModel(coordinator, advertise_host(next(iter(coordinator.agents.values())).host))
        tokenizer = load_tokenizer(pipeline) if generate or serves else None
        names = model_names(serving.model_name, str(model))
        app = coordinator_app(pipeline, tokenizer, names[0], planning.work_dir / "stages", token,
                              api_key=serving.api_key, aliases=tuple(names[1:]),
                              chat_template=read_template(serving.chat_template))
        try:   # listening first: a port in use is said at once, and /health says "deploying" meanwhile
            server = BackgroundServer(app, serving.host, serving.serve_port or 0)
        except BaseException:
            pipeline.close()
            raise
        try:
            coordinator.stage_url = f"http://{pipeline.reply_host}:{server.port}/stages/"
            if serves:
                typer.echo(f"coordinator on http://{serving.host}:{server.port}: profiling the agents and deploying "
                           "the stages (/health says \"deploying\" until they are loaded)")
            coordinator.claim(take_over)
            coordinator.on_deploy = _print_plan
            coordinator.profile()
            coordinator.deploy()
            if generate:
                generate_one(pipeline, tokenizer, generate, **sampling.keywords())
            if serves:
                secret = "--api-key" if serving.api_key else "--token"
                typer.echo(f"serving /v1/completions on http://{serving.host}:{server.port} (bearer {secret} "
                           f"required; up to {pipeline.engine.max_active} requests in flight)")
                server.wait()
        finally:
            server.stop()
            pipeline.close()
    finally:
        coordinator.close()


def _print_plan(route) -> None:
    """Every new plan as the coordinator deploys it: the first, and each re-plan (an agent lost,
    re-admitted or joined, or stages re-deployed)."""
    if route.epoch:
        typer.echo(f"re-planned (plan epoch {route.epoch}):")
    typer.echo(route.plan.table())


def _context_length(root: Path, given: int | None) -> int:
    """The tokens of KV cache the plan budgets for: --context-length, else the model's own length up to
    DEFAULT_CONTEXT. A length past the model's buys nothing, and is warned about."""
    from transformers import AutoConfig

    limit = getattr(AutoConfig.from_pretrained(root), "max_position_embeddings", None)
    if given is None:
        return min(DEFAULT_CONTEXT, limit or DEFAULT_CONTEXT)
    if limit is not None and given > limit:
        typer.echo(f"warning: --context-length {given} exceeds the model's {limit} tokens "
                   f"(max_position_embeddings); memory is budgeted for {given}.", err=True)
    return given


def main() -> None:
    """`python -m shardstream.pipeline.cli agent|coordinator ...`, errors printed as one line."""
    import sys

    from ..errors import ShardstreamError

    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command("agent")(agent_command)
    app.command("coordinator")(coordinator_command)
    try:
        app()
    except ShardstreamError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
