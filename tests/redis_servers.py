"""Real Valkey / Redis servers for tests: one server, or a 3-node Redis Cluster, on loopback.

`start_redis(work_dir)` -> RedisServer and `start_cluster(work_dir)` -> list[RedisServer] run the
installed `valkey-server` / `redis-server` binary (.ci/run installs it) on free 127.0.0.1 ports,
without persistence, with `maxmemory-policy allkeys-lru`. `require_redis()` skips the test,
saying why, when no server binary is installed. Call `.stop()` / `.kill()` (SIGKILL) when done.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from helpers import LOOPBACK, pick_free_port, wait_until

from tests.tls_certs import Certs

START_TIMEOUT_S = 30.0


def server_binary() -> str | None:
    return shutil.which("valkey-server") or shutil.which("redis-server")


def cli_binary() -> str | None:
    return shutil.which("valkey-cli") or shutil.which("redis-cli")


def require_redis() -> str:
    """The server binary, or a loud skip naming what is missing."""
    binary = server_binary()
    if binary is None or cli_binary() is None:
        pytest.skip(
            "NO valkey-server/redis-server (+ its cli) INSTALLED: the Redis backend tests need "
            "it (.ci/run installs redis-server with apt-get)"
        )
    return binary


@dataclass
class RedisServer:
    port: int
    process: subprocess.Popen[bytes]
    certs: Certs | None = None
    """Set: the server speaks TLS only, with these certificates (clients need none)."""

    @property
    def address(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    def client(self) -> redis.Redis:
        tls = {"ssl": True, "ssl_ca_certs": str(self.certs.ca)} if self.certs else {}
        return redis.Redis(host=LOOPBACK, port=self.port, socket_timeout=5, **tls)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


def start_redis(work_dir: Path, *extra: str, certs: Certs | None = None) -> RedisServer:
    """A server on a free loopback port (TLS only with `certs`), answering PING when returned."""
    binary = require_redis()
    port = pick_free_port()
    node_dir = work_dir / f"redis-{port}"
    node_dir.mkdir(parents=True)
    command = [binary, "--bind", LOOPBACK, "--dir", str(node_dir)]
    command += ["--save", "", "--appendonly", "no", "--maxmemory-policy", "allkeys-lru"]
    if certs is None:
        command += ["--port", str(port)]
    else:
        command += ["--port", "0", "--tls-port", str(port), "--tls-auth-clients", "no"]
        command += ["--tls-cert-file", str(certs.server_cert), "--tls-key-file"]
        command += [str(certs.server_key), "--tls-ca-cert-file", str(certs.ca)]
    log = (node_dir / "server.log").open("wb")
    process = subprocess.Popen([*command, *extra], stdout=log, stderr=subprocess.STDOUT)
    server = RedisServer(port, process, certs)
    client = server.client()

    def answers() -> bool:
        """Whether it answers PING (or asks for a password); a dead server fails at once."""
        try:
            client.ping()
        except (redis.AuthenticationError, redis.ResponseError):
            pass  # up, and asks for a password
        except redis.RedisError:
            if server.process.poll() is None:
                return False
            server.stop()
            raise RuntimeError(f"redis on port {port} did not start; see {node_dir}") from None
        finally:
            client.close()
        return True

    if not wait_until(answers, START_TIMEOUT_S, interval=0.05):
        server.stop()
        raise RuntimeError(f"redis on port {port} did not start; see {node_dir}")
    return server


def start_cluster(work_dir: Path, nodes: int = 3) -> list[RedisServer]:
    """`nodes` primaries (no replicas) in one cluster whose state is ok on every node.

    cluster-require-full-coverage is off, so a dead node costs its slots only.
    """
    servers = [
        start_redis(
            work_dir,
            "--cluster-enabled",
            "yes",
            "--cluster-node-timeout",
            "1000",
            "--cluster-require-full-coverage",
            "no",
            "--cluster-port",  # the default, port + 10000, may be taken or past 65535
            str(pick_free_port()),
        )
        for _ in range(nodes)
    ]
    try:
        addresses = [server.address for server in servers]
        create = [str(cli_binary()), "--cluster", "create", *addresses]
        subprocess.run(
            [*create, "--cluster-replicas", "0", "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=START_TIMEOUT_S,
        )
        clients = [server.client() for server in servers]
        try:
            ok = wait_until(
                lambda: all(
                    client.execute_command("CLUSTER INFO").get("cluster_state") == "ok"
                    for client in clients
                ),
                START_TIMEOUT_S,
                interval=0.1,
            )
        finally:
            for client in clients:
                client.close()
        if not ok:
            raise RuntimeError("the test cluster did not reach cluster_state:ok")
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers
