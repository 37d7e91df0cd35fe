"""`llama-grpc` command line: call a server (generate, stream, chat, tokenize...), `serve` one,
or list and check local `models`.

Reads LLAMA_GRPC_TARGET and LLAMA_GRPC_TOKEN; `serve` and `models` are handed to
llama_grpc_server.cli and llama_grpc_server.models.cli, imported only when asked.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from llama_grpc.client import (
    DEFAULT_TARGET,
    ChatStream,
    Client,
    GenerationParams,
    lora_adapters,
    tool_choice_message,
    tool_message,
)
from llama_grpc.errors import LlamaGrpcError
from llama_grpc.resume import DEFAULT_RESUME_ATTEMPTS
from llama_grpc.tls import TlsConfig
from llama_grpc.types import ChatMessage, Delta, Done, ReasoningDelta, ToolCall, Usage

TARGET_ENV = "LLAMA_GRPC_TARGET"
TOKEN_ENV = "LLAMA_GRPC_TOKEN"
SERVE_HINT = "llama-grpc serve needs the server extra: pip install 'llama-grpc[server]'"
# Commands run by the server package, given the rest of the command line: name -> module.
SERVER_COMMANDS = {"serve": "llama_grpc_server.cli", "models": "llama_grpc_server.models.cli"}
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
# gRPC name resolvers: a --target starting with one is a URI, passed on whole.
URI_SCHEMES = ("dns:", "ipv4:", "ipv6:", "unix:", "unix-abstract:", "vsock:", "xds:")

_Command = Callable[[Client, argparse.Namespace], int]


def _print_json(value: object) -> None:
    data = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value  # type: ignore[arg-type]
    print(json.dumps(data, indent=2, ensure_ascii=False))


def _prompt(args: argparse.Namespace) -> str:
    return sys.stdin.read() if args.prompt == "-" else str(args.prompt)


def _generation_params(args: argparse.Namespace) -> GenerationParams:
    """The sampling flags given on the command line; flags left out stay unset."""
    params = GenerationParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        seed=args.seed,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repeat_penalty=args.repeat_penalty,
        stop=args.stop,
        ignore_eos=args.ignore_eos or None,
        model=args.model,
        session_id=args.session_id,
        priority=args.priority,
        speculative=args.speculative,
        lora=args.lora,
    )
    if getattr(args, "chat_template", None) is not None:
        params["chat_template"] = args.chat_template
    return params


def _summary(done: Done) -> str:
    usage, timings = done.usage, done.timings
    return (
        f"[done] finish_reason={done.finish_reason} prompt_tokens={usage.prompt_tokens} "
        f"completion_tokens={usage.completion_tokens} "
        f"cached_prompt_tokens={usage.cached_prompt_tokens} "
        f"{'cached_response=true ' if usage.cached_response else ''}"
        f"{_draft_counts(usage)}ttft_ms={timings.ttft_ms:.1f} "
        f"total_ms={timings.total_ms:.1f} seed={done.seed} request_id={done.request_id}"
    )


def _draft_counts(usage: Usage) -> str:
    if not usage.draft_tokens:
        return ""
    return f"draft_tokens={usage.draft_tokens} accepted_draft_tokens={usage.accepted_draft_tokens} "


def run_generate(client: Client, args: argparse.Namespace) -> int:
    """Print the whole completion (or the whole result as JSON with --json)."""
    result = client.generate(_prompt(args), **_generation_params(args))
    if args.json:
        _print_json(result)
    else:
        print(result.text)
    return 0


def run_stream(client: Client, args: argparse.Namespace) -> int:
    """Print text as it arrives, then a summary line on stderr."""
    with client.stream(_prompt(args), **_generation_params(args)) as stream:
        for event in stream:
            if isinstance(event, Delta):
                sys.stdout.write(event.text)
                sys.stdout.flush()
            else:
                sys.stdout.write("\n")
                print(_summary(event), file=sys.stderr)
    return 0


CHAT_HELP = """commands: /bye (or end of input) quits, /clear forgets the conversation (keeps the
system prompt), /help prints this"""


class _Quit(Exception):
    """The user ended the conversation (/bye, or end of input where a line was expected)."""


def _load_tools(path: str) -> list[Any]:
    """The tools of --tools FILE: a JSON list of OpenAI tools, or an object with "tools";
    ValueError for anything chat() would refuse."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    tools = data.get("tools") if isinstance(data, dict) else data
    if not isinstance(tools, list):
        raise ValueError(f'{path}: expected a JSON list of tools (or {{"tools": [...]}})')
    for tool in tools:
        if not isinstance(tool, dict):
            raise ValueError(f"{path}: a tool must be a JSON object, not {tool!r}")
        tool_message(tool)
    return tools


def _read_line(prompt: str) -> str:
    """One line of stdin (the prompt shown only on a terminal); _Quit at end of input."""
    if sys.stdin.isatty():
        try:
            return input(prompt)
        except EOFError:
            sys.stdout.write("\n")
            raise _Quit from None
    line = sys.stdin.readline()
    if not line:
        raise _Quit
    return line.removesuffix("\n")


def _call_line(call: ToolCall) -> str:
    return f"[tool call] {call.name}({call.arguments})"


def _ask_tool_results(calls: Sequence[ToolCall]) -> list[ChatMessage]:
    """Each call's result, typed by the user (one line each) as a "tool" message."""
    return [call.result_message(_read_line(f"result of {call.name}> ")) for call in calls]


THINKING_PREFIX = "[thinking] "
DIM, RESET = "\x1b[2m", "\x1b[0m"


class _ThinkingPrinter:
    """Prints a chat answer's thinking apart from its text: on a terminal (NO_COLOR unset)
    dimmed between <think> and </think> lines; otherwise each line prefixed with "[thinking] ".
    Newlines at its start and end are dropped; end() closes it before the answer's text."""

    def __init__(self, *, styled: bool) -> None:
        self.styled = styled
        self.started = False  # something was printed (the opening written)
        self.newlines = 0  # newlines held back until more thinking follows

    def write(self, text: str) -> None:
        for index, part in enumerate(text.split("\n")):
            self.newlines += index > 0
            if part:
                self._line_break()
                sys.stdout.write(part)
        sys.stdout.flush()

    def _line_break(self) -> None:
        """Before more thinking: the opening, or the newlines held back (blank lines kept)."""
        if not self.started:
            self.started = True
            sys.stdout.write(f"{DIM}<think>\n" if self.styled else THINKING_PREFIX)
        elif self.newlines:
            blank = "\n" if self.styled else f"\n{THINKING_PREFIX.rstrip()}"
            prefix = "" if self.styled else THINKING_PREFIX
            sys.stdout.write(blank * (self.newlines - 1) + "\n" + prefix)
        self.newlines = 0

    def end(self) -> None:
        """Close the thinking (once), if any was printed."""
        if self.started:
            sys.stdout.write(f"\n</think>{RESET}\n" if self.styled else "\n")
            sys.stdout.flush()
        self.started, self.newlines = False, 0


def _styled_output() -> bool:
    return sys.stdout.isatty() and not os.environ.get("NO_COLOR")


class _ChatSession:
    """The conversation of `llama-grpc chat`: its history (the system prompt first), tools and
    request parameters; each turn streams the answer to stdout."""

    def __init__(self, client: Client, args: argparse.Namespace, tools: list[Any]) -> None:
        self.client = client
        self.system = [ChatMessage("system", args.system)] if args.system else []
        self.history: list[ChatMessage] = list(self.system)
        self.verbose = bool(args.verbose)
        self.params = _generation_params(args)
        self.tools = tools or None
        self.tool_choice = args.tool_choice
        self.parallel_tool_calls = False if args.no_parallel_tool_calls else None
        self.enable_thinking: bool | None = args.think
        self.reasoning_budget: int | None = args.reasoning_budget
        self.hide_thinking = bool(args.hide_thinking)

    def answer(self) -> tuple[ToolCall, ...]:
        """Stream one answer to the history (printed as it comes; its tool calls printed once
        whole), append it, and return its tool calls."""
        stream: ChatStream = self.client.stream_chat(
            self.history,
            tools=self.tools,
            tool_choice=self.tool_choice,
            parallel_tool_calls=self.parallel_tool_calls,
            enable_thinking=self.enable_thinking,
            reasoning_budget=self.reasoning_budget,
            **self.params,
        )
        thinking = _ThinkingPrinter(styled=_styled_output())
        with stream, contextlib.ExitStack() as cleanup:
            cleanup.callback(thinking.end)  # an error or Ctrl-C inside the thinking closes it
            for event in stream:
                if isinstance(event, ReasoningDelta):
                    if not self.hide_thinking:
                        thinking.write(event.text)
                    continue
                if isinstance(event, Delta) and not event.text:
                    continue  # the tokens of thinking or of a call
                thinking.end()
                if isinstance(event, Delta):
                    sys.stdout.write(event.text)
                    sys.stdout.flush()
                elif isinstance(event, Done):
                    if stream.text and not stream.text.endswith("\n"):
                        sys.stdout.write("\n")
                    if self.verbose:
                        print(_summary(event), file=sys.stderr)
        for call in stream.tool_calls:
            print(_call_line(call), flush=True)
        self.history.append(stream.message())
        return stream.tool_calls

    def turn(self, text: str, *, ask_results: bool) -> None:
        """The user's `text`, then answers until one calls no tool (each call's result asked
        for when `ask_results`; otherwise the turn ends at the first calls)."""
        self.history.append(ChatMessage("user", text))
        calls = self.answer()
        while calls and ask_results:
            self.history.extend(_ask_tool_results(calls))
            calls = self.answer()

    def interactive(self) -> None:
        """Read lines until /bye or the end of input; an error or Ctrl-C during a turn drops
        that turn and goes on."""
        if sys.stdin.isatty():
            with contextlib.suppress(ImportError):  # line editing and history for input()
                importlib.import_module("readline")
            print(CHAT_HELP, file=sys.stderr)
        while True:
            line = _read_line(">>> ").strip()
            if not line:
                continue
            if line.startswith("/"):
                self.command(line)
                continue
            kept = len(self.history)
            try:
                self.turn(line, ask_results=True)
            except LlamaGrpcError as error:
                print(f"error: {error}", file=sys.stderr)
                del self.history[kept:]
            except KeyboardInterrupt:
                sys.stdout.write("\n")
                del self.history[kept:]

    def command(self, line: str) -> None:
        """Run a /command; _Quit for /bye."""
        name = line.split(maxsplit=1)[0]
        if name in {"/bye", "/exit", "/quit"}:
            raise _Quit
        if name == "/clear":
            self.history = list(self.system)
            print("(conversation cleared)", file=sys.stderr)
        elif name in {"/help", "/?"}:
            print(CHAT_HELP, file=sys.stderr)
        else:
            print(f"unknown command {name} ({CHAT_HELP})", file=sys.stderr)


def run_chat(client: Client, args: argparse.Namespace) -> int:
    """Chat with the model: with a prompt, one turn (its tool calls printed, not run);
    without, a conversation read line by line from stdin (/bye or end of input quits,
    /clear forgets), each tool call's result asked for."""
    try:
        tools = _load_tools(args.tools) if args.tools else []
    except (OSError, ValueError) as error:  # json.JSONDecodeError is a ValueError
        print(f"error: --tools: {error}", file=sys.stderr)
        return EXIT_USAGE
    if args.tool_choice is not None:
        try:
            tool_choice_message(args.tool_choice)
        except ValueError as error:
            print(f"error: --tool-choice: {error}", file=sys.stderr)
            return EXIT_USAGE
    if args.reasoning_budget is not None and args.reasoning_budget < -1:
        print("error: --reasoning-budget: -1 (no limit), 0 (no thinking) or more", file=sys.stderr)
        return EXIT_USAGE
    session = _ChatSession(client, args, tools)
    try:
        if args.prompt is not None:
            session.turn(_prompt(args), ask_results=False)
        else:
            session.interactive()
    except _Quit:
        pass
    return 0


def run_tokenize(client: Client, args: argparse.Namespace) -> int:
    """Print the token ids as JSON (with their pieces when --pieces is given)."""
    flags = {"add_special": not args.no_add_special, "parse_special": args.parse_special}
    if args.pieces:
        _print_json(client.tokenize(args.text, return_pieces=True, model=args.model, **flags))
    else:
        print(json.dumps(client.tokenize(args.text, model=args.model, **flags)))
    return 0


def run_embed(client: Client, args: argparse.Namespace) -> int:
    """Print the inputs' embeddings as JSON (EmbedResult: one entry per input, in order)."""
    result = client.embed(
        args.texts,
        pooling=args.pooling,
        normalize=not args.no_normalize,
        dimensions=args.dimensions,
        truncate=args.truncate,
        model=args.model,
    )
    print(json.dumps(dataclasses.asdict(result)))  # one line: vectors are long
    return 0


def run_detokenize(client: Client, args: argparse.Namespace) -> int:
    """Print the text of the given token ids."""
    print(client.detokenize(args.token_ids, render_special=args.render_special, model=args.model))
    return 0


def run_stats(client: Client, args: argparse.Namespace) -> int:
    """Print a model's stats (the default model's without --model) as JSON."""
    _print_json(client.stats(model=args.model))
    return 0


def run_load(client: Client, args: argparse.Namespace) -> int:
    """Print the server's load as JSON lines, one per --interval seconds, until the server
    drains (the last line has "serving": false) or Ctrl-C."""
    with client.watch_load(args.interval, timeout=args.timeout) as reports:
        for report in reports:
            print(json.dumps(dataclasses.asdict(report)), flush=True)
    return 0


def run_info(client: Client, args: argparse.Namespace) -> int:
    """Print a model's info (the default model's without --model) as JSON."""
    _print_json(client.model_info(model=args.model))
    return 0


def run_list_models(client: Client, args: argparse.Namespace) -> int:
    """Admin: print the models the server may serve, with their state, as JSON."""
    _print_json(client.list_models())
    return 0


def run_load_model(client: Client, args: argparse.Namespace) -> int:
    """Admin: load a model on the server now; print its status as JSON."""
    _print_json(client.load_model(args.name))
    return 0


def run_unload_model(client: Client, args: argparse.Namespace) -> int:
    """Admin: unload a model (refused while it has requests in flight, unless --force)."""
    _print_json(client.unload_model(args.name, force=args.force))
    return 0


def run_list_adapters(client: Client, args: argparse.Namespace) -> int:
    """Print a model's LoRA adapters (the default model's without --model) as JSON."""
    _print_json([dataclasses.asdict(adapter) for adapter in client.list_adapters(model=args.model)])
    return 0


def run_load_adapter(client: Client, args: argparse.Namespace) -> int:
    """Admin: load a LoRA adapter GGUF (a path on the server) for a model, served as NAME;
    print it as JSON."""
    _print_json(
        client.load_adapter(args.name, args.path, model=args.model, default_scale=args.scale)
    )
    return 0


def run_unload_adapter(client: Client, args: argparse.Namespace) -> int:
    """Admin: unload a LoRA adapter (requests using it finish with it); print how many those
    are as JSON."""
    _print_json({"in_flight": client.unload_adapter(args.name, model=args.model)})
    return 0


def run_health(client: Client, args: argparse.Namespace) -> int:
    """Print the health status; exit 0 only when SERVING (usable as a probe)."""
    status = client.health(args.service)
    print(status)
    return 0 if status == "SERVING" else EXIT_ERROR


def _connection_parser(default_target: str) -> argparse.ArgumentParser:
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument(
        "--target",
        default=default_target,
        help="server HOST:PORT, a gRPC target URI, or IP:PORT,IP:PORT,... replicas to call round "
        f"robin, skipping those not SERVING (default: ${TARGET_ENV} or {DEFAULT_TARGET})",
    )
    parent.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    parent.add_argument(
        "--resume-attempts",
        type=int,
        default=DEFAULT_RESUME_ATTEMPTS,
        metavar="N",
        help="a stream cut by UNAVAILABLE (a replica drained or went away) is called again with "
        f"the tokens received, at most N times in a row (default {DEFAULT_RESUME_ATTEMPTS}; "
        "0: never)",
    )
    tls = parent.add_argument_group("TLS and authentication (any --tls-* option implies --tls)")
    tls.add_argument("--tls", action="store_true", help="use TLS, trusting the system roots")
    tls.add_argument("--tls-ca", metavar="PATH", help="PEM file of the CA to trust instead")
    tls.add_argument("--tls-cert", metavar="PATH", help="PEM client certificate (mTLS)")
    tls.add_argument("--tls-key", metavar="PATH", help="PEM key of --tls-cert")
    tls.add_argument(
        "--tls-server-name", metavar="NAME", help="name to check in the server certificate"
    )
    tls.add_argument(
        "--token",
        help=f"bearer token sent with every call (default: ${TOKEN_ENV}, which keeps it "
        "out of the process list)",
    )
    return parent


def _prompt_parser() -> argparse.ArgumentParser:
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument("prompt", help='the prompt text, or "-" to read it from stdin')
    return parent


def _lora_flag(value: str) -> tuple[str, float | None]:
    """--lora NAME[:SCALE] as a (name, scale) pair of the `lora` keyword (no scale: None, the
    adapter's default); adapter names have no ':'."""
    name, colon, scale = value.partition(":")
    if not name:
        raise argparse.ArgumentTypeError(f"expected NAME[:SCALE], got {value!r}")
    if not colon:
        return name, None
    try:
        return name, float(scale)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected NAME[:SCALE] with a number as SCALE, got {value!r}"
        ) from None


def _sampling_parser() -> argparse.ArgumentParser:
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument("--max-tokens", type=int)
    parent.add_argument("--temperature", type=float, help="0 = greedy")
    parent.add_argument("--seed", type=int)
    parent.add_argument("--top-k", type=int)
    parent.add_argument("--top-p", type=float)
    parent.add_argument("--min-p", type=float)
    parent.add_argument("--repeat-penalty", type=float)
    parent.add_argument("--stop", action="append", help="stop string (repeatable)")
    parent.add_argument("--ignore-eos", action="store_true")
    parent.add_argument("--model")
    parent.add_argument("--session-id")
    parent.add_argument("--priority", choices=("low", "normal", "high"))
    parent.add_argument(
        "--speculative",
        choices=("auto", "off", "on"),
        help="prompt-lookup speculative decoding (default: the server's)",
    )
    parent.add_argument(
        "--lora",
        action="append",
        type=_lora_flag,
        metavar="NAME[:SCALE]",
        help="apply the model's LoRA adapter NAME, at SCALE (default: the adapter's own); "
        "repeatable",
    )
    return parent


def _add_command(
    commands: Any, name: str, run: _Command, parents: list[argparse.ArgumentParser]
) -> argparse.ArgumentParser:
    doc = (run.__doc__ or "").strip()
    command: argparse.ArgumentParser = commands.add_parser(
        name, parents=parents, help=doc, description=doc
    )
    command.set_defaults(run=run)
    return command


def _add_chat_command(commands: Any, parents: list[argparse.ArgumentParser]) -> None:
    chat = _add_command(commands, "chat", run_chat, parents)
    chat.add_argument(
        "prompt",
        nargs="?",
        help='one turn: the user message, or "-" to read it from stdin (default: a conversation '
        "read line by line from stdin)",
    )
    chat.add_argument("--system", help="the system prompt")
    chat.add_argument(
        "--chat-template",
        help='a built-in template ("gemma", "chatml") or "gguf" (default: the server\'s)',
    )
    chat.add_argument(
        "--tools",
        metavar="FILE",
        help='a JSON file of tools the model may call, in OpenAI\'s shape: [{"type": '
        '"function", "function": {"name", "description", "parameters"}}, ...]',
    )
    chat.add_argument(
        "--tool-choice",
        metavar="CHOICE",
        help="auto (the default with tools), none, required, or a function's name",
    )
    chat.add_argument(
        "--no-parallel-tool-calls", action="store_true", help="at most one call per answer"
    )
    chat.add_argument(
        "--think",
        action=argparse.BooleanOptionalAction,
        help="a thinking model (Qwen 3, DeepSeek R1, Gemma 4...) thinks first, or not "
        "(enable_thinking; default: the template's own)",
    )
    chat.add_argument(
        "--reasoning-budget",
        type=int,
        metavar="N",
        help="at most N thinking tokens (-1 no limit, 0 no thinking; default: the server's)",
    )
    chat.add_argument(
        "--hide-thinking",
        action="store_true",
        help='do not print the thinking (printed dimmed on a terminal, else as "[thinking] " '
        "lines)",
    )
    chat.add_argument(
        "--verbose", action="store_true", help="print each answer's [done] summary on stderr"
    )


def build_parser(default_target: str = DEFAULT_TARGET) -> argparse.ArgumentParser:
    """The argument parser of every client subcommand (`serve` is dispatched before it)."""
    parser = argparse.ArgumentParser(prog="llama-grpc", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    connection, sampling = _connection_parser(default_target), _sampling_parser()
    prompt = _prompt_parser()
    generate = _add_command(commands, "generate", run_generate, [connection, prompt, sampling])
    generate.add_argument("--json", action="store_true", help="print the whole result as JSON")
    _add_command(commands, "stream", run_stream, [connection, prompt, sampling])
    _add_chat_command(commands, [connection, sampling])
    tokenize = _add_command(commands, "tokenize", run_tokenize, [connection])
    tokenize.add_argument("text")
    tokenize.add_argument("--no-add-special", action="store_true", help="do not add BOS")
    tokenize.add_argument("--parse-special", action="store_true")
    tokenize.add_argument("--pieces", action="store_true", help="also print each token's text")
    detokenize = _add_command(commands, "detokenize", run_detokenize, [connection])
    detokenize.add_argument("token_ids", type=int, nargs="+")
    detokenize.add_argument("--render-special", action="store_true")
    embed = _add_command(commands, "embed", run_embed, [connection])
    embed.add_argument("texts", nargs="+", metavar="TEXT", help="one input per argument")
    embed.add_argument(
        "--pooling",
        choices=("mean", "cls", "last", "none"),
        help="default: the model's own, else mean; none = a vector per token",
    )
    embed.add_argument("--dimensions", type=int, help="keep the first N components")
    embed.add_argument("--no-normalize", action="store_true", help="raw vectors, not L2-unit")
    embed.add_argument(
        "--truncate", action="store_true", help="drop the oldest tokens of an over-long input"
    )
    for command in (tokenize, detokenize, embed):
        command.add_argument("--model", help="the model's name (default: the default model)")
    for name, run in (("stats", run_stats), ("info", run_info)):
        command = _add_command(commands, name, run, [connection])
        command.add_argument("--model", help="the model's name (default: the default model)")
    _add_command(commands, "list-models", run_list_models, [connection])
    load_model = _add_command(commands, "load-model", run_load_model, [connection])
    load_model.add_argument("name")
    unload_model = _add_command(commands, "unload-model", run_unload_model, [connection])
    unload_model.add_argument("name")
    unload_model.add_argument("--force", action="store_true", help="end its requests first")
    list_adapters = _add_command(commands, "list-adapters", run_list_adapters, [connection])
    load_adapter = _add_command(commands, "load-adapter", run_load_adapter, [connection])
    load_adapter.add_argument("name", help="the name requests use (--lora NAME)")
    load_adapter.add_argument("path", help="the adapter GGUF, a path on the server")
    load_adapter.add_argument(
        "--scale", type=float, help="the scale of requests naming no scale (default: 1)"
    )
    unload_adapter = _add_command(commands, "unload-adapter", run_unload_adapter, [connection])
    unload_adapter.add_argument("name")
    for command in (list_adapters, load_adapter, unload_adapter):
        command.add_argument("--model", help="the model's name (default: the default model)")
    load = _add_command(commands, "load", run_load, [connection])
    load.add_argument(
        "--interval", type=float, default=1.0, help="seconds between reports (at least 0.1)"
    )
    health = _add_command(commands, "health", run_health, [connection])
    health.add_argument("--service", default="", help='service name ("" = whole server)')
    commands.add_parser("serve", help="run a server (needs the [server] extra; see serve --help)")
    commands.add_parser(
        "models",
        help="list, inspect, verify and name local GGUF models, export their tokenizers: "
        "list | info | verify | add | export-tokenizer "
        "(needs the [server] extra; see models --help)",
    )
    return parser


def server_command(command: str, argv: Sequence[str]) -> int:
    """Hand `llama-grpc serve|models ARGS` to the server package's CLI, when the server extra
    is installed."""
    try:
        module = importlib.import_module(SERVER_COMMANDS[command])
    except ImportError as error:
        hint = SERVE_HINT.replace("llama-grpc serve", f"llama-grpc {command}")
        print(f"{hint}\n({error})", file=sys.stderr)
        return EXIT_USAGE
    command_main: Callable[[list[str]], int | None] = module.main
    return int(command_main(list(argv)) or 0)


def _tls(args: argparse.Namespace) -> bool | TlsConfig:
    """--tls alone: system roots; any --tls-* option: a TlsConfig of them; none: plaintext."""
    paths = (args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name)
    if any(value is not None for value in paths):
        return TlsConfig(
            ca=args.tls_ca, cert=args.tls_cert, key=args.tls_key, server_name=args.tls_server_name
        )
    return bool(args.tls)


def target_of(value: str) -> str | list[str]:
    """--target as Client takes it: a comma-separated list without a scheme becomes a list of
    replicas; anything else (HOST:PORT, a URI such as ipv4:A,B or dns:///name:port) stays one."""
    if "," not in value or value.startswith(URI_SCHEMES):
        return value
    return [part.strip() for part in value.split(",")]


def _check_lora(args: argparse.Namespace) -> None:
    """ValueError for --lora flags each valid alone that the client refuses together (an
    adapter named twice) or for their values (a scale that is not finite)."""
    try:
        lora_adapters(getattr(args, "lora", None))
    except ValueError as error:
        raise ValueError(f"--lora: {error}") from None


def _client(args: argparse.Namespace) -> Client:
    """The client of the connection flags; --token wins over $LLAMA_GRPC_TOKEN."""
    token = args.token if args.token is not None else os.environ.get(TOKEN_ENV) or None
    return Client(
        target_of(args.target),
        timeout=args.timeout,
        tls=_tls(args),
        token=token,
        resume_attempts=args.resume_attempts,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI on `argv` (default: sys.argv[1:]) and return the exit status."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] and arguments[0] in SERVER_COMMANDS:
        return server_command(arguments[0], arguments[1:])
    args = build_parser(os.environ.get(TARGET_ENV, DEFAULT_TARGET)).parse_args(arguments)
    try:
        _check_lora(args)
        client = _client(args)
    except (ValueError, OSError) as error:  # TLS options or files, a malformed token or target
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE
    try:
        with client:
            return int(args.run(client, args))
    except LlamaGrpcError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_ERROR
    except ImportError as error:  # health() without grpcio-health-checking
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
