"""Shared fixtures: free loopback ports and real vaults (no mocks, only 127.0.0.1); the plain
helpers the tests import are in helpers.py.

`free_port` (fixture, int)
    A TCP port on 127.0.0.1 that was free a moment ago (helpers.pick_free_port()).

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

`spawn` (fixture, callable)
    ``spawn(args, **popen_kwargs) -> subprocess.Popen`` starts a child process for the test;
    any still running at teardown is killed and reaped, so a failing test leaves none behind.

`disk_dir` (fixture, Path; parametrized)
    A directory for a vault's disk tier that does not exist yet: under tmp_path, and on tmpfs
    (/dev/shm, removed afterwards; skipped where there is none).

Engine tests that ran: the summary names how many tests of each engine marker (vllm, mlx,
real_model) passed,
and with TIERKV_MARKER_COUNTS=path the same counts are written there as JSON, so CI can fail when
an engine's tests were all skipped.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
from helpers import LOOPBACK, VaultHandle, pick_free_port, start_subprocess_vault, wait_serving

from tierkv.config import parse_max_bytes
from tierkv.vault.server import serve


@pytest.fixture
def free_port() -> int:
    return pick_free_port()


@pytest.fixture
def spawn() -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []

    def start(args: Sequence[str], **kwargs: object) -> subprocess.Popen[bytes]:
        process = subprocess.Popen(args, **kwargs)  # type: ignore[call-overload]
        started.append(process)
        return process

    yield start
    for process in started:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)


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
            wait_serving(handle.address, process, token)
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
