"""`tierkv eval`: what a restore through each codec does to a model's next-token distributions and
its passkey answers, measured against the engine's own prefix-cache hit, and the gate that
records the smallest codec a model tolerates.

One vLLM engine per compute dtype (float32, where a codec's own error shows, and the model's
dtype, what users run), each shared by every codec and prompt. Per text prompt the engine first
generates `new_tokens` greedy tokens cold (the fixed continuation), then runs prompt +
continuation as its own prefix-cache hit with `prompt_logprobs` (teacher forcing: the prompt's
full blocks come from vLLM's cache, the rest is computed), and once more with the cache skipped
(the cold run, for the floor row). Per codec every prompt is prefilled once under the codec's
cache salt (its full blocks are stored through the codec), vLLM's prefix cache is dropped, and
prompt + continuation run again, the prompt's full blocks restored from the vault. Both runs
computed the same positions over the same tokens, so their distributions at the continuation's
positions differ only by what the codec changed: `teacher_forced` scores them (KL, top-1
agreement, and the first position whose top-1 differs, a tie when the hit's top-2 gap there is
under `tie_nats`: with the hit's own greedy tokens as the continuation, the restored run's greedy
tokens would be the hit's up to that position). Passkey probes (`passkey_probes`) are generated
greedily, cold, as the hit, and restored. `none` must give the hit's log-probabilities exactly:
the harness's self-test.
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

TOP_K = 100
"""Log-probabilities vLLM returns per teacher-forced position (`prompt_logprobs`): on a trained
model the top 100 of the vocabulary hold nearly all of a next-token distribution's mass, so the
KL's one folded bucket for the rest (see `topk_kl`) holds little."""
TIE_NATS = 0.1
"""A first top-1 difference where the hit's two most likely tokens are closer than this (in
log-probability) is a tie: rounding alone could flip it."""
BUILTIN_PROMPTS = 8
BUILTIN_LENGTHS = (0.25, 0.5, 0.75, 1.0)
"""The built-in prompts' lengths, as shares of `--tokens` (two texts of each)."""
PASSKEY_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
"""Where in the filler a probe's key sits, as shares of the filler."""
PASSKEY_SHORTEST = 1024
"""The shortest passkey probe, in tokens (or the longest, when that is shorter)."""
TASK_NEW_TOKENS = 8
"""Greedy tokens generated for a passkey answer."""


def builtin_prompts(tokens: int) -> list[dict[str, Any]]:
    """The built-in prompt set: varied texts of four lengths (cut at `tokens` tokens)."""
    return [
        {"text": long_prompt(tokens, seed=100 + index), "keep": max(1, int(tokens * share))}
        for index, share in enumerate(BUILTIN_LENGTHS * (BUILTIN_PROMPTS // len(BUILTIN_LENGTHS)))
    ]


def passkey_probes(count: int, longest: int) -> list[dict[str, Any]]:
    """`count` passkey probes: lengths spaced evenly in log scale from PASSKEY_SHORTEST (or
    `longest`, if shorter) up to `longest` tokens, every depth of PASSKEY_DEPTHS at each length
    in turn, and a different key (seed) for each."""
    shortest = min(PASSKEY_SHORTEST, longest)
    steps = max(1, math.ceil(count / len(PASSKEY_DEPTHS)))
    lengths = [
        round(shortest * (longest / shortest) ** (step / max(1, steps - 1)))
        for step in range(steps)
    ]
    return [
        {
            "task": "passkey",
            "tokens": lengths[index * steps // count],
            "depth": PASSKEY_DEPTHS[index % len(PASSKEY_DEPTHS)],
            "seed": 500 + index,
        }
        for index in range(count)
    ]


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


def restorable_length(tokens: int, block: int, new_tokens: int) -> int:
    """The length a text prompt is cut to so that its greedy continuation of `new_tokens` never
    completes a block: the continuation's tokens must not enter the prefix cache, or the hit would
    start later than a restore (which has only the prompt's full blocks). 0 when no full block
    would be left to restore."""
    room = block - new_tokens - 1  # the most tokens after the last full block
    if room < 1:
        raise ValueError(f"--new-tokens {new_tokens}: at most {block - 2} with blocks of {block}")
    full, tail = divmod(tokens, block)
    if tail == 0:
        full, tail = full - 1, room
    cut = full * block + min(tail, room)
    return cut if full >= 1 else 0


def topk_kl(reference: Mapping[int, float], restored: Mapping[int, float]) -> float:
    """KL(reference || restored) in nats from two top-k log-probability maps (token -> logprob).

    Both distributions are folded alike: the tokens both runs list, and one bucket for the rest
    of the vocabulary (in each run, whatever those tokens leave). That is a coarse-graining of
    both onto the same outcomes, so the result is never above the true KL, and identical maps
    give exactly 0. A token only one run lists goes into the bucket: its probability is near the
    k-th either way, and a tiny perturbation swaps such tokens across the k-th rank: scored as
    holding an even share of the restored run's unlisted mass, each swap would add about
    p_k ln(p_k / share) whatever the codec (on SmolLM2, most of int8's KL).
    """
    kl = p_shared = q_shared = 0.0
    for token, logprob in reference.items():
        if token in restored:
            p = math.exp(logprob)
            p_shared, q_shared = p_shared + p, q_shared + math.exp(restored[token])
            kl += p * (logprob - restored[token])
    p_rest, q_rest = max(0.0, 1.0 - p_shared), max(1e-30, 1.0 - q_shared)
    if p_rest > 0.0:
        kl += p_rest * math.log(p_rest / q_rest)
    return max(0.0, kl)


def top2_gap(logprobs: Mapping[int, float]) -> float:
    """The most likely token's log-probability minus the second's (inf with one listed)."""
    first, second = [*sorted(logprobs.values(), reverse=True), -math.inf][:2]
    return first - second


@dataclass
class PromptEval:
    """One prompt through one codec against the hit (or, in the floor row, the hit against the
    cold run)."""

    prompt_tokens: int
    restored_tokens: int
    """Prompt tokens the run did not compute (from the vault, or vLLM's cache in the floor)."""
    task: str | None = None
    """"passkey" for a probe, None for a text."""
    positions: int = 0
    """Teacher-forced positions compared (the continuation's tokens)."""
    kl: float = 0.0
    """Mean KL(reference || run) over those positions, nats."""
    top1: int = 0
    """Positions whose most likely token is the reference's."""
    first_diff: int | None = None
    """The first position whose most likely token is not the reference's."""
    tie: bool = False
    """That difference is a tie (the reference's top-2 gap there under the tie threshold)."""
    correct: bool | None = None
    """A probe: this run answered its key."""
    reference_correct: bool | None = None
    """A probe: the reference answered its key."""


def teacher_forced(
    reference: Sequence[Mapping[int, float]],
    restored: Sequence[Mapping[int, float]],
    tie_nats: float = TIE_NATS,
) -> dict[str, Any]:
    """Two runs' top-k log-probabilities over the same continuation, position by position: the
    mean KL, the positions whose top-1 agrees, and the first that does not (a tie or not)."""
    if len(reference) != len(restored):
        raise ValueError(f"{len(reference)} reference positions, {len(restored)} restored")
    kls = [topk_kl(a, b) for a, b in zip(reference, restored, strict=True)]
    agree = [
        max(a, key=a.__getitem__) == max(b, key=b.__getitem__)
        for a, b in zip(reference, restored, strict=True)
    ]
    first = agree.index(False) if not all(agree) else None
    return {
        "positions": len(agree),
        "kl": statistics.fmean(kls) if kls else 0.0,
        "top1": sum(agree),
        "first_diff": first,
        "tie": first is not None and top2_gap(reference[first]) < tie_nats,
    }


@dataclass
class CodecEval:
    """One codec (or the floor) over the prompt set in one compute dtype."""

    codec: str
    stored_ratio: float
    prompts: list[PromptEval] = field(default_factory=list)

    @property
    def texts(self) -> list[PromptEval]:
        return [p for p in self.prompts if p.task is None]

    @property
    def probes(self) -> list[PromptEval]:
        return [p for p in self.prompts if p.task == "passkey"]

    @property
    def positions(self) -> int:
        return sum(p.positions for p in self.texts)

    @property
    def kl(self) -> float:
        """Mean teacher-forced KL over every compared position of every text."""
        return sum(p.kl * p.positions for p in self.texts) / max(1, self.positions)

    @property
    def top1(self) -> float:
        """Share of compared positions whose most likely token is the reference's."""
        return sum(p.top1 for p in self.texts) / max(1, self.positions)

    @property
    def identical(self) -> int:
        """Texts whose greedy tokens stay the reference's over the whole continuation."""
        return sum(p.first_diff is None for p in self.texts)

    @property
    def ties(self) -> int:
        """Texts whose first difference is a tie."""
        return sum(p.first_diff is not None and p.tie for p in self.texts)

    @property
    def diverged(self) -> int:
        """Texts that part from the reference where it was not a tie."""
        return len(self.texts) - self.identical - self.ties

    @property
    def reference_found(self) -> int:
        """Probes the reference (the hit) answers."""
        return sum(bool(p.reference_correct) for p in self.probes)

    @property
    def found(self) -> int:
        return sum(bool(p.correct) for p in self.probes)

    @property
    def kept(self) -> int:
        """Probes the reference answers and this run answers too."""
        return sum(bool(p.reference_correct and p.correct) for p in self.probes)

    @property
    def restored_fraction(self) -> float:
        """Share of all prompt tokens that came from the vault (or the cache, in the floor)."""
        total = sum(p.prompt_tokens for p in self.prompts)
        return sum(p.restored_tokens for p in self.prompts) / max(1, total)

    def as_json(self) -> dict[str, Any]:
        return {
            "codec": self.codec,
            "stored_ratio": self.stored_ratio,
            "kl": self.kl,
            "top1": self.top1,
            "positions": self.positions,
            "texts": len(self.texts),
            "identical": self.identical,
            "ties": self.ties,
            "diverged": self.diverged,
            "probes": len(self.probes),
            "reference_found": self.reference_found,
            "found": self.found,
            "kept": self.kept,
            "restored_fraction": self.restored_fraction,
            "prompts": [asdict(p) for p in self.prompts],
        }


@dataclass
class DtypeEval:
    """Every codec in one engine computing in `dtype`, and the engine's own floor (its hit
    against its cold run)."""

    dtype: str
    seconds: float
    codecs: list[CodecEval]
    floor: CodecEval

    def codec(self, name: str) -> CodecEval | None:
        return next((c for c in self.codecs if c.codec == name), None)

    def self_test_failures(self) -> int:
        """Prompts on which `none` did not reproduce the hit exactly (0 without `none`)."""
        lossless = self.codec("none")
        if lossless is None:
            return 0
        return sum(
            p.kl != 0.0 or p.first_diff is not None or p.correct != p.reference_correct
            for p in lossless.prompts
        )

    def as_json(self) -> dict[str, Any]:
        return {
            "dtype": self.dtype,
            "seconds": self.seconds,
            "self_test_failures": self.self_test_failures(),
            "floor": self.floor.as_json(),
            "codecs": [c.as_json() for c in self.codecs],
        }


@dataclass
class Gate:
    """What a codec must keep to be recorded: every passkey the hit finds in the model's own
    dtype, and in float32 compute a mean teacher-forced KL and a top-1 agreement."""

    max_kl: float = 0.005
    min_top1: float = 0.97

    def describe(self) -> str:
        return (
            f"every passkey the hit finds (model dtype), KL <= {self.max_kl:g} and top-1 >= "
            f"{self.min_top1:.1%} (float32)"
        )


@dataclass
class EvalReport:
    """Every codec's figures for one model in each compute dtype evaluated."""

    model: str
    fingerprint: str | None
    model_dtype: str
    new_tokens: int
    top_k: int
    tie_nats: float
    runs: list[DtypeEval]

    def run(self, dtype: str) -> DtypeEval | None:
        return next((r for r in self.runs if r.dtype == dtype), None)

    def passes(self, codec: str, gate: Gate) -> bool | None:
        """Whether `codec` passes `gate`; None when a run the gate needs is missing."""
        own, fp32 = self.run(self.model_dtype), self.run("float32")
        if own is None or fp32 is None:
            return None
        here, there = own.codec(codec), fp32.codec(codec)
        if here is None or there is None:
            return None
        kept = here.kept == here.reference_found
        # A codec whose blocks did not all come back was partly recomputed, not measured.
        floors = (own.floor.restored_fraction, fp32.floor.restored_fraction)
        whole = here.restored_fraction >= floors[0] and there.restored_fraction >= floors[1]
        return whole and kept and there.kl <= gate.max_kl and there.top1 >= gate.min_top1

    def verdict(self, gate: Gate) -> CodecEval | None:
        """The codec storing the fewest bytes (in the model's dtype) among those that pass."""
        own = self.run(self.model_dtype)
        if own is None:
            return None
        passing = [c for c in own.codecs if self.passes(c.codec, gate)]
        return max(passing, key=lambda c: c.stored_ratio, default=None)

    def self_test_failures(self) -> int:
        return sum(run.self_test_failures() for run in self.runs)

    def as_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "fingerprint": self.fingerprint,
            "model_dtype": self.model_dtype,
            "new_tokens": self.new_tokens,
            "top_k": self.top_k,
            "tie_nats": self.tie_nats,
            "self_test_failures": self.self_test_failures(),
            "runs": [run.as_json() for run in self.runs],
        }


class EngineFailed(RuntimeError):
    """The engine did not start or run: one line naming the cause and the flag to change."""


def vllm_eval(
    model: str,
    prompts: Sequence[Mapping[str, Any]],
    codecs: Sequence[str],
    *,
    dtypes: Sequence[str],
    model_dtype: str,
    new_tokens: int,
    connector_config: dict[str, object],
    group_size: int,
    kv_cache_bytes: int | None = None,
    tie_nats: float = TIE_NATS,
) -> EvalReport:
    """Evaluate `codecs` on `prompts` (see `builtin_prompts` and `passkey_probes`) in one vLLM
    engine per dtype of `dtypes`, each in a fresh process (see `in_engine_process`); progress
    goes to stderr."""
    from tierkv.connectors.vllm.groups import model_fingerprint

    runs = []
    for dtype in dtypes:
        started = time.perf_counter()
        found = in_engine_process(
            "eval",
            {
                "model": model,
                "dtype": dtype,
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
        runs.append(score_run(dtype, time.perf_counter() - started, found, tie_nats))
    return EvalReport(
        model=model,
        fingerprint=model_fingerprint(model),
        model_dtype=model_dtype,
        new_tokens=new_tokens,
        top_k=TOP_K,
        tie_nats=tie_nats,
        runs=runs,
    )


def score_run(dtype: str, seconds: float, found: dict[str, Any], tie_nats: float) -> DtypeEval:
    """A `DtypeEval` of what `eval_in_this_process` measured: each codec's runs scored against
    the hit's, and the hit's against the cold run's (the floor)."""

    def row(
        name: str, ratio: float, runs: list[dict[str, Any]], references: list[dict[str, Any]]
    ) -> CodecEval:
        prompts = []
        for run, reference in zip(runs, references, strict=True):
            scored = PromptEval(run["prompt_tokens"], run["cached_tokens"], run["task"])
            if run["positions"] is not None:
                compared = teacher_forced(
                    _maps(reference["positions"]), _maps(run["positions"]), tie_nats
                )
                for key, value in compared.items():
                    setattr(scored, key, value)
            else:
                scored.correct, scored.reference_correct = run["correct"], reference["correct"]
            prompts.append(scored)
        return CodecEval(name, ratio, prompts)

    hits = found["hit"]
    return DtypeEval(
        dtype=dtype,
        seconds=seconds,
        floor=row("vLLM hit vs cold", 1.0, hits, found["cold"]),
        codecs=[row(c["codec"], c["stored_ratio"], c["runs"], hits) for c in found["codecs"]],
    )


def _maps(positions: list[list[list[float]]]) -> list[dict[int, float]]:
    return [{int(token): logprob for token, logprob in position} for position in positions]


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
    dtype: str,
    prompts: list[dict[str, Any]],
    codecs: list[str],
    new_tokens: int,
    connector_config: dict[str, object],
    group_size: int,
    kv_cache_bytes: int | None,
) -> dict[str, Any]:
    """The engine side of `vllm_eval`: one engine computing in `dtype`; the cold and hit runs
    once per prompt, then one pass per codec (its codec set on the worker's tier, which encodes
    every stored block); the raw measurements as plain dicts ({"error": line} when the engine
    did not start)."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    tokenizer = AutoTokenizer.from_pretrained(model)
    token_ids: list[list[int]] = []
    answers: list[str | None] = []
    for spec in prompts:
        if spec.get("task") == "passkey":
            ids, key = passkey_ids(tokenizer, spec)
            token_ids.append(ids)
            answers.append(key)
        else:
            ids = tokenizer(spec["text"])["input_ids"]
            token_ids.append(ids[: spec["keep"]] if spec.get("keep") else ids)
            answers.append(None)
    settings = {**connector_config, "connector.store": "on_finish", "compression.enabled": False}
    progress(f"eval: starting vLLM ({dtype}) for {len(prompts)} prompts x {len(codecs)} codecs")
    try:
        llm = start_vllm(
            model,
            max_model_len=max(len(ids) for ids in token_ids) + new_tokens + 8,
            connector_config=settings,
            kv_cache_bytes=kv_cache_bytes,
            max_logprobs=TOP_K,
            dtype=dtype,
        )
    except Exception as exc:  # vLLM raises many kinds; the user needs one line, not a traceback
        return {"error": engine_start_error(exc, kv_cache_bytes)}

    block = llm.llm_engine.vllm_config.cache_config.block_size
    texts = [index for index, answer in enumerate(answers) if answer is None]
    for index in texts:
        cut = restorable_length(len(token_ids[index]), block, new_tokens)
        if cut == 0:
            short = len(token_ids[index])
            return {
                "error": f"a prompt of {short} tokens holds no block of {block}: raise --tokens"
            }
        token_ids[index] = token_ids[index][:cut]
    continuations: list[list[int]] = [[] for _ in prompts]
    store = SamplingParams(max_tokens=1, detokenize=False)  # a prefill, stored when it finishes
    started = time.perf_counter()

    def params(index: int, forced: bool, skip_cache: bool = False) -> SamplingParams:
        if answers[index] is not None:  # a probe: its answer, greedy
            return SamplingParams(max_tokens=TASK_NEW_TOKENS, temperature=0, detokenize=False)
        if not forced:  # a text's greedy continuation
            return SamplingParams(max_tokens=new_tokens, temperature=0, detokenize=False)
        return SamplingParams(
            max_tokens=1,
            temperature=0,
            prompt_logprobs=TOP_K,
            skip_reading_prefix_cache=skip_cache,
            detokenize=False,
        )

    def request(index: int, salt: str, forced: bool) -> TokensPrompt:
        return TokensPrompt(
            prompt_token_ids=token_ids[index] + (continuations[index] if forced else []),
            cache_salt=salt,
        )

    def measured(index: int, output: Any) -> dict[str, Any]:
        found: dict[str, Any] = {
            "prompt_tokens": len(token_ids[index]),
            "cached_tokens": output.num_cached_tokens or 0,
            "task": None if answers[index] is None else "passkey",
            "positions": None,
            "correct": None,
        }
        if answers[index] is not None:
            found["correct"] = answers[index] in tokenizer.decode(output.outputs[0].token_ids)
        elif output.prompt_logprobs is not None:  # those predicting each continuation token
            at = len(token_ids[index])
            found["positions"] = [
                [[token, lp.logprob] for token, lp in output.prompt_logprobs[i].items()]
                for i in range(at, at + len(continuations[index]))
            ]
        return found

    def one(index: int, salt: str, forced: bool, skip_cache: bool = False) -> Any:
        # One prompt at a time: batching changes float rounding, and `none` must reproduce
        # the hit exactly (its self-test).
        sampling = params(index, forced, skip_cache)
        return llm.generate(request(index, salt, forced), sampling, use_tqdm=False)[0]

    def say(what: str) -> None:
        progress(f"eval ({dtype}): {what} ({time.perf_counter() - started:.0f} s)")

    hits, colds = [], []
    for index in range(len(prompts)):  # the cold run caches the prompt's blocks for the hit
        say(
            f"cold and vLLM hit, prompt {index + 1}/{len(prompts)} ({len(token_ids[index])} tokens)"
        )
        cold = one(index, "reference", forced=False)
        if answers[index] is None:
            continuations[index] = list(cold.outputs[0].token_ids)
        colds.append(measured(index, cold))
        hits.append(measured(index, one(index, "reference", forced=answers[index] is None)))
    say("cold teacher-forced runs")
    for index in texts:
        colds[index] = measured(index, one(index, "cold", forced=True, skip_cache=True))
    connector = worker_connector()
    tier = connector.tier
    results = []
    for codec in codecs:
        connector.worker_side.use_codec(codec, group_size)
        salt = f"codec-{codec}"
        before = tier.stats()
        say(f"{codec}: store {len(prompts)} prompts")
        for index in range(len(prompts)):
            llm.generate(request(index, salt, False), store, use_tqdm=False)
        llm.generate(  # one more step: the finished prompts' blocks go out
            [TokensPrompt(prompt_token_ids=[2, 3])], store, use_tqdm=False
        )
        if not tier.flush(timeout=600):
            raise RuntimeError("the vault did not acknowledge the prompts' blocks")
        after = tier.stats()
        llm.reset_prefix_cache()
        say(f"{codec}: restore {len(prompts)} prompts")
        restored = [
            measured(i, one(i, salt, forced=answers[i] is None)) for i in range(len(prompts))
        ]
        stored = after["queued_payload_bytes"] - before["queued_payload_bytes"]
        raw = after["queued_raw_bytes"] - before["queued_raw_bytes"]
        ratio = raw / stored if stored else 0.0
        results.append({"codec": codec, "stored_ratio": ratio, "runs": restored})
    return {"block": block, "hit": hits, "cold": colds, "codecs": results}


def write_verdict(path: Path, report: EvalReport, verdict: CodecEval, gate: Gate) -> None:
    """Record `verdict` for the report's model in `[codec_verdicts]` of the tierkv.toml at
    `path` (created if missing; everything else in it is kept), its figures as a comment."""
    if report.fingerprint is None:
        raise ValueError(f"no weight files found for {report.model}: nothing to key a verdict by")
    fp32 = report.run("float32")
    measured = fp32.codec(verdict.codec) if fp32 else None
    if measured is None:
        raise ValueError("the gate needs a float32 run of the codec")
    document = (
        tomlkit.parse(path.read_text(encoding="utf-8")) if path.exists() else tomlkit.document()
    )
    verdicts = document.get("codec_verdicts")
    if verdicts is None:
        verdicts = tomlkit.table()
        document["codec_verdicts"] = verdicts
    entry = tomlkit.item(verdict.codec)
    entry.comment(
        f"{Path(report.model).name}: {verdict.stored_ratio:.2f}x smaller, {verdict.kept}/"
        f"{verdict.reference_found} of the hit's passkeys ({report.model_dtype}), KL "
        f"{measured.kl:.2g}, top-1 {measured.top1:.1%} over {measured.positions} positions "
        f"(float32); gate: {gate.describe()}; tierkv eval {time.strftime('%Y-%m-%d')}"
    )
    verdicts[report.fingerprint] = entry
    path.write_text(tomlkit.dumps(document), encoding="utf-8")
