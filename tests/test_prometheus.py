"""deploy/'s alert rules and Grafana dashboard against a real vault and a real Prometheus.

Each test starts one `tierkv vault` process (disk tier, a token, /metrics on loopback) and gives
it some work (stores, reads, a miss, a wrong token); its /metrics text is what the tests
compare with: `promtool check rules`, `promtool test rules` (the checked-in tests, and again with
every other series of that scrape added), the metric names of the dashboard's and the rules'
expressions, and a Prometheus that scrapes the vault and answers queries through its HTTP API.
Without `promtool` / `prometheus` (apt-get install prometheus; .ci/run does) the tests skip, or
fail where CI is set.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from helpers import LOOPBACK, VaultHandle, pick_free_port, wait_until
from prometheus_client.parser import text_string_to_metric_families

from tests.prometheus_files import (
    DASHBOARD,
    RULE_TESTS,
    RULES,
    Series,
    dashboard_exprs,
    format_series,
    metric_names,
    parse_series,
    rule_exprs,
    rule_test_series,
)
from tierkv.backends.vault import VaultClient, VaultRefused

JOB, INSTANCE = "tierkv-vault", "vault-a:9464"
"""The job the rules expect, and the instance the checked-in rule tests name."""
BLOCK = b"k" * 4096
ENGINE_PREFIX = "vllm:"
"""Metrics of the engine side (the connector's, on vLLM's /metrics), not of a vault."""


def _binary(name: str) -> str:
    """The path of `name`, else a skip (a failure where CI is set) naming what to install."""
    path = shutil.which(name)
    if path is None:
        reason = f"NO {name} INSTALLED: apt-get install prometheus (.ci/run installs it)"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    return path


@dataclass(frozen=True)
class Scrape:
    """A vault's /metrics once it did some work: where it is served, and its samples."""

    address: str
    samples: dict[Series, float]

    def names(self) -> set[str]:
        return {name for name, _ in self.samples}


@pytest.fixture
def scraped(vault_factory: Callable[..., VaultHandle], tmp_path: Path) -> Scrape:
    token = secrets.token_hex(16)
    (tmp_path / "tokens").write_text(f"{token}\n")
    (tmp_path / "tokens").chmod(0o600)
    metrics_port = pick_free_port()
    args = ["--disk-dir", str(tmp_path / "disk"), "--metrics-port", str(metrics_port)]
    vault = vault_factory(
        subprocess=True,
        args=[*args, "--metrics-host", LOOPBACK],
        config=f'[security]\ntoken_file = "{tmp_path / "tokens"}"\n',
        token=token,
    )
    with VaultClient(vault.address, token=token, deadline_s=10) as client:
        for i in range(3):
            client.put(b"ns", i.to_bytes(16, "little"), 0, BLOCK)
        assert client.flush(timeout=30)
        assert len(client.promote(b"ns", [(0).to_bytes(16, "little"), b"absent"], [0])) == 1
    wrong = VaultClient(vault.address, token="wrong-" + token, deadline_s=10)
    with wrong, pytest.raises(VaultRefused):
        wrong.stats()
    address = f"{LOOPBACK}:{metrics_port}"
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    samples = {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    return Scrape(address, samples)


def test_the_alert_rules_are_valid() -> None:
    promtool = _binary("promtool")
    result = subprocess.run(
        [promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 7 rules found" in result.stdout


def test_the_alert_rules_pass_their_tests_with_a_real_vaults_series(
    scraped: Scrape, tmp_path: Path
) -> None:
    promtool = _binary("promtool")
    where = {("job", JOB), ("instance", INSTANCE)}
    for name, labels in rule_test_series():
        if name.startswith(ENGINE_PREFIX):
            continue  # the connector's, on vLLM's /metrics: tests/test_vllm_parts.py checks them
        shown = format_series((name, labels))
        assert where <= labels, f"{shown}: not of job {JOB}, instance {INSTANCE}"
        if name != "up":  # up: Prometheus's own, per target
            assert (name, labels - where) in scraped.samples, f"{shown}: no such series on a vault"
    # Each test again, with every series of the scrape it does not set held at its value.
    checked_in = yaml.safe_load(RULE_TESTS.read_text())
    for group in checked_in["tests"]:
        own = {parse_series(entry["series"]) for entry in group["input_series"]}
        group["input_series"] += [
            {"series": format_series((name, labels | where)), "values": f"{value:f}+0x130"}
            for (name, labels), value in sorted(scraped.samples.items())
            if (name, labels | where) not in own
        ]
    checked_in["rule_files"] = [str(RULES)]
    generated = tmp_path / "alerts-with-a-real-scrape.test.yml"
    generated.write_text(yaml.safe_dump(checked_in, sort_keys=False))
    for tests in (RULE_TESTS, generated):
        result = subprocess.run(
            [promtool, "test", "rules", str(tests)], capture_output=True, text=True, timeout=120
        )
        print(result.stdout + result.stderr)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "SUCCESS" in result.stdout


def test_the_dashboard_and_the_rules_read_only_metrics_a_vault_exports(scraped: Scrape) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    for panel in dashboard["panels"]:
        place = panel["gridPos"]
        assert place["x"] + place["w"] <= 24 and place["h"] > 0, panel["title"]
        assert panel["targets"] and panel["datasource"]["type"] == "prometheus", panel["title"]
    exprs = dashboard_exprs()
    for expr in exprs:
        assert metric_names(expr), f"no metric found in {expr!r}"
    read = set().union(*map(metric_names, exprs))
    exported = scraped.names() | {"up"}
    assert read <= exported, f"the dashboard reads {sorted(read - exported)}, no vault exports"
    rules_read = set().union(*map(metric_names, rule_exprs()))
    vault_rules_read = {name for name in rules_read if not name.startswith(ENGINE_PREFIX)}
    assert vault_rules_read <= exported, f"the rules read {sorted(vault_rules_read - exported)}"
    titles = " ".join(panel["title"].lower() for panel in dashboard["panels"])
    for topic in ("hit rate", "tier", "put", "latency", "refusals", "auth", "connections", "disk"):
        assert topic in titles, topic


def test_metric_names_are_found_in_promql() -> None:
    expr = 'sum by (le, tier) (rate(a_total{x="b c"}[5m] offset 1h)) / on (job) b or vector(1)'
    assert metric_names(expr) == {"a_total", "b"}
    assert metric_names("time() - start_seconds") == {"start_seconds"}


def _query(base: str, expr: str) -> dict[str, object]:
    url = f"{base}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
    with urllib.request.urlopen(url, timeout=10) as reply:
        answer: dict[str, object] = json.load(reply)
    return answer


def test_prometheus_scrapes_a_running_vault(scraped: Scrape, tmp_path: Path) -> None:
    prometheus = _binary("prometheus")
    port = pick_free_port()
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [
            {"job_name": JOB, "static_configs": [{"targets": [scraped.address]}]},
        ],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    command = [prometheus, f"--config.file={tmp_path / 'prometheus.yml'}"]
    command += [
        f"--storage.tsdb.path={tmp_path / 'data'}",
        f"--web.listen-address={LOOPBACK}:{port}",
    ]
    log = (tmp_path / "prometheus.log").open("wb")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://{LOOPBACK}:{port}"
    payload = 'tierkv_vault_payload_bytes{job="tierkv-vault", tier="ram"}'
    try:
        answer: dict[str, object] = {}

        def scraped_it() -> bool:
            nonlocal answer
            assert process.poll() is None, (tmp_path / "prometheus.log").read_text()
            try:
                answer = _query(base, payload)
            except OSError:  # not listening yet
                return False
            return bool(answer["data"]["result"])  # type: ignore[index]

        wait_until(scraped_it, 25, interval=0.2)
        result = answer["data"]["result"]  # type: ignore[index]
        assert result, f"Prometheus never scraped the vault: {answer}"
        assert float(result[0]["value"][1]) == 3 * len(BLOCK)
        assert result[0]["metric"]["instance"] == scraped.address
        # Every dashboard query is valid PromQL to this Prometheus.
        for expr in dashboard_exprs():
            concrete = expr.replace("$__rate_interval", "1m").replace("$instance", ".*")
            assert _query(base, concrete)["status"] == "success", concrete
        up = _query(base, f'up{{job="{JOB}"}}')["data"]["result"]  # type: ignore[index]
        assert float(up[0]["value"][1]) == 1
        with urllib.request.urlopen(f"{base}/api/v1/rules", timeout=10) as reply:
            groups = json.load(reply)["data"]["groups"]
        assert sum(len(group["rules"]) for group in groups) == 7
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()
