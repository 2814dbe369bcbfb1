"""`tierkv eval`: what a restore through each codec does to a model's greedy continuations, and
the gate that records the smallest codec a model tolerates.

For every codec, in one vLLM engine: each prompt runs cold (its blocks are stored through the
codec when it finishes), vLLM's prefix cache is dropped, and the prompt runs again, restored from
the vault. The restored continuation is compared with the cold one of the same pass: identical
or not, where it first differs, and the KL divergence of the next-token distributions over the
positions both runs reached with the same tokens, estimated from the top-k log-probabilities
(`topk_kl`). Each codec pass salts its requests, so it can only restore its own blocks.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import tomlkit

from tierkv.bench_engines import in_engine_process, long_prompt, start_vllm, worker_connector

TOP_K = 20
"""Log-probabilities vLLM returns per generated position (its default `max_logprobs`)."""
BUILTIN_PROMPTS = 8
BUILTIN_LENGTHS = (0.25, 0.5, 0.75, 1.0)
"""The built-in prompts' lengths, as shares of `--tokens` (two texts of each)."""
ARTICLE_TOKENS = 50
"""The TurboQuant restore article's check: the first 50 greedy tokens identical after restore."""


def builtin_prompts(tokens: int) -> list[tuple[str, int]]:
    """(text, tokens to keep) of the built-in prompt set: varied texts of four lengths."""
    return [
        (long_prompt(tokens, seed=100 + index), max(1, int(tokens * share)))
        for index, share in enumerate(BUILTIN_LENGTHS * (BUILTIN_PROMPTS // len(BUILTIN_LENGTHS)))
    ]


def topk_kl(reference: Mapping[int, float], restored: Mapping[int, float], vocab: int) -> float:
    """KL(reference || restored) in nats from two top-k log-probability maps (token -> logprob).

    The vocabulary is folded into the reference's listed tokens plus one bucket for all others,
    whose probability is whatever the listed ones leave. A listed token the restored run did not
    list gets an even share of the restored run's unlisted mass (at most its smallest listed
    probability). Identical maps give exactly 0; the fold can only lower a true divergence, the
    even share can move it either way.
    """
    q_listed = [math.exp(logprob) for logprob in restored.values()]
    q_left = max(0.0, 1.0 - sum(q_listed))
    q_unlisted = min(q_left / max(1, vocab - len(restored)), min(q_listed, default=1.0))
    kl = 0.0
    p_sum = q_sum = 0.0
    for token, logprob in reference.items():
        p = math.exp(logprob)
        if token in restored:
            q, log_q = math.exp(restored[token]), restored[token]
        else:
            q, log_q = q_unlisted, math.log(max(q_unlisted, 1e-30))
        p_sum, q_sum = p_sum + p, q_sum + q
        kl += p * (logprob - log_q)
    p_rest, q_rest = max(0.0, 1.0 - p_sum), max(1e-30, 1.0 - q_sum)
    if p_rest > 0.0:
        kl += p_rest * math.log(p_rest / q_rest)
    return max(0.0, kl)


def first_difference(reference: Sequence[int], restored: Sequence[int]) -> int | None:
    """Index of the first differing token (a length difference counts), None when identical."""
    for index, (a, b) in enumerate(zip(reference, restored, strict=False)):
        if a != b:
            return index
    return None if len(reference) == len(restored) else min(len(reference), len(restored))


@dataclass
class PromptEval:
    """One prompt through one codec."""

    prompt_tokens: int
    restored_tokens: int
    first_diff: int | None
    mean_kl: float


@dataclass
class CodecEval:
    """One codec over the prompt set."""

    codec: str
    new_tokens: int
    stored_ratio: float
    prompts: list[PromptEval] = field(default_factory=list)

    @property
    def identical(self) -> float:
        """Share of prompts whose continuation is identical to the cold one."""
        return sum(p.first_diff is None for p in self.prompts) / len(self.prompts)

    @property
    def mean_first_diff(self) -> float:
        """Mean position of the first differing token (an identical continuation counts as its
        length)."""
        return statistics.fmean(
            self.new_tokens if p.first_diff is None else p.first_diff for p in self.prompts
        )

    @property
    def mean_kl(self) -> float:
        return statistics.fmean(p.mean_kl for p in self.prompts)

    @property
    def restored_fraction(self) -> float:
        """Share of all prompt tokens that came from the vault instead of a prefill."""
        return sum(p.restored_tokens for p in self.prompts) / sum(
            p.prompt_tokens for p in self.prompts
        )

    @property
    def article_identical(self) -> int:
        """Prompts whose first ARTICLE_TOKENS generated tokens are identical."""
        reach = min(ARTICLE_TOKENS, self.new_tokens)
        return sum(p.first_diff is None or p.first_diff >= reach for p in self.prompts)

    def passes(self, min_identical: float, max_kl: float) -> bool:
        """The gate: enough identical continuations and a small enough mean KL."""
        return self.identical >= min_identical and self.mean_kl <= max_kl

    def as_json(self) -> dict[str, Any]:
        return {
            "codec": self.codec,
            "identical": self.identical,
            "mean_first_diff": self.mean_first_diff,
            "mean_kl": self.mean_kl,
            "restored_fraction": self.restored_fraction,
            "stored_ratio": self.stored_ratio,
            f"first_{ARTICLE_TOKENS}_identical": self.article_identical,
            "prompts": [asdict(p) for p in self.prompts],
        }


@dataclass
class EvalReport:
    """Every codec's figures for one model, and what the gate made of them."""

    model: str
    fingerprint: str | None
    new_tokens: int
    top_k: int
    seconds: float
    codecs: list[CodecEval]

    def verdict(self, min_identical: float, max_kl: float) -> CodecEval | None:
        """The codec storing the fewest bytes among those that pass the gate."""
        passing = [c for c in self.codecs if c.passes(min_identical, max_kl)]
        return max(passing, key=lambda c: c.stored_ratio, default=None)

    def as_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "fingerprint": self.fingerprint,
            "new_tokens": self.new_tokens,
            "top_k": self.top_k,
            "seconds": self.seconds,
            "codecs": [c.as_json() for c in self.codecs],
        }


def vllm_eval(
    model: str,
    prompts: Sequence[tuple[str, int | None]],
    codecs: Sequence[str],
    *,
    new_tokens: int,
    connector_config: dict[str, object],
    kv_dim: int,
    kv_cache_bytes: int | None = None,
) -> EvalReport:
    """Evaluate `codecs` on `prompts` ((text, tokens to keep or None)) in one vLLM engine run in
    a fresh process (see `in_engine_process`)."""
    started = time.perf_counter()
    found = in_engine_process(
        "eval",
        {
            "model": model,
            "prompts": [list(prompt) for prompt in prompts],
            "codecs": list(codecs),
            "new_tokens": new_tokens,
            "connector_config": connector_config,
            "kv_dim": kv_dim,
            "kv_cache_bytes": kv_cache_bytes,
        },
    )
    return engine_report(model, new_tokens, time.perf_counter() - started, found)


def engine_report(
    model: str, new_tokens: int, seconds: float, found: list[dict[str, Any]]
) -> EvalReport:
    """The report of what `eval_in_this_process` returned."""
    from tierkv.connectors.vllm.groups import model_fingerprint

    return EvalReport(
        model=model,
        fingerprint=model_fingerprint(model),
        new_tokens=new_tokens,
        top_k=TOP_K,
        seconds=seconds,
        codecs=[
            CodecEval(
                c["codec"], new_tokens, c["stored_ratio"], [PromptEval(**p) for p in c["prompts"]]
            )
            for c in found
        ],
    )


def eval_in_this_process(
    model: str,
    prompts: list[tuple[str, int | None]],
    codecs: list[str],
    new_tokens: int,
    connector_config: dict[str, object],
    kv_dim: int,
    kv_cache_bytes: int | None,
) -> list[dict[str, Any]]:
    """The engine side of `vllm_eval`: one engine, one pass per codec (its codec set on the
    worker's tier, which encodes every stored block), as plain dicts."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    tokenizer = AutoTokenizer.from_pretrained(model)
    token_ids = []
    for text, keep in prompts:
        ids = tokenizer(text)["input_ids"]
        token_ids.append(ids[:keep] if keep else ids)
    settings = {**connector_config, "connector.store": "on_finish", "turbo_quant.enabled": False}
    llm = start_vllm(
        model,
        max_model_len=max(len(ids) for ids in token_ids) + new_tokens + 8,
        connector_config=settings,
        kv_cache_bytes=kv_cache_bytes,
        max_logprobs=TOP_K,
    )
    from tierkv.quant import get_codec  # Numba only once vLLM has started (see in_engine_process)

    vocab = llm.llm_engine.model_config.get_vocab_size()
    params = SamplingParams(max_tokens=new_tokens, temperature=0, logprobs=TOP_K)
    tier = worker_connector().tier
    results = []
    for codec in codecs:
        tier.codec = get_codec(codec, kv_dim)

        def run(salt: str) -> list[Any]:
            # One prompt at a time: a prompt's cold and restored runs then differ only in where
            # its prefill starts, not in which other prompts share the batch.
            return [
                llm.generate(
                    [TokensPrompt(prompt_token_ids=ids, cache_salt=salt)], params, use_tqdm=False
                )[0]
                for ids in token_ids
            ]

        before = tier.stats()
        cold = run(f"tierkv-eval-{codec}")
        llm.generate(
            [TokensPrompt(prompt_token_ids=[2, 3])], SamplingParams(max_tokens=1), use_tqdm=False
        )
        if not tier.flush(timeout=600):  # ^ one more step: the finished prompts' blocks go out
            raise RuntimeError("the vault did not acknowledge the prompts' blocks")
        after = tier.stats()
        llm.reset_prefix_cache()
        restored = run(f"tierkv-eval-{codec}")
        stored = after["queued_payload_bytes"] - before["queued_payload_bytes"]
        raw = after["queued_raw_bytes"] - before["queued_raw_bytes"]
        results.append(
            {
                "codec": codec,
                "stored_ratio": raw / stored if stored else 0.0,
                "prompts": [
                    asdict(_compare(a, b, vocab)) for a, b in zip(cold, restored, strict=True)
                ],
            }
        )
    return results


def _compare(cold: Any, restored: Any, vocab: int) -> PromptEval:
    """One prompt's cold and restored vLLM outputs compared."""
    a, b = cold.outputs[0], restored.outputs[0]
    diff = first_difference(a.token_ids, b.token_ids)
    shared = len(a.token_ids) if diff is None else diff + 1  # the first differing position too
    kls = [
        topk_kl(
            {t: lp.logprob for t, lp in a.logprobs[i].items()},
            {t: lp.logprob for t, lp in b.logprobs[i].items()},
            vocab,
        )
        for i in range(min(shared, len(a.logprobs), len(b.logprobs)))
    ]
    return PromptEval(
        prompt_tokens=len(cold.prompt_token_ids),
        restored_tokens=restored.num_cached_tokens or 0,
        first_diff=diff,
        mean_kl=statistics.fmean(kls) if kls else 0.0,
    )


def write_verdict(
    path: Path, report: EvalReport, verdict: CodecEval, min_identical: float, max_kl: float
) -> None:
    """Record `verdict` for the report's model in `[codec_verdicts]` of the tierkv.toml at
    `path` (created if missing; everything else in it is kept), the figures as a comment."""
    if report.fingerprint is None:
        raise ValueError(f"no weight files found for {report.model}: nothing to key a verdict by")
    document = (
        tomlkit.parse(path.read_text(encoding="utf-8")) if path.exists() else tomlkit.document()
    )
    verdicts = document.get("codec_verdicts")
    if verdicts is None:
        verdicts = tomlkit.table()
        document["codec_verdicts"] = verdicts
    entry = tomlkit.item(verdict.codec)
    entry.comment(
        f"{Path(report.model).name}: {verdict.identical:.0%} identical over "
        f"{len(verdict.prompts)} prompts x {report.new_tokens} tokens, mean KL "
        f"{verdict.mean_kl:.2g}, {verdict.stored_ratio:.2f}x smaller (gate: >= "
        f"{min_identical:.0%} identical, KL <= {max_kl:g}; tierkv eval {time.strftime('%Y-%m-%d')})"
    )
    verdicts[report.fingerprint] = entry
    path.write_text(tomlkit.dumps(document), encoding="utf-8")
