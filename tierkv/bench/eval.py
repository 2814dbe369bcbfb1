"""`tierkv eval`: what a restore through each codec does to a model's greedy continuations and
task answers, and the gate that records the smallest codec a model tolerates.

All in one vLLM engine. Each prompt first runs cold, then at once again: vLLM's own prefix-cache
hit of it (the same block boundaries a restore has, no tierkv), the baseline of every codec; the
hit against the cold run is the engine's own floor (in bf16 the two can part: prefilling the last
block over cached KV rounds differently). Then for every codec each prompt is prefilled once under
the codec's cache salt (its blocks are stored through the codec when it finishes), vLLM's prefix
cache is dropped, and the prompt runs again, restored from the vault. The restored continuation is
compared with the hit and with the cold run: identical or not, where it first differs, and the KL
divergence of the next-token distributions over the positions both reached with the same tokens,
estimated from the top-k log-probabilities (`topk_kl`). Scored tasks (passkey retrieval in long
filler, and a few-shot counting task) give cold and restored accuracy. `none` must generate the
hit's tokens on every prompt: the harness's self-test.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import tomlkit

from tierkv.bench.engine_process import in_engine_process, progress, start_vllm, worker_connector
from tierkv.bench.prompts import long_prompt

TOP_K = 20
"""Log-probabilities vLLM returns per generated position (its default `max_logprobs`)."""
BUILTIN_PROMPTS = 8
BUILTIN_LENGTHS = (0.25, 0.5, 0.75, 1.0)
"""The built-in prompts' lengths, as shares of `--tokens` (two texts of each)."""
ARTICLE_TOKENS = 50
"""The TurboQuant restore article's check: the first 50 greedy tokens identical after restore."""
PASSKEY_DEPTHS = (0.1, 0.5, 0.9)
"""Where in the filler the passkey sits, as shares of the prompt."""
COUNTING_PROMPTS = 8
COUNTING_SHOTS = 30
"""The counting task: 30 solved examples ("17, 18, 19, 20"), then one to finish (SmolLM2-135M
solved 12 of 12 cold in a first measurement; adding two-digit numbers it solved 1 of 12)."""
TASK_NEW_TOKENS = 8
"""Greedy tokens generated for a task's answer."""


def builtin_prompts(tokens: int) -> list[dict[str, Any]]:
    """The built-in prompt set: varied texts of four lengths (cut at `tokens` tokens)."""
    return [
        {"text": long_prompt(tokens, seed=100 + index), "keep": max(1, int(tokens * share))}
        for index, share in enumerate(BUILTIN_LENGTHS * (BUILTIN_PROMPTS // len(BUILTIN_LENGTHS)))
    ]


def task_prompts(passkey_lengths: Sequence[int]) -> list[dict[str, Any]]:
    """The scored tasks: a passkey at each depth of filler of each length (built in the engine,
    where its tokenizer measures the filler), then the counting prompts."""
    found: list[dict[str, Any]] = [
        {"task": "passkey", "tokens": length, "depth": depth, "seed": 500 + index}
        for index, (length, depth) in enumerate(
            (length, depth) for length in passkey_lengths for depth in PASSKEY_DEPTHS
        )
    ]
    for index in range(COUNTING_PROMPTS):
        rng = random.Random(900 + index)
        shots = []
        for _ in range(COUNTING_SHOTS + 1):
            first = rng.randrange(1, 90)
            shots.append([first, first + 1, first + 2, first + 3])
        text = "".join(f"{a}, {b}, {c}, {d}\n" for a, b, c, d in shots[:-1])
        a, b, c, d = shots[-1]
        found.append({"task": "counting", "text": f"{text}{a}, {b}, {c}, ", "answer": str(d)})
    return found


def passkey_ids(tokenizer: Any, spec: Mapping[str, Any]) -> tuple[list[int], str]:
    """A passkey prompt of `spec["tokens"]` tokens (the key at `spec["depth"]` of its filler,
    the question at the end) and its answer."""
    rng = random.Random(spec["seed"])
    key = str(rng.randrange(10_000, 100_000))
    needle = tokenizer(
        f" The pass key is {key}. Remember it. {key} is the pass key. ", add_special_tokens=False
    )
    question = tokenizer(" What is the pass key? The pass key is", add_special_tokens=False)
    needle_ids, question_ids = needle["input_ids"], question["input_ids"]
    room = spec["tokens"] - len(needle_ids) - len(question_ids)
    filler = tokenizer(long_prompt(spec["tokens"], seed=spec["seed"]))["input_ids"][:room]
    at = int(len(filler) * spec["depth"])
    return filler[:at] + needle_ids + filler[at:] + question_ids, key


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
    """One prompt through one codec (or, in the floor row, vLLM's hit against the cold run)."""

    prompt_tokens: int
    restored_tokens: int
    first_diff: int | None
    """Against vLLM's own prefix-cache hit of the prompt."""
    mean_kl: float
    cold_first_diff: int | None = None
    cold_kl: float = 0.0
    task: str | None = None
    """The scored task this prompt belongs to ("passkey", "counting"), None for a plain text."""
    correct: bool | None = None
    cold_correct: bool | None = None


@dataclass
class CodecEval:
    """One codec over the prompt set (identity figures over the plain texts, accuracy over the
    task prompts)."""

    codec: str
    new_tokens: int
    stored_ratio: float
    prompts: list[PromptEval] = field(default_factory=list)

    @property
    def texts(self) -> list[PromptEval]:
        return [p for p in self.prompts if p.task is None] or self.prompts

    @property
    def identical(self) -> float:
        """Share of prompts whose continuation is identical to vLLM's own hit."""
        return sum(p.first_diff is None for p in self.texts) / len(self.texts)

    @property
    def cold_identical(self) -> float:
        """Share of prompts whose continuation is identical to the cold run."""
        return sum(p.cold_first_diff is None for p in self.texts) / len(self.texts)

    @property
    def mean_first_diff(self) -> float:
        """Mean position of the first token differing from the hit (an identical continuation
        counts as its length)."""
        return statistics.fmean(
            self.new_tokens if p.first_diff is None else p.first_diff for p in self.texts
        )

    @property
    def mean_kl(self) -> float:
        return statistics.fmean(p.mean_kl for p in self.texts)

    @property
    def mean_cold_kl(self) -> float:
        return statistics.fmean(p.cold_kl for p in self.texts)

    @property
    def restored_fraction(self) -> float:
        """Share of all prompt tokens that came from the vault (or the prefix cache, in the
        floor row) instead of a prefill."""
        return sum(p.restored_tokens for p in self.prompts) / sum(
            p.prompt_tokens for p in self.prompts
        )

    @property
    def article_identical(self) -> int:
        """Prompts whose first ARTICLE_TOKENS generated tokens are identical to the hit's."""
        reach = min(ARTICLE_TOKENS, self.new_tokens)
        return sum(p.first_diff is None or p.first_diff >= reach for p in self.texts)

    def accuracy(self, task: str, cold: bool = False) -> float | None:
        """Share of `task`'s prompts answered right (by the cold run with `cold`)."""
        scored = [p.cold_correct if cold else p.correct for p in self.prompts if p.task == task]
        return sum(bool(ok) for ok in scored) / len(scored) if scored else None

    def tasks(self) -> list[str]:
        return list(dict.fromkeys(p.task for p in self.prompts if p.task is not None))

    def passes(self, min_identical: float, max_kl: float, min_task_accuracy: float = 0.0) -> bool:
        """The gate: enough continuations identical to the hit, a small enough mean KL, and
        every task answered at least that well."""
        accurate = all((self.accuracy(task) or 0.0) >= min_task_accuracy for task in self.tasks())
        return self.identical >= min_identical and self.mean_kl <= max_kl and accurate

    def as_json(self) -> dict[str, Any]:
        return {
            "codec": self.codec,
            "identical": self.identical,
            "mean_first_diff": self.mean_first_diff,
            "mean_kl": self.mean_kl,
            "cold_identical": self.cold_identical,
            "mean_cold_kl": self.mean_cold_kl,
            "restored_fraction": self.restored_fraction,
            "stored_ratio": self.stored_ratio,
            f"first_{ARTICLE_TOKENS}_identical": self.article_identical,
            "accuracy": {task: self.accuracy(task) for task in self.tasks()},
            "cold_accuracy": {task: self.accuracy(task, cold=True) for task in self.tasks()},
            "prompts": [asdict(p) for p in self.prompts],
        }


@dataclass
class EvalReport:
    """Every codec's figures for one model, the engine's own floor, and the gate's verdict."""

    model: str
    fingerprint: str | None
    new_tokens: int
    top_k: int
    seconds: float
    codecs: list[CodecEval]
    floor: CodecEval | None = None
    """vLLM's own prefix-cache hit against the cold run, no tierkv."""

    def verdict(
        self, min_identical: float, max_kl: float, min_task_accuracy: float = 0.0
    ) -> CodecEval | None:
        """The codec storing the fewest bytes among those that pass the gate."""
        passing = [c for c in self.codecs if c.passes(min_identical, max_kl, min_task_accuracy)]
        return max(passing, key=lambda c: c.stored_ratio, default=None)

    def self_test_failures(self) -> int:
        """Prompts on which the lossless codec did not generate vLLM's own hit's tokens (the
        harness or the restore is broken; 0 when `none` was not evaluated)."""
        lossless = [c for c in self.codecs if c.codec == "none"]
        return sum(p.first_diff is not None for c in lossless for p in c.prompts)

    def as_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "fingerprint": self.fingerprint,
            "new_tokens": self.new_tokens,
            "top_k": self.top_k,
            "seconds": self.seconds,
            "floor": self.floor.as_json() if self.floor else None,
            "self_test_failures": self.self_test_failures(),
            "codecs": [c.as_json() for c in self.codecs],
        }


class EngineFailed(RuntimeError):
    """The engine did not start or run: one line naming the cause and the flag to change."""


def vllm_eval(
    model: str,
    prompts: Sequence[Mapping[str, Any]],
    codecs: Sequence[str],
    *,
    new_tokens: int,
    connector_config: dict[str, object],
    group_size: int,
    kv_cache_bytes: int | None = None,
) -> EvalReport:
    """Evaluate `codecs` on `prompts` (see `builtin_prompts` and `task_prompts`) in one vLLM
    engine run in a fresh process (see `in_engine_process`); its progress goes to stderr."""
    started = time.perf_counter()
    found = in_engine_process(
        "eval",
        {
            "model": model,
            "prompts": [dict(prompt) for prompt in prompts],
            "codecs": list(codecs),
            "new_tokens": new_tokens,
            "connector_config": connector_config,
            "group_size": group_size,
            "kv_cache_bytes": kv_cache_bytes,
        },
    )
    if "error" in found:
        raise EngineFailed(found["error"])
    return engine_report(model, new_tokens, time.perf_counter() - started, found)


def engine_report(model: str, new_tokens: int, seconds: float, found: dict[str, Any]) -> EvalReport:
    """The report of what `eval_in_this_process` returned."""
    from tierkv.connectors.vllm.groups import model_fingerprint

    def row(codec: dict[str, Any]) -> CodecEval:
        prompts = [PromptEval(**p) for p in codec["prompts"]]
        return CodecEval(codec["codec"], new_tokens, codec["stored_ratio"], prompts)

    return EvalReport(
        model=model,
        fingerprint=model_fingerprint(model),
        new_tokens=new_tokens,
        top_k=TOP_K,
        seconds=seconds,
        codecs=[row(c) for c in found["codecs"]],
        floor=row(found["floor"]),
    )


def engine_start_error(exc: BaseException, kv_cache_bytes: int | None) -> str:
    """One line for an engine that did not start: its cause and the flag to change."""
    cause = (str(exc).strip().splitlines() or [type(exc).__name__])[-1][:500]
    memory = "memory" in cause.lower() or "kv cache" in cause.lower()
    if memory:
        where = f"--kv-cache-bytes (now {kv_cache_bytes or 'vLLM’s choice'})"
        return f"vLLM could not start: {cause}; change {where} or lower --tokens"
    return f"vLLM could not start: {cause}; check --model"


def eval_in_this_process(
    model: str,
    prompts: list[dict[str, Any]],
    codecs: list[str],
    new_tokens: int,
    connector_config: dict[str, object],
    group_size: int,
    kv_cache_bytes: int | None,
) -> dict[str, Any]:
    """The engine side of `vllm_eval`: one engine; the cold and hit references once per
    prompt, then one pass per codec (its codec set on the worker's tier, which encodes every
    stored block), as plain dicts ({"error": line} when the engine did not start)."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    tokenizer = AutoTokenizer.from_pretrained(model)
    token_ids: list[list[int]] = []
    answers: list[str | None] = []
    for spec in prompts:
        answer: str | None
        if spec.get("task") == "passkey":
            ids, answer = passkey_ids(tokenizer, spec)
        else:
            ids, answer = tokenizer(spec["text"])["input_ids"], spec.get("answer")
            ids = ids[: spec["keep"]] if spec.get("keep") else ids
        token_ids.append(ids)
        answers.append(answer)
    tasks = [spec.get("task") for spec in prompts]
    settings = {**connector_config, "connector.store": "on_finish", "compression.enabled": False}
    progress(f"eval: starting vLLM for {len(prompts)} prompts x {len(codecs)} codecs")
    try:
        llm = start_vllm(
            model,
            max_model_len=max(len(ids) for ids in token_ids) + new_tokens + 8,
            connector_config=settings,
            kv_cache_bytes=kv_cache_bytes,
            max_logprobs=TOP_K,
        )
    except Exception as exc:  # vLLM raises many kinds; the user needs one line, not a traceback
        return {"error": engine_start_error(exc, kv_cache_bytes)}
    from tierkv.quant import get_codec  # Numba only once vLLM has started (see in_engine_process)

    vocab = llm.llm_engine.model_config.get_vocab_size()
    started = time.perf_counter()

    def generate(index: int, salt: str, max_tokens: int | None = None) -> Any:
        # One prompt at a time: a prompt's runs then differ only in where its prefill starts,
        # not in which other prompts share the batch.
        limit = max_tokens or (TASK_NEW_TOKENS if tasks[index] else new_tokens)
        params = SamplingParams(max_tokens=limit, temperature=0, logprobs=TOP_K)
        request = TokensPrompt(prompt_token_ids=token_ids[index], cache_salt=salt)
        return llm.generate([request], params, use_tqdm=False)[0]

    def say(what: str, index: int) -> None:
        progress(
            f"eval: {what} prompt {index + 1}/{len(prompts)} ({len(token_ids[index])} tokens, "
            f"{time.perf_counter() - started:.0f} s)"
        )

    colds, hits = [], []
    for index in range(len(prompts)):
        say("cold and vLLM hit,", index)
        colds.append(generate(index, "tierkv-eval-reference"))
        hits.append(generate(index, "tierkv-eval-reference"))

    def scored(index: int, run: Any) -> tuple[str | None, bool | None]:
        answer = answers[index]
        if answer is None:
            return tasks[index], None
        return tasks[index], answer in tokenizer.decode(run.outputs[0].token_ids)

    def row(codec: str, ratio: float, runs: list[Any], references: list[Any]) -> dict[str, Any]:
        found = []
        for index, run in enumerate(runs):
            task, correct = scored(index, run)
            against_hit = _compare(references[index], run, vocab)
            against_cold = _compare(colds[index], run, vocab)
            found.append(
                {
                    **asdict(against_hit),
                    "cold_first_diff": against_cold.first_diff,
                    "cold_kl": against_cold.mean_kl,
                    "task": task,
                    "correct": correct,
                    "cold_correct": scored(index, colds[index])[1],
                }
            )
        return {"codec": codec, "stored_ratio": ratio, "prompts": found}

    floor = row("vLLM hit", 1.0, hits, references=colds)
    tier = worker_connector().tier
    results = []
    for codec in codecs:
        tier.codec = get_codec(codec, group_size)
        salt = f"tierkv-eval-{codec}"
        before = tier.stats()
        for index in range(len(prompts)):
            say(f"{codec}: store", index)
            generate(index, salt, max_tokens=1)  # a prefill whose blocks are stored on finish
        llm.generate(
            [TokensPrompt(prompt_token_ids=[2, 3])], SamplingParams(max_tokens=1), use_tqdm=False
        )
        if not tier.flush(timeout=600):  # ^ one more step: the finished prompts' blocks go out
            raise RuntimeError("the vault did not acknowledge the prompts' blocks")
        after = tier.stats()
        llm.reset_prefix_cache()
        restored = []
        for index in range(len(prompts)):
            say(f"{codec}: restore", index)
            restored.append(generate(index, salt))
        stored = after["queued_payload_bytes"] - before["queued_payload_bytes"]
        raw = after["queued_raw_bytes"] - before["queued_raw_bytes"]
        results.append(row(codec, raw / stored if stored else 0.0, restored, references=hits))
    return {"floor": floor, "codecs": results}


def _compare(reference: Any, restored: Any, vocab: int) -> PromptEval:
    """One prompt's reference and restored vLLM outputs compared."""
    a, b = reference.outputs[0], restored.outputs[0]
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
        prompt_tokens=len(reference.prompt_token_ids),
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
