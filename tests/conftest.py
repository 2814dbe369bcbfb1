"""Shared fixtures: free loopback ports and real vaults (no mocks, only 127.0.0.1).

`free_port` (fixture, int)
    A TCP port on 127.0.0.1 that was free a moment ago. `pick_free_port()` is the same as a plain
    function for code that needs several.

`vault_factory` (fixture, callable)
    ``vault_factory(max_bytes="1GiB", *, role="kv_cold", subprocess=False, bulk=True,
    args=(), config="", token=None) -> VaultHandle``
    (max_bytes: bytes, a size string, or "unlimited") starts a REAL vault on 127.0.0.1 on a
    free port and returns a handle with:
      ``.address``  "127.0.0.1:PORT", ready to pass to VaultClient / tierkv.toml
      ``.port``     the port
      ``.stop()``   graceful stop (idempotent); every vault is stopped at teardown anyway
    With ``subprocess=False`` (default, fast) the vault is an in-process gRPC server
    (tierkv.vault.server.serve) and ``.server`` / ``.store`` expose it. With ``subprocess=True``
    it runs the real ``tierkv vault`` command in a child process (``.process``, output in
    ``.log_path``) and
    ``.kill()`` SIGKILLs it, e.g. to test what clients do when a vault dies; ``args`` are more
    ``tierkv vault`` options (e.g. ``["--disk-dir", str(path)]``) and ``config`` the text of its
    tierkv.toml (e.g. low ``[limits]``, ``[security]``) and ``token`` one it accepts (to see it
    ready). ``bulk=False``
    starts an in-process vault without its bulk data path (clients then use gRPC alone). The
    handle is ready
    (health SERVING) when returned; no process is left behind after the test.

`vault` (fixture, VaultHandle)
    One in-process 1 GiB vault, for tests that need just one.

`disk_dir` (fixture, Path; parametrized)
    A directory for a vault's disk tier that does not exist yet: under tmp_path, and on tmpfs
    (/dev/shm, removed afterwards; skipped where there is none).

`stop_process(pid, timeout=10.0)`
    SIGSTOP a server process and return only once every one of its threads has stopped: `kill`
    only queues the stop, and until each thread takes it the others go on answering (a "hung"
    vault that still served lookups made a dead-vault test flaky in CI).

`SLOW_BOX_MARGIN_S`
    What a time bound adds to a configured deadline ("never much past it"): enough for a
    2-core CI box busy with other work. Speed itself is measured by benchmarks, not tests.

Engine tests that ran: the summary names how many tests of each engine marker (vllm, mlx,
real_model) passed,
and with TIERKV_MARKER_COUNTS=path the same counts are written there as JSON, so CI can fail when
an engine's tests were all skipped.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from tierkv.config import parse_max_bytes
from tierkv.vault.client import VaultClient
from tierkv.vault.server import VaultServer, serve
from tierkv.vault.store import VaultStore

LOOPBACK = "127.0.0.1"
SLOW_BOX_MARGIN_S = 3.0
START_TIMEOUT_S = 60.0


def pick_free_port() -> int:
    """A TCP port on 127.0.0.1 that the kernel reported free."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((LOOPBACK, 0))
        return int(probe.getsockname()[1])


def _thread_state(stat: Path) -> str:
    """The one-letter state in a /proc/.../stat file (T or t = stopped); "" once it is gone."""
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return ""


def stop_process(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP `pid`; return once all its threads are stopped (see the module docstring)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = [_thread_state(stat) for stat in Path(f"/proc/{pid}/task").glob("*/stat")]
        if all(state in ("T", "t", "") for state in states):
            return
        time.sleep(0.005)
    raise TimeoutError(f"process {pid} did not stop within {timeout} s")


@pytest.fixture
def free_port() -> int:
    return pick_free_port()


@dataclass
class VaultHandle:
    """A vault started for a test; see the module docstring."""

    address: str
    port: int
    server: VaultServer | None = None
    process: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None

    @property
    def store(self) -> VaultStore:
        assert self.server is not None, "only in-process vaults expose their store"
        return self.server.store

    def stop(self) -> None:
        """Graceful stop (SIGTERM for a subprocess vault); safe to call twice."""
        if self.server is not None:
            self.server.stop(grace=0.5)
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def kill(self) -> None:
        """SIGKILL a subprocess vault: no goodbye to its clients."""
        assert self.process is not None, "kill() needs vault_factory(..., subprocess=True)"
        self.process.kill()
        self.process.wait()


def _wait_serving(
    address: str, process: subprocess.Popen[bytes] | None = None, token: str | None = None
) -> None:
    client = VaultClient(address, deadline_s=1.0, token=token)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if process is not None and process.poll() is not None:
                raise RuntimeError(f"tierkv vault exited with {process.returncode}")
            if client.wait_ready(0.5):
                return
        raise RuntimeError(f"vault at {address} did not become ready in {START_TIMEOUT_S} s")
    finally:
        client.close()


def start_subprocess_vault(
    port: int,
    max_bytes: str,
    role: str,
    work_dir: Path,
    args: Sequence[str] = (),
    config_text: str = "",
    host: str = LOOPBACK,
    file_size_limit: int | None = None,
) -> tuple[subprocess.Popen[bytes], Path]:
    """`tierkv vault` on host:port (127.0.0.1, or another loopback address) with the given
    config; its output goes to a log file. With `file_size_limit`, no file the vault writes
    grows past that many bytes (RLIMIT_FSIZE, SIGXFSZ ignored: the write that meets it is cut
    short, then fails with EFBIG, as on a full disk)."""
    config = work_dir / f"vault-{port}.toml"
    config.write_text(config_text)
    log_path = work_dir / f"vault-{port}.log"
    command = [sys.executable, "-m", "tierkv", "vault", "--config", str(config)]
    command += ["--listen", f"{host}:{port}", "--max-bytes", max_bytes, "--role", role]
    command += args
    # (an ignored signal stays ignored across exec; a preexec_fn could hang in a child forked
    # from this process's threads)
    ignored = signal.signal(signal.SIGXFSZ, signal.SIG_IGN) if file_size_limit else None
    try:
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
    finally:
        if ignored is not None:
            signal.signal(signal.SIGXFSZ, ignored)
    if file_size_limit:
        limit = (file_size_limit, resource.RLIM_INFINITY)
        resource.prlimit(process.pid, resource.RLIMIT_FSIZE, limit)
    return process, log_path


@pytest.fixture
def vault_factory(tmp_path: Path) -> Iterator[Callable[..., VaultHandle]]:
    handles: list[VaultHandle] = []

    def start(
        max_bytes: int | str = "1GiB",
        *,
        role: str = "kv_cold",
        subprocess: bool = False,
        bulk: bool = True,
        args: Sequence[str] = (),
        config: str = "",
        token: str | None = None,
        file_size_limit: int | None = None,
    ) -> VaultHandle:
        if subprocess:
            port = pick_free_port()
            process, log_path = start_subprocess_vault(
                port, str(max_bytes), role, tmp_path, args, config, file_size_limit=file_size_limit
            )
            handle = VaultHandle(
                address=f"{LOOPBACK}:{port}", port=port, process=process, log_path=log_path
            )
            handles.append(handle)
            _wait_serving(handle.address, process, token)
        else:
            bulk_port = 0 if bulk else None
            server = serve(
                f"{LOOPBACK}:0", parse_max_bytes(max_bytes), role=role, bulk_port=bulk_port
            )
            handle = VaultHandle(address=server.address, port=server.port, server=server)
            handles.append(handle)
        return handle

    yield start
    for handle in handles:
        handle.stop()


@pytest.fixture
def vault(vault_factory: Callable[..., VaultHandle]) -> VaultHandle:
    return vault_factory()


@pytest.fixture(params=["tmp_path", "tmpfs"])
def disk_dir(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    """A plain directory under tmp_path, and one on tmpfs (/dev/shm) where this machine has one."""
    if request.param == "tmp_path":
        yield tmp_path / "disk"
        return
    shm = Path("/dev/shm")
    if not shm.is_dir() or not os.access(shm, os.W_OK):
        pytest.skip("no writable /dev/shm")
    directory = shm / f"tierkv-test-{os.getpid()}-{tmp_path.name}"
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="session")
def real_model() -> Path:
    """SmolLM2-135M-Instruct as a bf16 HF folder (see tests/real_model.py): fetched and converted
    once into the user's cache. Unavailable: a failure in CI (CI set), a skip with the reason
    elsewhere."""
    from real_model import RealModelUnavailable, real_model_dir

    try:
        return real_model_dir()
    except (RealModelUnavailable, OSError) as exc:
        if os.environ.get("CI"):
            pytest.fail(f"the real model is unavailable in CI: {exc}")
        pytest.skip(f"the real model is unavailable: {exc}")


ENGINE_MARKERS = ("vllm", "mlx", "real_model")
_passed_per_marker = dict.fromkeys(ENGINE_MARKERS, 0)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call" and report.passed:
        for marker in ENGINE_MARKERS:
            if marker in report.keywords:
                _passed_per_marker[marker] += 1


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    counts = ", ".join(f"{marker} {count}" for marker, count in _passed_per_marker.items())
    terminalreporter.write_line(f"engine tests passed: {counts}")
    path = os.environ.get("TIERKV_MARKER_COUNTS")
    if path:
        Path(path).write_text(json.dumps(_passed_per_marker))
