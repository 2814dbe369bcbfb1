"""`tierkv bench --engine vllm` on a real vLLM CPU engine, the bench's prompts and its usage errors.

`--engine exo` runs against the EXO fixture in tests/test_exo_bench.py.
"""

import json
from pathlib import Path

import pytest
from tiny_models import build_tiny_llama
from typer.testing import CliRunner

from tierkv.bench.prompts import long_prompt
from tierkv.cli import app


def test_long_prompt_is_varied_and_deterministic() -> None:
    text = long_prompt(3000)
    sentences = text.split(". ")
    assert len(text.split()) >= 3000
    assert len(set(sentences)) > 0.95 * len(sentences), "no sentence loop"
    assert long_prompt(3000) == text
    assert long_prompt(3000, seed=1) != text


@pytest.mark.parametrize(
    ("args", "named"),
    [(["--engine", "tgi"], "tgi"), (["--engine", "exo", "--model", "m"], "--exo-api")],
)
def test_engine_bad_input_is_named(args: list[str], named: str) -> None:
    out = CliRunner().invoke(app, ["bench", *args])
    assert out.exit_code == 2
    assert named in out.output


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_cli_engine_vllm_restores_from_the_vault_with_the_same_tokens(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    model = build_tiny_llama(tmp_path / "llama")
    args = ["bench", "--engine", "vllm", "--model", str(model), "--tokens", "400", "--json"]
    args += ["--kv-cache-bytes", "64MiB"]
    out = CliRunner().invoke(app, args)
    assert out.exit_code == 0, out.output
    report = json.loads(out.stdout)
    assert report["prompt_tokens"] == 400
    assert [run["label"] for run in report["runs"]] == [
        "cold",
        "engine prefix hit",
        "vault restore",
    ]
    # vLLM's CPU blocks are 128 tokens and it computes the last prompt token itself: both the
    # engine's own hit and the vault's restore are the 3 full blocks before it.
    assert [run["cached_tokens"] for run in report["runs"]] == [0, 384, 384]
    assert report["outputs_match"]
