"""Prometheus /metrics of a real vault: store figures, Put / Promote traffic on both paths,
rejections by reason, bulk connections; and `tierkv vault --metrics-port` as a process."""

from __future__ import annotations

import contextlib
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import key, pick_free_port, wait_until
from prometheus_client.parser import text_string_to_metric_families

from tierkv.backends.vault import VaultClient, VaultRefused
from tierkv.config import SecurityConfig
from tierkv.vault.metrics import default_metrics_host, rejection_reason
from tierkv.vault.server import VaultBindError, serve

NS = b"metrics-test"


def scrape(
    address: str, tls: ssl.SSLContext | None = None
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics at `address` (HOST:PORT; HTTPS with `tls`): (name, sorted
    labels) -> value."""
    url = f"{'https' if tls else 'http'}://{address}/metrics"
    with urllib.request.urlopen(url, timeout=10, context=tls) as reply:
        text = reply.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def scrape_until(
    address: str, sample: tuple[str, tuple[tuple[str, str], ...]], timeout: float = 30.0
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """`scrape(address)` once it has `sample` (the last scrape, should `timeout` pass)."""
    metrics: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}

    def has_sample() -> bool:
        nonlocal metrics
        metrics = scrape(address)
        return sample in metrics

    wait_until(has_sample, timeout, interval=0.05)
    return metrics


@pytest.mark.parametrize("bulk", [True, False])
def test_metrics_count_what_the_vault_did(bulk: bool) -> None:
    server = serve("127.0.0.1:0", max_bytes=10_000, metrics_port=0, bulk_port=0 if bulk else None)
    client = VaultClient(server.address, deadline_s=10.0)
    try:
        path = "bulk" if bulk else "grpc"
        for i in range(3):
            client.put(NS, key(i), 0, b"x" * 1000)
        assert client.flush(timeout=30)
        assert len(client.promote(NS, [key(0), key(1), key(5)], [0])) == 2
        promote = (("method", "promote"), ("transport", path))
        # The vault counts a call once its reply is sent, which the client may see first.
        metrics = scrape_until(server.metrics_address, ("tierkv_vault_call_seconds_count", promote))
        bulk_connections = ("tierkv_vault_open_connections", (("transport", "bulk"),))
        assert metrics[bulk_connections] == (1 if bulk else 0)
        # Over the cap: rejected (last: the bulk path drops the connection of so large a frame
        # and the client turns to gRPC).
        client.put(NS, key(9), 0, b"y" * 20_000)
        assert client.flush(timeout=30)
        too_large = ("tierkv_vault_rejected_blocks_total", (("reason", "too_large"),))
        metrics = scrape_until(server.metrics_address, too_large)
        assert metrics[too_large] == 1
        assert metrics[("tierkv_vault_blocks", (("tier", "ram"),))] == 3
        assert metrics[("tierkv_vault_payload_bytes", (("tier", "ram"),))] == 3000
        bookkeeping = metrics[("tierkv_vault_bookkeeping_bytes", (("tier", "ram"),))]
        assert bookkeeping + 3000 == server.store.stats().bytes_used  # what the cap counts
        assert metrics[("tierkv_vault_cap_bytes", (("tier", "ram"),))] == 10_000
        assert metrics[("tierkv_vault_hits_total", (("tier", "ram"),))] == 2
        assert metrics[("tierkv_vault_misses_total", ())] == 1
        put = (("method", "put"), ("transport", path))
        assert metrics[("tierkv_vault_transfer_bytes_total", put)] >= 3000
        assert metrics[("tierkv_vault_transfer_bytes_total", promote)] == 2000
        assert metrics[("tierkv_vault_call_seconds_count", promote)] == 1
        assert metrics[("tierkv_vault_call_seconds_count", put)] >= 1
        assert ("tierkv_vault_blocks", (("tier", "disk"),)) not in metrics
    finally:
        client.close()
        server.stop()


def test_metrics_show_the_disk_tier(tmp_path: Path) -> None:
    from tierkv.vault.disk import DiskTier

    disk = DiskTier(tmp_path, 1 << 30, "never")
    server = serve("127.0.0.1:0", max_bytes=0, metrics_port=0, disk=disk)
    try:
        metrics = scrape(server.metrics_address)
        assert metrics[("tierkv_vault_blocks", (("tier", "disk"),))] == 0
        assert metrics[("tierkv_vault_cap_bytes", (("tier", "disk"),))] == 1 << 30
        assert metrics[("tierkv_vault_disk_kept_blocks_total", ())] == 0
        assert metrics[("tierkv_vault_disk_corrupt_blocks_total", ())] == 0
    finally:
        server.stop()
        server.store.close(timeout=10)


def test_no_metrics_unless_asked() -> None:
    server = serve("127.0.0.1:0", max_bytes=0)
    try:
        assert server.metrics_address == ""
    finally:
        server.stop()


def test_a_taken_metrics_port_is_a_bind_error() -> None:
    first = serve("127.0.0.1:0", max_bytes=0, metrics_port=0)
    try:
        with pytest.raises(VaultBindError, match=r"cannot serve metrics on 127\.0\.0\.1:"):
            taken = int(first.metrics_address.rsplit(":", 1)[1])
            serve("127.0.0.1:0", max_bytes=0, metrics_port=taken)
    finally:
        first.stop()


def test_metrics_stay_on_loopback_unless_the_vault_is_open_or_needs_client_certificates() -> None:
    # /metrics checks no token: beyond loopback it is served only --insecure or over mutual TLS.
    assert default_metrics_host("10.1.2.3", insecure=False, mutual_tls=False) == "127.0.0.1"
    assert default_metrics_host("0.0.0.0", insecure=False, mutual_tls=False) == "127.0.0.1"
    assert default_metrics_host("::", insecure=False, mutual_tls=False) == "::1"
    assert default_metrics_host("10.1.2.3", insecure=True, mutual_tls=False) == "10.1.2.3"
    assert default_metrics_host("10.1.2.3", insecure=False, mutual_tls=True) == "10.1.2.3"
    assert default_metrics_host("127.0.0.1", insecure=False, mutual_tls=False) == "127.0.0.1"
    assert default_metrics_host("::1", insecure=False, mutual_tls=False) == "::1"


def test_metrics_over_mutual_tls_need_a_client_certificate(tmp_path: Path) -> None:
    from tests.tls_certs import make_certs

    certs = make_certs(tmp_path)
    security = SecurityConfig(
        tls_cert=str(certs.server_cert), tls_key=str(certs.server_key), client_ca=str(certs.ca)
    )
    server = serve("127.0.0.1:0", max_bytes=1 << 20, security=security, metrics_port=0)
    try:
        tls = ssl.create_default_context(cafile=str(certs.ca))
        with pytest.raises(OSError):  # no client certificate: the handshake fails
            scrape(server.metrics_address, tls)
        tls.load_cert_chain(str(certs.client_cert), str(certs.client_key))
        metrics = scrape(server.metrics_address, tls)
        assert metrics[("tierkv_vault_cap_bytes", (("tier", "ram"),))] == 1 << 20
    finally:
        server.stop()


def test_rejection_reasons_have_few_labels() -> None:
    assert rejection_reason("entry of 5 bytes exceeds the vault cap of 1 bytes") == "too_large"
    assert rejection_reason("key of 300 bytes exceeds limits.max_key_bytes (256)") == "key_too_long"
    assert rejection_reason("checksum mismatch: payload corrupted") == "checksum"
    assert rejection_reason("malformed batch: PutIndex arrays differ") == "malformed"
    assert rejection_reason("namespace quota exceeded") == "other"


@pytest.mark.parametrize("where", ["default", "config", "option"])
def test_vault_command_serves_metrics(where: str, tmp_path: Path) -> None:
    # /metrics on the (loopback) listen host, else on the address vault.metrics_host or
    # --metrics-host names: 127.0.0.2, loopback too on Linux.
    port, metrics_port = pick_free_port(), pick_free_port()
    host = "127.0.0.1" if where == "default" else "127.0.0.2"
    config = tmp_path / "tierkv.toml"
    config.write_text(
        f"[vault]\nmetrics_port = {metrics_port}\n"
        + (f'metrics_host = "{host}"\n' if where == "config" else "")
    )
    command = [sys.executable, "-m", "tierkv", "vault", "--listen", f"127.0.0.1:{port}"]
    command += ["--max-bytes", "1GiB", "--config", str(config)]
    if where == "option":
        command += ["--metrics-host", host]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert f"metrics on {host}:{metrics_port}" in line, line + process.stderr.read()  # type: ignore[union-attr]

        def listening() -> bool:
            try:
                scrape(f"{host}:{metrics_port}")
            except OSError:
                return False
            return True

        assert wait_until(listening, 30, interval=0.1)
        metrics = scrape(f"{host}:{metrics_port}")
        assert metrics[("tierkv_vault_cap_bytes", (("tier", "ram"),))] == 1 << 30
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_failed_authentication_is_counted_per_path() -> None:
    from tierkv.backends.vault_bulk import BulkConnection, BulkError
    from tierkv.vault.auth import Tokens

    server = serve(
        "127.0.0.1:0", 0, tokens=Tokens([("default", "right-token-0123")]), metrics_port=0
    )
    wrong = "wrong-token-0123"
    try:
        client = VaultClient(server.address, token=wrong, deadline_s=10)
        with client, pytest.raises(VaultRefused):
            client.stats()
        # The bulk port's handshake refuses the proof and closes the connection.
        with contextlib.suppress(BulkError):
            BulkConnection("127.0.0.1", server.bulk_port, 5.0, token=wrong).close()
        bulk_failures = ("tierkv_vault_auth_failures_total", (("transport", "bulk"),))
        metrics = scrape_until(server.metrics_address, bulk_failures)
        assert metrics[bulk_failures] == 1
        assert metrics[("tierkv_vault_auth_failures_total", (("transport", "grpc"),))] >= 1
    finally:
        server.stop()


def test_grpc_connections_and_calls_refused_by_a_concurrency_limit_are_counted() -> None:
    import threading

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from tierkv.config import LimitsConfig
    from tierkv.wire._pb import vault_pb2, vault_pb2_grpc

    limits = LimitsConfig(max_concurrent_rpcs=4)  # at most 2 Put / Promote streams
    server = serve("127.0.0.1:0", max_bytes=0, metrics_port=0, limits=limits)
    own_connection = [("grpc.use_local_subchannel_pool", 1)]
    channels = [grpc.insecure_channel(server.address, options=own_connection) for _ in range(3)]
    stop = threading.Event()

    def never_ending() -> Iterator[bytes]:
        stop.wait(30)
        yield from ()

    try:
        for channel in channels:
            grpc.channel_ready_future(channel).result(timeout=10)
        connections = ("tierkv_vault_open_connections", (("transport", "grpc"),))
        assert scrape(server.metrics_address)[connections] == 3
        put = channels[0].stream_unary("/tierkv.v1.Vault/Put", request_serializer=lambda b: b)
        puts = [put.future(never_ending()) for _ in range(3)]  # the third: beyond 2 streams
        with pytest.raises(grpc.RpcError) as refused:
            puts[2].result(timeout=10)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        health = health_pb2_grpc.HealthStub(channels[1])
        watches = [health.Watch(health_pb2.HealthCheckRequest()) for _ in range(2)]
        for watch in watches:
            next(watch)  # held open: 4 calls now
        stub = vault_pb2_grpc.VaultStub(channels[2])
        with pytest.raises(grpc.RpcError) as refused:
            stub.Lookup(vault_pb2.LookupRequest(namespace=NS, keys=[key(0)], parts=[0]), timeout=10)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        metrics = scrape(server.metrics_address)
        refused_calls = "tierkv_vault_refused_calls_total"
        assert metrics[(refused_calls, (("reason", "concurrency_limit"),))] == 1
        assert metrics[(refused_calls, (("reason", "stream_limit"),))] == 1
        for watch in watches:
            watch.cancel()
        stop.set()
        channels.pop().close()
        wait_until(lambda: scrape(server.metrics_address)[connections] <= 2, 30, interval=0.05)
        assert scrape(server.metrics_address)[connections] == 2
    finally:
        stop.set()
        for channel in channels:
            channel.close()
        server.stop(grace=0)


def test_metrics_follow_the_prometheus_conventions(tmp_path: Path) -> None:
    from tierkv import __version__
    from tierkv.vault.disk import DiskTier
    from tierkv.vault.metrics import (
        REFUSED_CALL_REASONS,
        REFUSED_CONNECTION_REASONS,
        REJECTION_REASONS,
        TRANSPORTS,
    )

    before = time.time()
    disk = DiskTier(tmp_path, 1 << 30, "never")
    server = serve("127.0.0.1:0", max_bytes=0, metrics_port=0, disk=disk)
    try:
        url = f"http://{server.metrics_address}/metrics"
        with urllib.request.urlopen(url, timeout=10) as reply:
            families = list(text_string_to_metric_families(reply.read().decode()))
        metrics = scrape(server.metrics_address)
    finally:
        server.stop()
        server.store.close(timeout=10)
    documented = (Path(__file__).parent.parent / "docs" / "metrics.md").read_text()
    for family in families:
        assert family.name.startswith("tierkv_"), family.name
        shown = family.name + ("_total" if family.type == "counter" else "")
        assert f"`{shown}`" in documented, f"docs/metrics.md does not list {shown}"
        for sample in family.samples:
            assert not sample.name.endswith("_created"), sample.name
            if family.type == "counter":
                assert sample.name.endswith("_total"), sample.name
    # Before any event, each labelled counter has a zero series per known label value.
    zero = {
        "tierkv_vault_rejected_blocks_total": ("reason", REJECTION_REASONS),
        "tierkv_vault_refused_connections_total": ("reason", REFUSED_CONNECTION_REASONS),
        "tierkv_vault_refused_calls_total": ("reason", REFUSED_CALL_REASONS),
        "tierkv_vault_auth_failures_total": ("transport", TRANSPORTS),
    }
    for name, (label, values) in zero.items():
        for value in values:
            assert metrics[(name, ((label, value),))] == 0, (name, value)
    for method in ("put", "promote"):
        for transport in TRANSPORTS:
            labels = (("method", method), ("transport", transport))
            assert metrics[("tierkv_vault_transfer_bytes_total", labels)] == 0
            assert metrics[("tierkv_vault_call_seconds_count", labels)] == 0
    assert metrics[("tierkv_build_info", (("version", __version__),))] == 1
    assert metrics[("tierkv_vault_info", (("role", "kv_cold"),))] == 1
    assert before <= metrics[("tierkv_vault_start_time_seconds", ())] <= time.time()
    free = metrics[("tierkv_vault_disk_filesystem_free_bytes", ())]
    assert 0 < free <= metrics[("tierkv_vault_disk_filesystem_size_bytes", ())]
    assert metrics[("tierkv_vault_disk_recovery_damaged_ranges", ())] == 0


def test_metrics_can_listen_on_an_address_of_their_own() -> None:
    server = serve("127.0.0.1:0", max_bytes=0, metrics_port=0, metrics_host="127.0.0.2")
    try:
        assert server.metrics_address.startswith("127.0.0.2:")
        assert scrape(server.metrics_address)[("tierkv_vault_cap_bytes", (("tier", "ram"),))] == 0
    finally:
        server.stop()


def test_a_bad_or_useless_metrics_host_is_one_clear_line(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from tierkv.cli import app

    runner = CliRunner()
    result = runner.invoke(app, ["vault", "--metrics-port", "0", "--metrics-host", "banana"])
    assert result.exit_code == 2
    assert "--metrics-host: expected an IP address" in result.output
    assert "'banana'" in result.output
    config = tmp_path / "tierkv.toml"
    config.write_text('[vault]\nmetrics_host = "10.0.0.999"\n')
    result = runner.invoke(app, ["vault", "--config", str(config)])
    assert result.exit_code == 2
    assert "vault.metrics_host: expected an IP address" in result.output
    result = runner.invoke(app, ["vault", "--metrics-host", "127.0.0.1"])
    assert result.exit_code == 2
    assert "--metrics-host without a metrics port: set --metrics-port" in result.output
