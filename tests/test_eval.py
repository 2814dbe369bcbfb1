"""`tierkv eval` and the codec gate: the scoring on hand-made numbers, and end to end on the vLLM
CPU engine with a tiny random-weight model (one eval engine, then one engine with codec auto)."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
from helpers import VaultHandle
from test_vllm_connector import LLAMA_ENGINE, Engine
from tiny_models import build_tiny_llama, build_tiny_qwen3_next, build_tokenizer
from typer.testing import CliRunner

from tierkv.bench.eval import (
    PASSKEY_DEPTHS,
    CodecEval,
    DtypeEval,
    EvalReport,
    Gate,
    PromptEval,
    engine_start_error,
    passkey_ids,
    passkey_probes,
    restorable_length,
    score_run,
    teacher_forced,
    top2_gap,
    topk_kl,
    write_verdict,
)
from tierkv.bench.prompts import long_prompt
from tierkv.cli import app
from tierkv.config import CompressionConfig, TierKVConfig, load_config, resolve_auto_codec

LN = math.log


def test_kl_is_zero_for_identical_maps_and_grows_with_the_difference() -> None:
    p = {1: LN(0.6), 2: LN(0.3)}
    assert topk_kl(p, dict(p)) == 0.0
    close = topk_kl(p, {1: LN(0.55), 2: LN(0.35)})
    far = topk_kl(p, {3: LN(0.9), 1: LN(0.05)})
    assert 0 < close < far
    # By hand: 0.6 ln(0.6/0.55) + 0.3 ln(0.3/0.35) + 0.1 ln(0.1/0.1), the rest one bucket.
    assert close == pytest.approx(0.6 * LN(0.6 / 0.55) + 0.3 * LN(0.3 / 0.35), abs=1e-12)


def test_kl_of_top_k_maps_never_exceeds_the_true_kl_when_tokens_swap_at_rank_k() -> None:
    """A tiny perturbation swaps tokens across the k-th rank: the one the restored run no longer
    lists must not count as all but absent from it (the eval's KL for int8 on SmolLM2 was
    mostly that, 0.0011 against 0.00014)."""
    import numpy as np

    vocab, k = 1000, 100
    zipf = -2.0 * np.log(np.arange(1.0, vocab + 1))  # a trained model's tail, roughly
    log_p = zipf - np.logaddexp.reduce(zipf)

    def top(logprobs: np.ndarray) -> dict[int, float]:
        return {int(token): float(logprobs[token]) for token in np.argsort(-logprobs)[:k]}

    swapped = log_p.copy()
    swapped[[k - 1, k]] = swapped[[k, k - 1]]  # ranks k and k + 1 trade places
    true = float(np.sum(np.exp(log_p) * (log_p - swapped)))
    assert 0 < true < 1e-5
    assert set(top(log_p)) != set(top(swapped))
    assert topk_kl(top(log_p), top(swapped)) <= true

    rng, swaps = np.random.default_rng(53), 0
    for _ in range(20):  # small noise on every logit: true KL about 1e-4
        noisy = zipf + rng.normal(0.0, 0.03, vocab)
        log_q = noisy - np.logaddexp.reduce(noisy)
        true = float(np.sum(np.exp(log_p) * (log_p - log_q)))
        folded = topk_kl(top(log_p), top(log_q))
        assert 0.9 * true <= folded <= true
        swaps += set(top(log_p)) != set(top(log_q))
    assert swaps >= 2


def test_teacher_forced_scores_kl_top1_and_a_tie_at_the_first_difference() -> None:
    sure = {7: LN(0.9), 8: LN(0.05)}  # top-2 gap ln(18) = 2.9 nats
    close = {7: LN(0.48), 8: LN(0.46)}  # gap 0.043 nats: a tie
    hit = [sure, close, sure]
    swapped = {7: LN(0.46), 8: LN(0.48)}
    found = teacher_forced(hit, [sure, swapped, sure])
    kl = (0.48 * LN(0.48 / 0.46) + 0.46 * LN(0.46 / 0.48)) / 3
    assert found == {
        "positions": 3,
        "kl": pytest.approx(kl, abs=1e-12),
        "top1": 2,
        "first_diff": 1,
        "tie": True,
    }
    assert top2_gap(close) == pytest.approx(LN(0.48 / 0.46))
    # The same flip where the hit was sure is no tie; a gap of 0.1 nat or more is none either.
    flipped = {8: LN(0.9), 7: LN(0.05)}
    assert teacher_forced(hit, [flipped, swapped, sure])["tie"] is False
    wide = {7: LN(0.5), 8: LN(0.5 * math.exp(-0.1))}
    assert teacher_forced([wide], [{8: 0.0}], tie_nats=0.1)["tie"] is False
    assert teacher_forced([wide], [{8: 0.0}], tie_nats=0.11)["tie"] is True
    same = teacher_forced(hit, hit)
    assert (same["kl"], same["top1"], same["first_diff"], same["tie"]) == (0.0, 3, None, False)


def test_passkey_probes_cover_lengths_depths_and_keys(tmp_path: Path) -> None:
    found = passkey_probes(30, 8192)
    assert len(found) == 30
    lengths = sorted({p["tokens"] for p in found})
    assert lengths[0] == 1024 and lengths[-1] == 8192 and len(lengths) == 6
    for length in lengths:  # every depth at every length, 0 % to 100 %
        assert sorted(p["depth"] for p in found if p["tokens"] == length) == list(PASSKEY_DEPTHS)
    assert len({p["seed"] for p in found}) == 30
    assert {p["tokens"] for p in passkey_probes(3, 500)} == {500}  # a short context: its length
    tokenizer = build_tokenizer(tmp_path / "tokenizer", vocab_size=2000)
    keys = set()
    for spec in [{**p, "tokens": 300} for p in found]:
        ids, key = passkey_ids(tokenizer, spec)
        keys.add(key)
        assert len(ids) == 300
        text = tokenizer.decode(ids)
        assert f"The pass key is {key}." in text
        assert text.endswith("What is the pass key? The pass key is")
    assert len(keys) == 30


def test_a_text_is_cut_so_its_continuation_never_fills_a_block() -> None:
    assert restorable_length(300, 128, 16) == 300  # 44 tokens after two blocks, + 16 < 128
    assert restorable_length(250, 128, 16) == 128 + 111  # 122 + 16 would fill the block
    assert restorable_length(256, 128, 16) == 128 + 111  # whole blocks: one goes back to tail
    assert restorable_length(100, 128, 16) == 0  # no block to restore
    with pytest.raises(ValueError, match="--new-tokens 127: at most 126"):
        restorable_length(300, 128, 127)


def text(kl: float, top1: int, first_diff: int | None = None, tie: bool = False) -> PromptEval:
    return PromptEval(600, 512, None, 10, kl, top1, first_diff, tie)


def probe(correct: bool, hit: bool) -> PromptEval:
    return PromptEval(1024, 1024, "passkey", correct=correct, reference_correct=hit)


def test_counts_of_identical_ties_diverged_and_passkeys_kept() -> None:
    codec = CodecEval(
        "k8v4",
        2.6,
        [
            text(0.0, 10),
            text(0.002, 9, 4, tie=True),
            text(0.006, 8, 0),
            probe(True, True),
            probe(False, True),
            probe(True, False),
            probe(False, False),
        ],
    )
    assert (codec.identical, codec.ties, codec.diverged) == (1, 1, 1)
    assert codec.positions == 30 and codec.top1 == pytest.approx(27 / 30)
    assert codec.kl == pytest.approx(0.008 / 3)
    assert (codec.reference_found, codec.found, codec.kept, len(codec.probes)) == (2, 2, 1, 4)


def two_runs(*codecs: tuple[str, float, float, int, bool]) -> EvalReport:
    """A bf16 model's report: per codec (name, ratio, float32 KL, float32 top-1 of 100, whether
    the bf16 run keeps both passkeys its hit finds)."""

    def run(dtype: str) -> DtypeEval:
        rows = []
        for name, ratio, kl, top1, keeps in codecs:
            forced = PromptEval(600, 512, None, 100, kl, top1)
            rows.append(CodecEval(name, ratio, [forced, probe(True, True), probe(keeps, True)]))
        floor = CodecEval("vLLM hit vs cold", 1.0, [PromptEval(600, 512), *[probe(True, True)] * 2])
        return DtypeEval(dtype, 1.0, rows, floor)

    return EvalReport(
        "dir/model", "f" * 32, "bfloat16", 64, 100, 0.1, [run("float32"), run("bfloat16")]
    )


def test_the_gate_picks_the_smallest_codec_keeping_passkeys_kl_and_top1(tmp_path: Path) -> None:
    found = two_runs(
        ("none", 1.0, 0.0, 100, True),
        ("int8", 1.97, 0.0001, 100, True),
        ("k8v4", 2.6, 0.0016, 98, True),
        ("tq4", 3.9, 0.004, 97, False),  # loses a passkey the hit finds
        ("tq3", 5.1, 0.02, 90, True),  # KL and top-1 too far
    )
    gate = Gate()
    assert (gate.max_kl, gate.min_top1) == (0.005, 0.97)
    verdict = found.verdict(gate)
    assert verdict is not None and verdict.codec == "k8v4"
    assert found.verdict(Gate(max_kl=0.001)).codec == "int8"  # type: ignore[union-attr]
    assert found.verdict(Gate(min_top1=0.99)).codec == "int8"  # type: ignore[union-attr]
    assert found.passes("tq4", Gate(max_kl=1, min_top1=0)) is False  # the passkey decides
    assert found.passes("tq3", Gate(max_kl=1, min_top1=0)) is True
    found.runs[1].codecs[2].prompts[0].restored_tokens = 384  # k8v4 lost a block: recomputed
    assert found.verdict(gate).codec == "int8"  # type: ignore[union-attr]
    found.runs.pop(0)
    assert found.verdict(gate) is None  # no float32 run: no verdict
    path = tmp_path / "tierkv.toml"
    path.write_text('[cluster]\nkv_cold = "127.0.0.1:5"  # mine\n')
    full = two_runs(("k8v4", 2.6, 0.0016, 98, True))
    write_verdict(path, full, full.verdict(gate), gate)  # type: ignore[arg-type]
    written = path.read_text()
    assert 'kv_cold = "127.0.0.1:5"  # mine' in written  # the user's file is kept
    assert "2.60x smaller, 2/2 of the hit's passkeys (bfloat16)" in written
    assert "top-1 98.0% over 100 positions (float32)" in written
    assert load_config(path).codec_verdicts == {"f" * 32: "k8v4"}


def test_score_run_compares_each_codec_with_the_hit_and_the_hit_with_cold() -> None:
    def forced(*pairs: tuple[int, float]) -> dict:
        return {
            "prompt_tokens": 300,
            "cached_tokens": 256,
            "task": None,
            "positions": [[[t, lp] for t, lp in pairs]],
            "correct": None,
        }

    def answered(correct: bool) -> dict:
        return {"prompt_tokens": 1024, "cached_tokens": 1024, "task": "passkey"} | {
            "positions": None,
            "correct": correct,
        }

    a, b = forced((1, LN(0.7)), (2, LN(0.3))), forced((2, LN(0.6)), (1, LN(0.4)))
    found = {
        "hit": [a, answered(True)],
        "cold": [b, answered(False)],
        "codecs": [{"codec": "none", "stored_ratio": 1.0, "runs": [a, answered(True)]}],
    }
    scored = score_run("float32", 2.0, found, tie_nats=0.1)
    floor, none = scored.floor, scored.codecs[0]
    assert floor.kl == pytest.approx(0.6 * LN(0.6 / 0.3) + 0.4 * LN(0.4 / 0.7))
    assert (floor.top1, floor.diverged, floor.found, floor.reference_found) == (0.0, 1, 1, 0)
    assert (none.kl, none.identical, none.kept, none.reference_found) == (0.0, 1, 1, 1)
    assert scored.self_test_failures() == 0
    found["codecs"][0]["runs"][1] = answered(False)  # none lost a key the hit found
    assert score_run("float32", 2.0, found, 0.1).self_test_failures() == 1


def test_an_engine_that_cannot_start_ends_with_one_line_naming_the_flag() -> None:
    line = engine_start_error(
        ValueError("long\ntraceback\nNo available memory for the cache blocks."), 1024
    )
    assert "\n" not in line and "No available memory for the cache blocks." in line
    assert "--kv-cache-bytes (now 1024)" in line


def test_cli_refuses_a_gate_without_float32_and_a_bad_dtype(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"torch_dtype": "bfloat16"}')
    base = ["eval", "--model", str(model)]
    out = CliRunner().invoke(app, [*base, "--dtype", "model", "--write-config", "x.toml"])
    assert out.exit_code == 2
    assert "the gate needs float32 and the model's bfloat16" in out.stderr
    out = CliRunner().invoke(app, [*base, "--dtype", "int4"])
    assert out.exit_code == 2 and "--dtype 'int4': 'int4' is not float32" in out.stderr
    out = CliRunner().invoke(app, [*base, "--codecs", "none,tq9"])
    assert out.exit_code == 2 and "unknown codec 'tq9'" in out.stderr


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
def test_eval_writes_the_verdict_its_measurements_pass_and_codec_auto_stores_with_it(
    tmp_path: Path, vault: VaultHandle
) -> None:
    """A tiny random-weight Llama whose config says float32 (one engine serves both runs the gate
    needs): `tierkv eval --write-config`, then an engine with codec auto stores with the verdict."""
    pytest.importorskip("vllm")
    model = build_tiny_llama(tmp_path / "llama")
    hf_config = json.loads((model / "config.json").read_text())
    hf_config.pop("dtype", None)
    (model / "config.json").write_text(json.dumps({**hf_config, "torch_dtype": "float32"}))
    config = tmp_path / "tierkv.toml"
    config.write_text(
        f'[cluster]\nkv_cold = "{vault.address}"\n[connector]\nstore = "on_finish"\n'
        '[compression]\nenabled = true\ncodec = "auto"\ngroup_size = 64\n'
    )
    args = ["eval", "--model", str(model), "--codecs", "none,int8,tq3", "--tokens", "600"]
    args += ["--new-tokens", "16", "--probes", "5", "--passkey-tokens", "200", "--config"]
    args += [str(config), "--vault", vault.address, "--kv-cache-bytes", "16MiB", "--json"]
    out = CliRunner().invoke(app, [*args, "--write-config", str(config)])
    assert out.exit_code == 0, out.output
    assert "tierkv: eval (float32): tq3: restore 13 prompts" in out.stderr
    found = json.loads(out.stdout)
    (run,) = found["runs"]
    assert (run["dtype"], run["self_test_failures"]) == ("float32", 0)
    floor, (none, *lossy) = run["floor"], run["codecs"]
    assert (floor["texts"], floor["probes"], none["probes"]) == (8, 5, 5)
    assert none["kl"] == 0.0 and none["identical"] == 8 and none["positions"] > 8 * 8
    assert none["restored_fraction"] > 0.5 and 0.9 < none["stored_ratio"] <= 1.0
    assert all(c["kl"] > 0 and c["stored_ratio"] > 3 for c in lossy)
    passing = [c for c in run["codecs"] if c["kl"] <= 0.005 and c["top1"] >= 0.97]
    verdict = max(passing, key=lambda c: c["stored_ratio"])["codec"]
    assert found["verdict"] == verdict != "none"
    assert load_config(config).codec_verdicts == {found["fingerprint"]: verdict}

    auto = Engine(model, {"config_path": str(config)}, LLAMA_ENGINE)
    try:
        rng = random.Random(3)
        auto.generate([rng.randrange(2, 500) for _ in range(200)])
        auto.generate([5, 6, 7])  # one more step: the blocks go out
        assert auto.call("flush")
        tier = auto.stats()["tier"]
        assert tier["queued_payload_bytes"] > 0
        assert tier["queued_raw_bytes"] / tier["queued_payload_bytes"] > 1.5  # lossy, not none
    finally:
        auto.close()


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_eval_on_the_hybrid_model_restores_and_none_is_exact(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    model = build_tiny_qwen3_next(tmp_path / "qwen3-next")
    prompts = tmp_path / "prompts.jsonl"  # two blocks of 640 (vLLM's page for this model) each
    prompts.write_text("".join(json.dumps(long_prompt(1300, seed=s)) + "\n" for s in (1, 2)))
    args = ["eval", "--model", str(model), "--codecs", "none,k8v4", "--tokens", "1300"]
    args += ["--prompts", str(prompts)]
    args += ["--new-tokens", "8", "--kv-cache-bytes", "1700000", "--dtype", "model"]
    args += ["--probes", "0", "--json"]  # the passkeys need a trained model
    out = CliRunner().invoke(app, args)
    assert out.exit_code == 0, out.output
    (run,) = json.loads(out.stdout)["runs"]
    none, pair = run["codecs"]
    assert (run["dtype"], run["self_test_failures"]) == ("bfloat16", 0)
    assert (none["kl"], none["identical"], none["texts"]) == (0.0, 2, 2)
    assert none["restored_fraction"] > 0.3 and pair["restored_fraction"] > 0.3
