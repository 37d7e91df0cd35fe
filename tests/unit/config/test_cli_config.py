"""cli.py: defaults < TOML file < env < flags -> Settings; bad options exit 2 (no model)."""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import subprocess
import sys
import types
from collections.abc import Callable
from pathlib import Path

import pytest
import structlog

from llama_grpc_server import cli
from llama_grpc_server.config import (
    ModelSettings,
    PoolSettings,
    SchedulerSettings,
    ServerSettings,
    Settings,
    available_memory_bytes,
    ram_tier_mb,
)
from llama_grpc_server.config.loading import ConfigError, HelpRequested, load_settings
from llama_grpc_server.config.options import OPTIONS
from llama_grpc_server.core.requests.request import SamplingParams
from llama_grpc_server.observability.telemetry import log_format_for


def settings(*argv: str, env: dict[str, str] | None = None) -> Settings:
    return load_settings(list(argv), env or {})


def write_toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "serve.toml"
    path.write_text(text, encoding="utf-8")
    return path


def target(s: Settings, dotted: str) -> object:
    section, field = dotted.split(".")
    owner = s.scheduler.default_sampling if section == "sampling" else getattr(s, section)
    return getattr(owner, field)


def field_default(dotted: str) -> object:
    """The default declared on the config.py dataclass field (not read through an instance)."""
    section, name = dotted.split(".")
    owner = {
        "model": ModelSettings,
        "scheduler": SchedulerSettings,
        "server": ServerSettings,
        "sampling": SamplingParams,
        "pool": PoolSettings,
    }[section]
    (found,) = [f for f in dataclasses.fields(owner) if f.name == name]
    assert found.default is not dataclasses.MISSING, dotted
    return found.default


def test_every_option_default_is_its_config_field_default() -> None:
    """Each option's default is the default declared on the config.py field it sets."""
    for opt in OPTIONS:
        assert opt.default == field_default(opt.target), opt.name
        assert type(opt.default) is type(field_default(opt.target)), opt.name


def test_defaults_without_any_input() -> None:
    """No flags, env or file: exactly the config.py defaults (threads 0 = all CPUs)."""
    got = settings()
    assert got == Settings()
    assert (got.model.n_threads, got.model.n_threads_batch) == (0, 0)


def test_help_shows_the_config_defaults() -> None:
    """--help states each non-empty default as config.py declares it."""
    with pytest.raises(HelpRequested) as caught:
        settings("--help")
    text = " ".join(caught.value.text.split())
    assert "--n-ctx INT KV cache tokens, shared by all slots (default: 8192)" in text
    assert "generation threads (0 = all CPUs) (default: 0)" in text
    assert "(default: 0.8)" in text


@pytest.mark.parametrize(
    ("n_threads", "n_threads_batch", "expected"),
    [(0, 0, (6, 6)), (3, 0, (3, 3)), (0, 2, (6, 2)), (3, 5, (3, 5))],
)
def test_thread_defaults_resolve_to_cpus(
    n_threads: int, n_threads_batch: int, expected: tuple[int, int]
) -> None:
    """0 threads = every CPU; 0 prompt threads = the generation threads."""
    model = ModelSettings(n_threads=n_threads, n_threads_batch=n_threads_batch)
    assert model.threads(cpus=6) == expected


def test_thread_flags_reach_the_model_settings() -> None:
    """--threads alone leaves --threads-batch at 0, which then follows --threads."""
    got = settings("--threads", "3")
    assert (got.model.n_threads, got.model.n_threads_batch) == (3, 0)
    assert got.model.threads(cpus=6) == (3, 3)


def test_precedence_defaults_file_env_flag(tmp_path: Path) -> None:
    """A flag beats env, env beats the file, the file beats the default."""
    path = write_toml(tmp_path, "n_parallel = 2\ntemperature = 0.5\nn_ctx = 4096\n")
    env = {
        "LLAMA_GRPC_CONFIG": str(path),
        "LLAMA_GRPC_N_PARALLEL": "3",
        "LLAMA_GRPC_TEMPERATURE": "0.6",
    }
    got = settings("--n-parallel", "5", env=env)
    assert got.scheduler.n_parallel == 5
    assert got.scheduler.default_sampling.temperature == 0.6
    assert got.model.n_ctx == 4096
    assert got.scheduler.default_sampling.top_k == 40


def test_config_flag_beats_config_env(tmp_path: Path) -> None:
    """--config PATH wins over LLAMA_GRPC_CONFIG."""
    chosen = write_toml(tmp_path, "port = 6000\n")
    other = tmp_path / "other.toml"
    other.write_text("port = 7000\n", encoding="utf-8")
    got = settings("--config", str(chosen), env={"LLAMA_GRPC_CONFIG": str(other)})
    assert got.server.port == 6000


def test_default_sampling_reaches_scheduler_settings() -> None:
    """Sampling flags build scheduler.default_sampling."""
    got = settings(
        "--temperature", "0", "--top-k", "1", "--top-p", "0.5", "--min-p", "0",
        "--repeat-penalty", "1.1", "--seed", "7",
    )  # fmt: skip
    assert got.scheduler.default_sampling == SamplingParams(
        temperature=0.0, top_k=1, top_p=0.5, min_p=0.0, repeat_penalty=1.1, seed=7
    )


def test_seed_minus_one_means_random() -> None:
    """--seed -1 leaves the default seed unset (random per request)."""
    assert settings("--seed", "-1").scheduler.default_sampling.seed is None


def test_every_flag_sets_its_field() -> None:
    """Each non-boolean flag, given a valid non-default value, lands in its target field."""
    values = {
        "model_name": "m", "host": "0.0.0.0", "port": "0", "n_ctx": "1024", "n_parallel": "8",
        "n_batch": "256", "n_ubatch": "128", "chunk_size": "64", "threads": "3",
        "threads_batch": "5", "n_gpu_layers": "-1", "max_queue": "0", "batch_strategy": "balanced",
        "metrics_port": "9100", "log_format": "console", "log_level": "debug", "grace_s": "2.5",
        "default_max_tokens": "32", "temperature": "0.1", "top_k": "5", "top_p": "0.9",
        "min_p": "0.1", "repeat_penalty": "1.2", "seed": "3", "prefill_stall": "4.5",
    }  # fmt: skip
    argv = [arg for name, text in values.items() for arg in ("--" + name.replace("_", "-"), text)]
    got = settings(*argv)
    for opt in OPTIONS:
        if opt.name in values:
            assert str(target(got, opt.target)) == str(opt.kind(values[opt.name])), opt.name


@pytest.mark.parametrize(
    ("argv", "env", "toml"),
    [
        (["--no-cache-prompt"], {}, ""),
        ([], {"LLAMA_GRPC_CACHE_PROMPT": "false"}, ""),
        ([], {"LLAMA_GRPC_NO_CACHE_PROMPT": "1"}, ""),
        ([], {}, "cache_prompt = false\n"),
        ([], {}, "no_cache_prompt = true\n"),
    ],
)
def test_cache_prompt_can_be_turned_off(
    tmp_path: Path, argv: list[str], env: dict[str, str], toml: str
) -> None:
    """--no-cache-prompt and its env/TOML spellings disable prompt caching."""
    if toml:
        env = {**env, "LLAMA_GRPC_CONFIG": str(write_toml(tmp_path, toml))}
    assert settings(*argv, env=env).scheduler.cache_prompt is False


def test_flag_turns_cache_prompt_back_on() -> None:
    """--cache-prompt on the command line beats LLAMA_GRPC_NO_CACHE_PROMPT."""
    got = settings("--cache-prompt", env={"LLAMA_GRPC_NO_CACHE_PROMPT": "yes"})
    assert got.scheduler.cache_prompt is True


def test_defaulted_batch_sizes_shrink_to_a_small_context() -> None:
    """Only --n-ctx 256 given: n_batch and n_ubatch default down to fit instead of failing."""
    got = settings("--n-ctx", "256")
    assert (got.model.n_batch, got.model.n_ubatch) == (256, 256)


def test_env_ignores_other_prefixes_and_empty_values() -> None:
    """Variables without the LLAMA_GRPC_ prefix, and empty LLAMA_GRPC_ ones, are ignored."""
    got = settings(env={"PATH": "/bin", "LLAMA_GRPCX": "1", "LLAMA_GRPC_N_CTX": ""})
    assert got.model.n_ctx == 8192


def test_toml_model_path_is_relative_to_the_file(tmp_path: Path) -> None:
    """model = "x.gguf" in a config file means x.gguf beside that file."""
    (tmp_path / "x.gguf").write_bytes(b"GGUF")
    got = settings("--config", str(write_toml(tmp_path, 'model = "x.gguf"\n')))
    assert Path(got.model.model_path) == tmp_path / "x.gguf"


@pytest.mark.parametrize(
    ("argv", "env", "toml", "expected"),
    [
        (["--n-gpu-layers", "auto"], {}, "", "auto"),
        (["--n-gpu-layers", "-1"], {}, "", -1),
        ([], {"LLAMA_GRPC_N_GPU_LAYERS": "Auto"}, "", "auto"),
        ([], {}, 'n_gpu_layers = "auto"\n', "auto"),
        ([], {}, "n_gpu_layers = 12\n", 12),
    ],
)
def test_n_gpu_layers_takes_auto_everywhere(
    tmp_path: Path, argv: list[str], env: dict[str, str], toml: str, expected: object
) -> None:
    """--n-gpu-layers is a number or the word auto, from flags, env and TOML alike."""
    if toml:
        argv = [*argv, "--config", str(write_toml(tmp_path, toml))]
    assert settings(*argv, env=env).model.n_gpu_layers == expected


def test_toml_ints_accepted_for_floats(tmp_path: Path) -> None:
    """temperature = 1 in TOML is the float 1.0."""
    got = settings("--config", str(write_toml(tmp_path, "temperature = 1\n")))
    assert got.scheduler.default_sampling.temperature == 1.0
    assert isinstance(got.scheduler.default_sampling.temperature, float)


def test_custom_batch_strategy_accepted() -> None:
    """A module:attr batch strategy that loads is kept as given."""
    spec = "llama_grpc_server.core.scheduling.strategies:PrefillPriority"
    assert settings("--batch-strategy", spec).scheduler.batch_strategy == spec


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        (["--bogus"], {}, ["--bogus", "command line"]),
        (["--n-ctx"], {}, ["--n-ctx", "command line"]),
        (["--n-ctx", "abc"], {}, ["--n-ctx", "command line", "integer"]),
        (["--n-parallel", "0"], {}, ["--n-parallel", "command line"]),
        ([], {"LLAMA_GRPC_N_PARALLEL": "257"}, ["--n-parallel", "env LLAMA_GRPC_N_PARALLEL"]),
        (["--port", "65536"], {}, ["--port", "command line"]),
        ([], {"LLAMA_GRPC_PORT": "-1"}, ["--port", "env LLAMA_GRPC_PORT"]),
        (["--n-ctx", "512", "--n-batch", "1024"], {}, ["--n-batch", "<= --n-ctx"]),
        (["--n-batch", "256", "--n-ubatch", "512"], {}, ["--n-ubatch", "<= --n-batch"]),
        (["--model", "/nonexistent/m.gguf"], {}, ["--model", "no such file"]),
        ([], {"LLAMA_GRPC_MODEL": "/nonexistent/m.gguf"}, ["--model", "env LLAMA_GRPC_MODEL"]),
        (["--log-format", "xml"], {}, ["--log-format", "json, console"]),
        (["--log-level", "trace"], {}, ["--log-level", "command line"]),
        (["--temperature", "-0.1"], {}, ["--temperature", "command line"]),
        (["--temperature", "nan"], {}, ["--temperature", "number"]),
        (["--top-p", "1.5"], {}, ["--top-p", "between"]),
        (["--max-queue", "-1"], {}, ["--max-queue", ">= 0"]),
        (["--grace-s", "soon"], {}, ["--grace-s", "number"]),
        (["--threads", "-1"], {}, ["--threads", ">= 0"]),
        (["--seed", "-2"], {}, ["--seed", "command line"]),
        (["--metrics-port", "50051"], {}, ["--metrics-port", "same as --port"]),
        ([], {"LLAMA_GRPC_CACHE_PROMPT": "maybe"}, ["--cache-prompt", "true or false"]),
        ([], {"LLAMA_GRPC_N_CTXX": "1"}, ["LLAMA_GRPC_N_CTXX", "did you mean LLAMA_GRPC_N_CTX"]),
        ([], {"LLAMA_GRPC_CONFIG": "/nonexistent/c.toml"}, ["env LLAMA_GRPC_CONFIG"]),
        (["--config", "/nonexistent/c.toml"], {}, ["/nonexistent/c.toml", "--config"]),
        (["--batch-strategy", "fastest"], {}, ["--batch-strategy", "unknown batch strategy"]),
        (["--batch-strategy", "no_such_mod_xyz:S"], {}, ["--batch-strategy", "cannot import"]),
        (["--batch-strategy", "json:dumps"], {}, ["--batch-strategy", "command line"]),
        (["--n-gpu-layers", "-2"], {}, ["--n-gpu-layers", ">= -1"]),
        (["--n-gpu-layers", "all"], {}, ["--n-gpu-layers", "an integer or auto, got 'all'"]),
        (["--prompt-cache-ram-mb", "-2"], {}, ["--prompt-cache-ram-mb", ">= -1"]),
        (["--session-live-s", "-1"], {}, ["--session-live-s", ">= 0"]),
        (["--prefill-stall", "1"], {}, ["--prefill-stall", "must be 0 or between 1.25 and 64"]),
        (["--prefill-stall", "-1"], {}, ["--prefill-stall", "must be 0 or between 1.25 and 64"]),
    ],
)
def test_invalid_option_names_option_and_source(
    argv: list[str], env: dict[str, str], expected: list[str]
) -> None:
    """An invalid option raises ConfigError naming the option and where it was set."""
    with pytest.raises(ConfigError) as caught:
        settings(*argv, env=env)
    for part in expected:
        assert part in str(caught.value)


@pytest.mark.parametrize(
    ("toml", "expected"),
    [
        ("n_ctxx = 1\n", ["unknown option", "key n_ctxx", "did you mean n_ctx"]),
        ('n_ctx = "4096"\n', ["--n-ctx", "key n_ctx", "an integer, got a string"]),
        ("n_parallel = true\n", ["--n-parallel", "an integer, got a boolean"]),
        ("cache_prompt = 1\n", ["--cache-prompt", "true or false"]),
        ("[model]\nn_ctx = 1\n", ["--model", "got a table", "not [sections]"]),
        ("config = 'x.toml'\n", ["unknown option", "key config"]),
        ("n_ctx = \n", ["invalid TOML"]),
        ("n_ctx = 100\nn_batch = 200\n", ["--n-batch=200", "key n_batch", "key n_ctx"]),
        ('n_gpu_layers = "all"\n', ["--n-gpu-layers", 'an integer or "auto", got a string']),
    ],
)
def test_invalid_toml_names_key_and_file(tmp_path: Path, toml: str, expected: list[str]) -> None:
    """A bad config file raises ConfigError naming the file and the offending key."""
    path = write_toml(tmp_path, toml)
    with pytest.raises(ConfigError) as caught:
        settings("--config", str(path))
    assert str(path) in str(caught.value)
    for part in expected:
        assert part in str(caught.value)


def test_help_is_requested_not_printed() -> None:
    """load_settings(['--help']) raises HelpRequested with the text instead of printing it."""
    with pytest.raises(HelpRequested) as caught:
        settings("--help")
    for opt in OPTIONS:
        assert opt.flag in caught.value.text
    assert "LLAMA_GRPC_CONFIG" in caught.value.text


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in list(cli.os.environ):
        if name.startswith("LLAMA_GRPC_"):
            monkeypatch.delenv(name)
    return monkeypatch


def test_main_bad_option_one_line_exit_2(
    clean_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """main() prints one error line naming the option and its source, and returns 2."""
    clean_env.setenv("LLAMA_GRPC_N_PARALLEL", "0")
    assert cli.main([]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("llama-grpc serve: error: --n-parallel=0 (env LLAMA_GRPC_N_PARALLEL)")


def test_main_passes_settings_to_run(clean_env: pytest.MonkeyPatch, restore_logging: None) -> None:
    """main() configures logging, hands the parsed Settings to run() and returns its code."""
    seen: list[Settings] = []
    clean_env.setattr(cli, "run", lambda s: seen.append(s) or 7)
    assert cli.main(["--n-parallel", "2", "--log-level", "warning"]) == 7
    assert seen[0].scheduler.n_parallel == 2
    assert logging.getLogger().level == logging.WARNING


def test_run_wires_serve_and_build_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """run() passes the settings to serve() and a factory calling build_engine(debug_logs=...)."""
    calls: list[tuple[str, object]] = []

    async def serve(settings: Settings, factory: Callable[[], object], **_: object) -> int:
        calls.append(("serve", settings))
        factory()
        return 3

    def build_engine(settings: Settings, **kwargs: object) -> object:
        calls.append(("build", kwargs))
        return object()

    fake_rpc = types.SimpleNamespace(serve=serve)
    fake_build = types.SimpleNamespace(build_engine=build_engine)
    monkeypatch.setitem(sys.modules, "llama_grpc_server.rpc.plumbing.server", fake_rpc)
    monkeypatch.setitem(sys.modules, "llama_grpc_server.engine.build", fake_build)
    got = settings("--log-level", "debug")
    assert cli.run(got) == 3
    assert calls[0] == ("serve", got)
    name, kwargs = calls[1]
    assert name == "build" and isinstance(kwargs, dict)
    assert kwargs["debug_logs"] is True
    assert callable(kwargs["on_tick"]) and callable(kwargs["on_done"])  # telemetry hooks


def test_json_logging_writes_one_object_per_line(
    restore_logging: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """configure_logging('json', 'info') writes JSON lines to stderr and drops debug events."""
    cli.configure_logging("json", "info")
    log = structlog.get_logger("test")
    log.debug("hidden")
    log.info("shown", n=1)
    logging.getLogger("grpc").warning("from stdlib")
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert [(d["event"], d["level"]) for d in lines] == [
        ("shown", "info"),
        ("from stdlib", "warning"),
    ]
    assert lines[0]["n"] == 1
    assert "timestamp" in lines[0]


def run_module(*args: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin"}  # no LLAMA_GRPC_* from the developer's shell
    return subprocess.run(
        [sys.executable, "-m", "llama_grpc_server", *args],
        capture_output=True, text=True, timeout=60, env=env, check=False,
    )  # fmt: skip


def test_python_m_help() -> None:
    """`python -m llama_grpc_server --help` prints the options and exits 0."""
    done = run_module("--help")
    assert done.returncode == 0, done.stderr
    assert "--n-parallel" in done.stdout
    assert "LLAMA_GRPC_CONFIG" in done.stdout


def test_python_m_bad_flag_exits_2_without_traceback() -> None:
    """`python -m llama_grpc_server --n-batch 9999 --n-ctx 512` exits 2 with a one-line error."""
    done = run_module("--n-batch", "9999", "--n-ctx", "512")
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        "llama-grpc serve: error: --n-batch=9999 (command line): must be <= --n-ctx=512 "
        "(command line)"
    ]


# -- security options ------------------------------------------------------------------------------


def test_tls_and_auth_files_reach_the_server_settings(tmp_path: Path) -> None:
    """Paths in a config file are relative to it; the tokens file's tenant limits reach the
    scheduler."""
    for name in ("cert.pem", "key.pem", "ca.pem"):
        (tmp_path / name).write_text("x")
    (tmp_path / "tokens.toml").write_text(
        "[tenants.a]\nmax_queued = 2\n[[tokens]]\ntenant = 'a'\ntoken = 'a-token-0123456789'\n"
    )
    path = write_toml(
        tmp_path,
        'tls_cert = "cert.pem"\ntls_key = "key.pem"\ntls_client_ca = "ca.pem"\n'
        'auth_tokens_file = "tokens.toml"\n',
    )
    got = settings("--config", str(path), "--no-reflection")
    assert got.server.tls_cert == str(tmp_path / "cert.pem")
    assert got.server.tls_client_ca == str(tmp_path / "ca.pem")
    assert got.server.auth_tokens_file == str(tmp_path / "tokens.toml")
    assert got.server.reflection is False
    assert got.scheduler.tenant_limits["a"].max_queued == 2


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (["--tls-cert", "cert.pem"], "--tls-cert needs --tls-key"),
        (["--tls-key", "key.pem"], "--tls-key needs --tls-cert"),
        (["--tls-client-ca", "ca.pem"], "--tls-client-ca (command line) needs --tls-cert"),
        (["--tls-cert", "absent.pem", "--tls-key", "key.pem"], "--tls-cert"),
        (["--auth-tokens-file", "bad.toml"], "--auth-tokens-file (command line)"),
    ],
)
def test_bad_security_options_name_the_flag(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, given: list[str], expected: str
) -> None:
    monkeypatch.chdir(tmp_path)
    for name in ("cert.pem", "key.pem", "ca.pem"):
        (tmp_path / name).write_text("x")
    (tmp_path / "bad.toml").write_text("[[tokens]]\ntenant = 'a'\ntoken = 'short'\n")
    with pytest.raises(ConfigError) as caught:
        settings(*given)
    assert expected in str(caught.value)


# -- several models --------------------------------------------------------------------------------


def gguf(directory: Path, name: str) -> Path:
    path = directory / name
    path.write_bytes(b"GGUF")
    return path


def test_repeated_model_flags_name_the_default_and_the_others(tmp_path: Path) -> None:
    """The first --model is the default (its NAME= names it); the others keep their order, a
    bare path named by its stem."""
    a, b, c = gguf(tmp_path, "a.gguf"), gguf(tmp_path, "b.gguf"), gguf(tmp_path, "c.gguf")
    got = settings("--model", f"first={a}", "--model", f"second={b}", "--model", str(c))
    assert (got.model.model_path, got.model.model_name) == (str(a), "first")
    assert got.pool.models == (("second", str(b)), ("c", str(c)))
    plain = settings("--model", str(a), "--model-name", "mine")
    assert (plain.model.model_name, plain.pool.models) == ("mine", ())


def test_models_dir_adds_its_models_after_the_named_ones(tmp_path: Path) -> None:
    """--models-dir (or LLAMA_GRPC_MODELS_DIR) adds its *.gguf files by stem; a name already
    given wins; the embedded model is not added (it is the default only without --model)."""
    models = tmp_path / "models"
    models.mkdir()
    x, y = gguf(models, "x.gguf"), gguf(models, "y.gguf")
    other = gguf(tmp_path, "other.gguf")
    got = settings("--model", f"x={other}", "--models-dir", str(models))
    assert got.model.model_name == "x" and got.pool.models == (("y", str(y)),)
    from_env = settings(env={"LLAMA_GRPC_MODELS_DIR": str(models)})
    assert from_env.model.model_path == ""  # the embedded default
    assert from_env.pool.models == (("x", str(x)), ("y", str(y)))
    assert from_env.pool.models_dir == str(models)
    by_name = settings("--model", "y", "--models-dir", str(models))
    assert (by_name.model.model_path, by_name.model.model_name) == (str(y), "y")


def test_model_list_in_a_config_file_is_relative_to_it(tmp_path: Path) -> None:
    gguf(tmp_path, "a.gguf")
    gguf(tmp_path, "b.gguf")
    path = write_toml(tmp_path, 'model = ["a.gguf", "bee=b.gguf"]\nmax_loaded_models = 2\n')
    got = settings("--config", str(path))
    assert Path(got.model.model_path) == tmp_path / "a.gguf"
    assert got.pool.models == (("bee", str(tmp_path / "b.gguf")),)
    assert got.pool.max_loaded_models == 2


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--model", "a=A", "--model", "a=B"], "two models are named 'a'"),
        (["--model", "bad name=A"], "invalid model name"),
        (["--model", "a=/nonexistent.gguf"], "no such file"),
        (["--model", "a=A", "--model-name", "b"], "already named 'a'"),
        (["--model", "nosuchname"], "unknown model 'nosuchname'"),
        (["--models-dir", "/nonexistent-dir"], "no such directory"),
        (["--max-loaded-models", "-1"], "--max-loaded-models"),
    ],
)
def test_bad_model_lists_are_refused(tmp_path: Path, argv: list[str], expected: str) -> None:
    a, b = gguf(tmp_path, "a.gguf"), gguf(tmp_path, "b.gguf")
    argv = [arg.replace("=A", f"={a}").replace("=B", f"={b}") for arg in argv]
    with pytest.raises(ConfigError, match=expected):
        settings(*argv)


def test_loaded_model_bounds() -> None:
    got = settings("--max-loaded-models", "3", "--max-loaded-bytes", "1000000")
    assert (got.pool.max_loaded_models, got.pool.max_loaded_bytes) == (3, 1_000_000)
    assert settings().pool == PoolSettings()


def test_the_ram_tier_is_on_by_default_sized_from_available_memory() -> None:
    """-1 (the default) is a quarter of the available memory, at most 8 GiB; 0 is off and any
    other value is taken as given."""
    gib = 1024**3
    assert settings().scheduler.prompt_cache_ram_mb == -1
    assert ram_tier_mb(-1, 24 * gib) == 6144
    assert ram_tier_mb(-1, 64 * gib) == 8192
    assert ram_tier_mb(-1, 0) == 0
    # shared among the engines that may be resident at once
    assert ram_tier_mb(-1, 24 * gib, engines=3) == 2048
    assert ram_tier_mb(-1, 64 * gib, engines=2) == 8192
    assert ram_tier_mb(-1, 64 * gib, engines=4) == 4096
    assert ram_tier_mb(512, 24 * gib, engines=4) == 512  # a configured size is every engine's
    assert PoolSettings().resident_engines() == 1
    assert PoolSettings(models=(("a", "a.gguf"), ("b", "b.gguf"))).resident_engines() == 1
    unlimited = PoolSettings(models=(("a", "a.gguf"), ("b", "b.gguf")), max_loaded_models=0)
    assert unlimited.resident_engines() == 3
    assert PoolSettings(max_loaded_models=2).resident_engines() == 2
    assert ram_tier_mb(0, 64 * gib) == 0
    assert ram_tier_mb(300, 1) == 300
    assert 0 < ram_tier_mb(-1) == min(8192, available_memory_bytes() // 4 // 2**20)
    assert settings("--prompt-cache-ram-mb", "0").scheduler.prompt_cache_ram_mb == 0


# -- tokens never in clear off the box -------------------------------------------------------------


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "myhost.example"])
def test_tokens_on_a_plaintext_network_listener_refuse_to_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, host: str
) -> None:
    """A tokens file with a plaintext listener on a non-loopback address is a ConfigError that
    says why and how to fix it; --allow-insecure-tokens or TLS lets it start."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tokens.toml").write_text(
        "[[tokens]]\ntenant = 'a'\ntoken = 'a-token-0123456789'\n"
    )
    for name in ("cert.pem", "key.pem"):
        (tmp_path / name).write_text("x")
    with pytest.raises(ConfigError) as caught:
        settings("--host", host, "--auth-tokens-file", "tokens.toml")
    message = str(caught.value)
    assert message.startswith(f"--auth-tokens-file on a plaintext listener at --host={host}: ")
    assert "bearer tokens would travel in clear" in message
    assert "--allow-insecure-tokens" in message and "--tls-cert" in message
    assert message.endswith("(--host: command line; --auth-tokens-file: command line)")
    allowed = settings(
        "--host", host, "--auth-tokens-file", "tokens.toml", "--allow-insecure-tokens"
    )
    assert allowed.server.allow_insecure_tokens is True
    tls = settings("--host", host, "--auth-tokens-file", "tokens.toml",
                   "--tls-cert", "cert.pem", "--tls-key", "key.pem")  # fmt: skip
    assert tls.server.allow_insecure_tokens is False


@pytest.mark.parametrize("host", ["127.0.0.1", "127.8.9.10", "::1", "[::1]", "localhost"])
def test_tokens_on_a_plaintext_loopback_listener_start(tmp_path: Path, host: str) -> None:
    (tmp_path / "tokens.toml").write_text(
        "[[tokens]]\ntenant = 'a'\ntoken = 'a-token-0123456789'\n"
    )
    got = settings("--host", host, "--auth-tokens-file", str(tmp_path / "tokens.toml"))
    assert got.server.host == host and got.server.auth_tokens_file


def test_plaintext_without_tokens_may_listen_anywhere() -> None:
    assert settings("--host", "0.0.0.0").server.host == "0.0.0.0"


@pytest.mark.parametrize(
    ("argv", "env", "toml", "outcome"),
    [
        (["--no-pad-odd-ticks"], {}, "", (False, "--no-pad-odd-ticks is deprecated: use "
         "--no-pad-decode-batches (command line)")),
        (["--pad-odd-ticks"], {"LLAMA_GRPC_PAD_DECODE_BATCHES": "0"}, "", (True,
         "--pad-odd-ticks is deprecated: use --pad-decode-batches (command line)")),
        ([], {"LLAMA_GRPC_PAD_ODD_TICKS": "false"}, "", (False, "env LLAMA_GRPC_PAD_ODD_TICKS is "
         "deprecated: use LLAMA_GRPC_PAD_DECODE_BATCHES")),
        ([], {"LLAMA_GRPC_NO_PAD_ODD_TICKS": "1"}, "", (False, "env LLAMA_GRPC_NO_PAD_ODD_TICKS "
         "is deprecated: use LLAMA_GRPC_NO_PAD_DECODE_BATCHES")),
        ([], {}, "pad_odd_ticks = false", (False, "key pad_odd_ticks is deprecated: use "
         "pad_decode_batches")),
        # the current name wins over the old one given on the same command line
        (["--no-pad-odd-ticks", "--pad-decode-batches"], {}, "", (True, "--no-pad-odd-ticks")),
    ],
)  # fmt: skip
def test_pad_odd_ticks_still_read_with_one_deprecation_note(
    tmp_path: Path, argv: list[str], env: dict[str, str], toml: str, outcome: tuple[bool, str]
) -> None:
    """--pad-odd-ticks, LLAMA_GRPC_[NO_]PAD_ODD_TICKS and the pad_odd_ticks key set
    pad_decode_batches, each adding one line that names the current spelling."""
    if toml:
        argv = [*argv, "--config", str(write_toml(tmp_path, toml))]
    expected, note = outcome
    notes: list[str] = []
    got = load_settings(argv, env, notes)
    assert got.scheduler.pad_decode_batches is expected
    assert len(notes) == 1 and note in notes[0]


def test_current_pad_name_gives_no_note_and_old_is_not_in_help() -> None:
    notes: list[str] = []
    assert (
        load_settings(["--no-pad-decode-batches"], {}, notes).scheduler.pad_decode_batches is False
    )
    assert notes == []
    with pytest.raises(HelpRequested) as caught:
        settings("--help")
    assert "--pad-decode-batches" in caught.value.text
    assert "--no-pad-odd-ticks" not in caught.value.text


def test_main_logs_the_deprecation_once(
    clean_env: pytest.MonkeyPatch, restore_logging: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """main() logs one warning line per deprecated name, after logging is configured."""
    clean_env.setattr(cli, "run", lambda s: 0)
    assert cli.main(["--no-pad-odd-ticks", "--log-format", "json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert [(d["event"], d["level"]) for d in lines] == [("deprecated_option", "warning")]
    assert "--no-pad-decode-batches" in lines[0]["detail"]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(
    ("log_format", "is_terminal", "expected"),
    [
        ("auto", True, "console"),
        ("auto", False, "json"),
        ("json", True, "json"),
        ("console", False, "console"),
    ],
)
def test_log_format_auto_is_console_only_at_a_terminal(
    log_format: str, is_terminal: bool, expected: str
) -> None:
    """--log-format auto (the default): human-readable lines when the log stream is a terminal,
    JSON lines otherwise; json and console are taken as given."""
    stream = _Terminal() if is_terminal else io.StringIO()
    assert log_format_for(log_format, stream) == expected
    assert settings().server.log_format == "auto"


@pytest.mark.parametrize("is_terminal", [True, False])
def test_configure_logging_auto_renders_by_terminal(
    restore_logging: None, is_terminal: bool
) -> None:
    stream = _Terminal() if is_terminal else io.StringIO()
    cli.configure_logging("auto", "info", stream=stream, cache_loggers=False)
    structlog.get_logger("test").info("shown", n=1)
    line = stream.getvalue().strip()
    if is_terminal:
        assert "shown" in line and not line.startswith("{")
    else:
        assert json.loads(line)["event"] == "shown"
