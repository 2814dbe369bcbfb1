"""Plain helpers the tests import (conftest.py keeps the fixtures; pytest discourages
importing conftest): loopback ports, vaults started by hand, waiting, keys, fault injection.

`pick_free_port()`
    A TCP port on 127.0.0.1 that was free a moment ago (the `free_port` fixture gives one).

`VaultHandle`
    A vault started for a test (what conftest's `vault_factory` returns; see conftest.py).
    `start_subprocess_vault(...)` starts the real ``tierkv vault`` command and
    `wait_serving(address, process, token)` returns once it answers health SERVING.

`stop_process(pid, timeout=10.0)`
    SIGSTOP a server process and return only once every one of its threads has stopped: `kill`
    only queues the stop, and until each thread takes it the others go on answering (a "hung"
    vault that still served lookups made a dead-vault test flaky in CI).

`SLOW_BOX_MARGIN_S`
    What a time bound adds to a configured deadline ("never much past it"): enough for a
    2-core CI box busy with other work. Speed itself is measured by benchmarks, not tests.

`wait_until(condition, timeout, interval=0.02)`
    Poll `condition` until it holds or `timeout` seconds passed; its last answer.

`key(i)`
    The 16-byte block key number `i` (little-endian), as the vault tests use.

`flip_byte(store, entry_key, index)` and `alias_entry(store, entry_key, other_key)`
    Fault injection below the vault's API, on an in-process vault's store: a stored payload
    with one byte flipped (its checksum then fails), or filed under another key as well.
"""

from __future__ import annotations

import os
import resource
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tierkv.backends.vault import VaultClient
from tierkv.vault.server import VaultServer
from tierkv.vault.store import EntryKey, VaultStore, entry_bytes

LOOPBACK = "127.0.0.1"
SLOW_BOX_MARGIN_S = 3.0
START_TIMEOUT_S = 60.0


def wait_until(condition: Callable[[], bool], timeout: float, interval: float = 0.02) -> bool:
    """Whether `condition()` held within `timeout` seconds, asked every `interval` seconds (its
    answer once more at the deadline). An exception it raises fails at once."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return condition()


def key(i: int) -> bytes:
    """Block key number `i`: 16 bytes, little-endian."""
    return i.to_bytes(16, "little")


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

    def stopped() -> bool:
        states = [_thread_state(stat) for stat in Path(f"/proc/{pid}/task").glob("*/stat")]
        return all(state in ("T", "t", "") for state in states)

    if not wait_until(stopped, timeout, interval=0.005):
        raise TimeoutError(f"process {pid} did not stop within {timeout} s")


@dataclass
class VaultHandle:
    """A vault started for a test; see conftest.py's docstring."""

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


def wait_serving(
    address: str, process: subprocess.Popen[bytes] | None = None, token: str | None = None
) -> None:
    """Return once the vault at `address` answers health SERVING (fails if `process` exits)."""
    client = VaultClient(address, deadline_s=1.0, token=token)

    def ready() -> bool:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"tierkv vault exited with {process.returncode}")
        return client.wait_ready(0.5)

    try:
        if not wait_until(ready, START_TIMEOUT_S, interval=0):
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


def flip_byte(store: VaultStore, entry_key: EntryKey, index: int) -> None:
    """Flip byte `index` of the payload stored at `entry_key`, keeping its checksum (which then
    fails): a payload damaged in the vault's memory, which no API call can store."""
    with store._lock:
        payload, checksum = store._entries[entry_key]
        damaged = bytearray(payload)
        damaged[index] ^= 0xFF
        store._entries[entry_key] = (bytes(damaged), checksum)


def alias_entry(store: VaultStore, entry_key: EntryKey, other_key: bytes) -> None:
    """File the entry at `entry_key` under `other_key` as well (same namespace and part), with
    the checksum of its own address: the vault's index pointing a key at another key's bytes."""
    namespace, _, part = entry_key
    with store._lock:
        payload, checksum = store._entries[entry_key]
        store._entries[(namespace, other_key, part)] = (payload, checksum)
        store._namespaces[namespace].parts[other_key] = (part,)
        store._bytes_used += entry_bytes(namespace, other_key, len(payload))
