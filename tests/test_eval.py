"""`tierkv eval` and the codec gate: metrics on hand-made inputs, and end to end on the vLLM CPU
engine with the tiny random-weight models (one engine per model)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import VaultHandle
from tiny_models import build_tiny_llama, build_tiny_qwen3_next, build_tokenizer
from typer.testing import CliRunner

from tierkv.bench.eval import (
    CodecEval,
    EvalReport,
    PromptEval,
    builtin_prompts,
    engine_report,
    engine_start_error,
    first_difference,
    passkey_ids,
    task_prompts,
    topk_kl,
    write_verdict,
)
from tierkv.cli import app
from tierkv.config import CompressionConfig, TierKVConfig, load_config, resolve_auto_codec

_ZERO_CODEC_ENGINE = """
import json, sys
import numpy as np
import tierkv.bench.eval as bench_eval

class ZeroCodec:
    '''Deliberately destructive: stores every block as zeros (a valid lossless payload).'''
    name = "zero"
    def __init__(self, group_size):
        self.group_size = group_size
    def encode(self, src, dtype=None):
        from tierkv.quant import get_codec
        return get_codec("none", self.group_size).encode(np.zeros_like(src), dtype)

start = bench_eval.start_vllm
def start_then_register(*args, **kwargs):
    llm = start(*args, **kwargs)  # Numba (the codecs) loads only after vLLM started
    from tierkv.quant import codec
    codec._FACTORIES["zero"] = ZeroCodec
    return llm
bench_eval.start_vllm = start_then_register
found = bench_eval.eval_in_this_process(**json.loads(sys.argv[1]))
print("RESULT " + json.dumps(found))
"""


def test_kl_is_zero_for_identical_maps_and_grows_with_the_difference() -> None:
    p = {1: math.log(0.6), 2: math.log(0.3)}
    assert topk_kl(p, dict(p), vocab=512) == 0.0
    close = topk_kl(p, {1: math.log(0.55), 2: math.log(0.35)}, vocab=512)
    far = topk_kl(p, {3: math.log(0.9), 1: math.log(0.05)}, vocab=512)
    assert 0 < close < far


def test_first_difference() -> None:
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2, 3], [1, 2]) == 2


def report(*codecs: tuple[str, float, list[int | None], float]) -> EvalReport:
    return EvalReport(
        "dir/model",
        "f" * 32,
        50,
        20,
        1.0,
        [
            CodecEval(name, 50, ratio, [PromptEval(100, 96, d, kl) for d in diffs])
            for name, ratio, diffs, kl in codecs
        ],
    )


def test_the_gate_picks_the_smallest_passing_codec_and_writes_it_with_its_figures(
    tmp_path: Path,
) -> None:
    found = report(
        ("none", 1.0, [None, None], 0.0),
        ("int8", 1.9, [None, None], 0.001),
        ("tq3", 4.3, [None, 3], 0.2),  # too few identical
    )
    verdict = found.verdict(0.95, 0.01)
    assert verdict is not None and verdict.codec == "int8"
    path = tmp_path / "tierkv.toml"
    path.write_text('[cluster]\nkv_cold = "127.0.0.1:5"  # mine\n')
    write_verdict(path, found, verdict, 0.95, 0.01)
    text = path.read_text()
    assert 'kv_cold = "127.0.0.1:5"  # mine' in text  # the user's file is kept
    assert "100% identical over 2 prompts x 50 tokens" in text and "1.90x smaller" in text
    assert load_config(path).codec_verdicts == {"f" * 32: "int8"}
    assert report(("tq3", 4.3, [3, 3], 0.2)).verdict(0.95, 0.01) is None


def test_the_gate_weighs_task_accuracy_and_none_must_match_the_hit() -> None:
    def scored(codec: str, ratio: float, correct: list[bool], diff: int | None) -> CodecEval:
        prompts = [PromptEval(100, 96, None, 0.0)]
        prompts += [PromptEval(100, 96, diff, 0.0, task="passkey", correct=c) for c in correct]
        return CodecEval(codec, 8, ratio, prompts)

    found = EvalReport(
        "m",
        "f" * 32,
        8,
        20,
        1.0,
        [scored("none", 1.0, [True, True], None), scored("tq3", 4.3, [True, False], 2)],
    )
    assert found.codecs[1].accuracy("passkey") == 0.5
    assert found.verdict(0.95, 0.01).codec == "tq3"  # type: ignore[union-attr]
    assert found.verdict(0.95, 0.01, min_task_accuracy=0.75).codec == "none"  # type: ignore[union-attr]
    assert found.self_test_failures() == 0
    found.codecs[0].prompts[1].first_diff = 3  # none parted from vLLM's own hit on a task prompt
    assert found.self_test_failures() == 1


def test_passkey_prompt_has_its_length_its_key_inside_and_the_question_last(
    tmp_path: Path,
) -> None:
    tokenizer = build_tokenizer(tmp_path / "tokenizer", vocab_size=2000)
    for spec in task_prompts([300])[:3]:
        ids, key = passkey_ids(tokenizer, spec)
        assert len(ids) == 300
        text = tokenizer.decode(ids)
        assert f"The pass key is {key}." in text
        assert text.endswith("What is the pass key? The pass key is")
    depths = [text_before_key(tokenizer, spec) for spec in task_prompts([300])[:3]]
    assert depths == sorted(depths) and depths[0] < 0.2 < 0.7 < depths[-1]
    counting = task_prompts([])
    assert len(counting) == 8 and all(p["task"] == "counting" for p in counting)
    last = counting[0]["text"].splitlines()[-1].split(", ")
    assert int(counting[0]["answer"]) == int(last[-2]) + 1


def text_before_key(tokenizer: object, spec: dict) -> float:
    ids, key = passkey_ids(tokenizer, spec)
    text = tokenizer.decode(ids)  # type: ignore[attr-defined]
    return text.index(key) / len(text)


def test_an_engine_that_cannot_start_ends_with_one_line_naming_the_flag() -> None:
    line = engine_start_error(
        ValueError("long\ntraceback\nNo available memory for the cache blocks."), 1024
    )
    assert "\n" not in line and "No available memory for the cache blocks." in line
    assert "--kv-cache-bytes (now 1024)" in line


def test_codec_auto_uses_the_verdict_for_this_model_and_lossless_otherwise(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "tierkv.toml"
    path.write_text(
        '[compression]\nenabled = true\ncodec = "auto"\n[codec_verdicts]\nabc = "k8v4"\n'
    )
    cfg = load_config(path)
    assert resolve_auto_codec(cfg, lambda: "abc").compression.codec_name == "k8v4"
    with caplog.at_level("WARNING"):
        for _ in range(2):
            assert resolve_auto_codec(cfg, lambda: "other").compression.codec_name == "none"
    assert caplog.text.count("holds no verdict for model other") == 1
    fixed = TierKVConfig(compression=CompressionConfig(enabled=True, codec="tq4"))
    unused = resolve_auto_codec(fixed, lambda: pytest.fail("a fixed codec needs no fingerprint"))
    assert unused is fixed


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_llama_eval_none_is_exact_and_a_destructive_codec_is_caught_by_the_gate(
    tmp_path: Path, vault: VaultHandle
) -> None:
    pytest.importorskip("vllm")
    model = str(build_tiny_llama(tmp_path / "llama"))
    arguments = {
        "model": model,
        "prompts": builtin_prompts(256)[:4],
        "codecs": ["none", "k8v4", "zero"],
        "new_tokens": 16,
        "connector_config": {"cluster.kv_cold": vault.address},
        "group_size": 64,
        "kv_cache_bytes": 8 << 20,
    }
    engine = subprocess.run(
        [sys.executable, "-c", _ZERO_CODEC_ENGINE, json.dumps(arguments)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert engine.returncode == 0, engine.stderr[-4000:]
    line = next(x for x in engine.stdout.splitlines() if x.startswith("RESULT "))
    found = engine_report(model, 16, 0.0, json.loads(line.removeprefix("RESULT ")))
    none, pair, zero = found.codecs
    assert (none.identical, none.mean_kl) == (1.0, 0.0)  # against vLLM's own hit
    assert found.self_test_failures() == 0
    assert found.floor is not None and found.floor.restored_fraction > 0.3  # the hits hit
    assert none.restored_fraction > 0.3  # most of every prompt came from the vault
    assert 0.9 < none.stored_ratio <= 1.0
    assert pair.stored_ratio > 1.5 and pair.restored_fraction == none.restored_fraction
    assert not zero.passes(0.95, 0.01) and zero.identical < 1.0
    verdict = found.verdict(0.95, 0.01)
    assert verdict is not None and verdict.codec != "zero"
    path = tmp_path / "tierkv.toml"
    write_verdict(path, found, verdict, 0.95, 0.01)
    assert "zero" not in path.read_text()
    assert found.fingerprint is not None
    assert load_config(path).codec_verdicts == {found.fingerprint: verdict.codec}


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_cli_eval_on_the_hybrid_model_writes_its_verdict(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    model = build_tiny_qwen3_next(tmp_path / "qwen3-next")
    config = tmp_path / "tierkv.toml"
    config.write_text("[compression]\ngroup_size = 64\n")
    args = ["eval", "--model", str(model), "--codecs", "none,k8v4", "--tokens", "1200"]
    args += ["--new-tokens", "8", "--kv-cache-bytes", "1700000", "--config", str(config)]
    args += ["--passkey-lengths", "", "--no-counting"]  # the tasks need a trained model
    out = CliRunner().invoke(app, [*args, "--json", "--write-config", str(config)])
    assert out.exit_code == 0, out.output
    assert "tierkv: eval: k8v4: restore prompt 8/8" in out.stderr  # progress per codec, prompt
    found = json.loads(out.stdout)
    none = found["codecs"][0]
    assert (none["codec"], none["identical"], none["mean_kl"]) == ("none", 1.0, 0.0)
    assert none["restored_fraction"] > 0.3
    assert load_config(config).codec_verdicts == {found["fingerprint"]: found["verdict"]}
