"""`tierkv serve`: the vllm command line it builds, its checks, and a real server answering."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import VaultHandle, pick_free_port, wait_until
from typer.testing import CliRunner

from tierkv.cli import app
from tierkv.patches.vllm import HYBRID_FLAG, is_hybrid, serve_command, vllm_launcher

runner = CliRunner()


def write_config(tmp_path: Path, **cluster: str) -> Path:
    path = tmp_path / "tierkv.toml"
    lines = ["[cluster]", *(f'{key} = "{value}"' for key, value in cluster.items())]
    path.write_text("\n".join(lines) + "\n")
    return path


def write_model(tmp_path: Path, **config: object) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(config))
    (model / "tokenizer.json").write_text("{}")
    return model


def dry_run(*args: str) -> tuple[int, list[str], str]:
    result = runner.invoke(app, ["serve", "--dry-run", *args])
    command = shlex.split(result.stdout) if result.exit_code == 0 else []
    return result.exit_code, command, result.stderr


def test_dry_run_prints_vllm_serve_with_the_connector(tmp_path: Path, vault: VaultHandle):
    config = write_config(tmp_path, kv_cold=vault.address)
    model = write_model(tmp_path, model_type="llama", layer_types=None)

    code, command, stderr = dry_run(str(model), "--config", str(config), "--port", "8123")
    launcher = vllm_launcher()

    assert code == 0, stderr
    assert command[: len(launcher)] == launcher
    assert str(model) in command[len(launcher) : len(launcher) + 2]
    transfer = json.loads(command[command.index("--kv-transfer-config") + 1])
    assert transfer == {
        "kv_connector": "TierKVConnector",
        "kv_connector_module_path": "tierkv.connectors.vllm.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"config_path": str(config.resolve())},
    }
    assert "--enable-prefix-caching" in command
    assert command[-2:] == ["--port", "8123"]  # passed through unchanged
    assert HYBRID_FLAG not in command
    assert "down" not in stderr


def test_down_vault_is_a_warning_not_a_refusal(tmp_path: Path):
    config = write_config(tmp_path, kv_cold=f"127.0.0.1:{pick_free_port()}")
    model = write_model(tmp_path, model_type="llama")

    code, command, stderr = dry_run(str(model), "--config", str(config))

    assert code == 0
    assert command[:2] == vllm_launcher()[:2]
    assert "kv_cold" in stderr and "down" in stderr
    assert "vLLM would start anyway" in stderr and "serving anyway" not in stderr


def test_dry_run_shows_the_environment_vllm_would_get(
    tmp_path: Path, vault: VaultHandle, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    config = write_config(tmp_path, kv_cold=vault.address)
    model = write_model(tmp_path, model_type="llama")
    code, _, stderr = dry_run(str(model), "--config", str(config))
    assert code == 0
    assert "environment: GLIBC_TUNABLES=glibc.malloc.hugetlb=1" in stderr


def test_hybrid_can_be_forced_for_a_model_not_downloaded(tmp_path: Path, vault: VaultHandle):
    config = write_config(tmp_path, kv_cold=vault.address, ssm_cold=vault.address)
    args = ["org/not-downloaded-model", "--config", str(config)]
    assert HYBRID_FLAG not in dry_run(*args)[1]
    code, command, stderr = dry_run(*args, "--hybrid")
    assert code == 0, stderr
    assert HYBRID_FLAG in command


def test_a_model_it_cannot_read_is_named_with_how_to_choose(tmp_path: Path, vault: VaultHandle):
    """Not downloaded (no config.json here or in the Hugging Face cache): one line says tierkv
    cannot tell whether the model is hybrid and how to choose; a model it can read, or a choice
    made, gets no such line."""
    config = write_config(tmp_path, kv_cold=vault.address)
    code, command, stderr = dry_run("org/not-downloaded-model", "--config", str(config))
    assert code == 0 and HYBRID_FLAG not in command
    (line,) = [line for line in stderr.splitlines() if "cannot tell" in line]
    assert "org/not-downloaded-model" in line and "--hybrid" in line and "--no-hybrid" in line
    model = write_model(tmp_path, model_type="llama")
    unknown = "org/not-downloaded-model"
    for args in ([str(model)], [unknown, "--no-hybrid"], [unknown, "--hybrid"]):
        config = write_config(tmp_path, kv_cold=vault.address, ssm_cold=vault.address)
        code, _, stderr = dry_run(*args, "--config", str(config))
        assert code == 0 and "cannot tell" not in stderr, stderr


def test_serve_without_vllm_says_how_to_install_it(
    tmp_path: Path, vault: VaultHandle, monkeypatch: pytest.MonkeyPatch
):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *args: None if name == "vllm" else real_find_spec(name, *args),
    )
    config = write_config(tmp_path, kv_cold=vault.address)
    result = runner.invoke(app, ["serve", "some/model", "--config", str(config)])
    assert result.exit_code == 1
    assert result.stderr.startswith("tierkv serve: vLLM is not installed")
    assert 'pip install "./tierkv[vllm]"' in result.stderr


def test_hybrid_model_needs_the_ssm_vault_and_gets_the_hybrid_flag(
    tmp_path: Path, vault_factory: Callable[..., VaultHandle]
):
    kv, ssm = vault_factory(), vault_factory(role="ssm_cold")
    model = write_model(
        tmp_path, model_type="qwen3_next", layer_types=["linear_attention", "full_attention"]
    )

    code, _, stderr = dry_run(
        str(model), "--config", str(write_config(tmp_path, kv_cold=kv.address))
    )
    assert code == 2 and "cluster.ssm_cold" in stderr

    config = write_config(tmp_path, kv_cold=kv.address, ssm_cold=ssm.address)
    code, command, stderr = dry_run(str(model), "--config", str(config))
    assert code == 0, stderr
    assert HYBRID_FLAG in command


def test_refuses_what_tierkv_must_own(tmp_path: Path, vault: VaultHandle):
    config = write_config(tmp_path, kv_cold=vault.address)
    for flag in ("--kv-transfer-config={}", "--no-enable-prefix-caching"):
        code, _, stderr = dry_run("some/model", "--config", str(config), flag)
        assert code == 2 and flag.split("=")[0] in stderr


def test_missing_vault_address_is_named(tmp_path: Path):
    empty = tmp_path / "empty.toml"
    empty.write_text("")
    code, _, stderr = dry_run("some/model", "--config", str(empty))
    assert code == 2 and "cluster.kv_cold" in stderr and str(empty) in stderr


def test_launchers_take_the_model_their_way():
    python_m = ["python", "-m", "vllm.entrypoints.openai.api_server"]
    assert serve_command("m", Path("t.toml"), launcher=python_m)[3:5] == ["--model", "m"]
    assert serve_command("m", Path("t.toml"))[:3] == ["vllm", "serve", "m"]


@pytest.mark.parametrize(
    ("config", "hybrid"),
    [
        ({"layer_types": ["full_attention", "sliding_attention"]}, False),
        ({"layer_types": ["linear_attention", "full_attention"]}, True),
        ({"layers_block_type": ["mamba", "attention"]}, True),
        ({"text_config": {"mamba_d_state": 128}}, True),
        ({"model_type": "llama"}, False),
    ],
)
def test_is_hybrid(config: dict, hybrid: bool):
    assert is_hybrid(config) is hybrid


def completion(port: int, model: Path, tokens: list[int]) -> list[str]:
    """Greedy completion of `tokens` through the OpenAI API, as the generated token ids."""
    body = {
        "model": str(model),
        "prompt": tokens,
        "max_tokens": 8,
        "temperature": 0,
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
    }
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.load(response)["choices"][0]["logprobs"]["tokens"]


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_serve_stores_evicts_and_restores_through_the_openai_api(
    tmp_path: Path, vault: VaultHandle
):
    """The real thing: `tierkv serve` starts vLLM with the connector; a prompt's blocks leave
    vLLM's small KV cache for the vault and come back, with the same greedy tokens.

    Where the CPU lacks an instruction vLLM's CPU kernels use, the server dies with SIGILL on
    the first request: the test then skips and says so, with the server's last words.
    """
    pytest.importorskip("vllm")
    from tiny_models import build_tiny_llama

    from tierkv.keys import chain_block_keys

    model = build_tiny_llama(tmp_path / "llama")
    config = write_config(tmp_path, kv_cold=vault.address)
    port = pick_free_port()
    log_path = tmp_path / "serve.log"
    args = ["--host", "127.0.0.1", "--port", str(port), "--max-model-len", "512"]
    # 48 blocks of 32 tokens: 2 layers x 2 KV heads x 32 tokens x 128 (K|V) x bf16.
    args += ["--block-size", "32", "--kv-cache-memory-bytes", str(48 * 32 * 1024)]
    args += ["--enforce-eager", "--dtype", "bfloat16"]
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "tierkv", "serve", str(model), "--config", str(config), *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:

        def healthy() -> bool:
            assert process.poll() is None, log_path.read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    return bool(r.status == 200)
            except OSError:
                return False

        assert wait_until(healthy, 240, interval=1), log_path.read_text()[-3000:]
        assert log_path.read_text().count("Creating v1 connector with name: TierKVConnector") >= 2
        # `tierkv serve` became vLLM (exec, same pid) with glibc's huge-page heap asked for.
        environ = Path(f"/proc/{process.pid}/environ").read_bytes().split(b"\0")
        assert any(
            line.startswith(b"GLIBC_TUNABLES=") and b"glibc.malloc.hugetlb=1" in line
            for line in environ
        ), environ

        rng = random.Random(0)
        tokens = [rng.randrange(2, 500) for _ in range(300)]
        try:
            cold = completion(port, model, tokens)
        except OSError:
            output = log_path.read_text()
            if "Illegal instruction" in output or "SIGILL" in output:
                pytest.skip(
                    "vLLM's CPU kernels use an instruction this CPU lacks (the server died "
                    f"with SIGILL on the first request): {output[-600:]}"
                )
            raise
        keys = chain_block_keys(tokens, 32)[: (len(tokens) - 1) // 32]
        for _filler in range(4):  # 4 x 15 blocks push the prompt's 10 out of 48
            completion(port, model, [rng.randrange(2, 500) for _ in range(450)])
        assert wait_until(
            lambda: set(keys) <= {key for _, key, _ in vault.store.held()}, 60, interval=0.2
        ), "the prompt's blocks never reached the vault"
        hits = vault.store.stats().hits

        assert completion(port, model, tokens) == cold
        assert vault.store.stats().hits - hits == len(keys)  # restored, one payload per block
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
