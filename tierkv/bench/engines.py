"""Time to first token through real engines: the same prompt cold, from the engine's own prefix
cache, and restored from a vault after the engine's cache lost it.

`tierkv bench --engine vllm` drives an in-process vLLM engine with the TierKVConnector;
`tierkv bench --engine exo` talks to a running EXO over its OpenAI-compatible streaming API.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from tierkv.bench.engine_process import in_engine_process, start_vllm, worker_connector
from tierkv.bench.prompts import long_prompt


@dataclass
class TTFTRun:
    """One request: its time to first token, the tokens the engine reused, and its output."""

    label: str
    ttft_s: float
    cached_tokens: int | None
    output: str
    same_prompt: bool = True
    """False for a run that only exists to push the prompt out of the engine's cache."""


@dataclass
class EngineBench:
    """TTFT cold / engine prefix hit / vault restore for one prompt."""

    engine: str
    prompt_tokens: int | None
    runs: list[TTFTRun] = field(default_factory=list)

    def speedup(self, label: str) -> float:
        """How many times faster than the cold run `label` reached its first token."""
        cold = self.runs[0].ttft_s
        return cold / next(run.ttft_s for run in self.runs if run.label == label)

    @property
    def outputs_match(self) -> bool:
        return len({run.output for run in self.runs if run.same_prompt}) == 1

    def as_json(self) -> dict[str, object]:
        return {
            "engine": self.engine,
            "prompt_tokens": self.prompt_tokens,
            "outputs_match": self.outputs_match,
            "runs": [asdict(run) for run in self.runs],
        }


def exo_bench(
    api_url: str,
    model: str,
    prompt: str,
    *,
    max_tokens: int = 16,
    timeout_s: float = 600.0,
    on_run: Callable[[str], None] = lambda label: None,
) -> EngineBench:
    """Three streamed chat completions against EXO at `api_url`.

    1. the prompt, cold; 2. the same prompt, from EXO's own prefix cache; 3. a different prompt
    of the same length, which (with EXO started with `EXO_MEMORY_THRESHOLD=0`) evicts the first
    from EXO's prefix cache into the vault; 4. the first prompt again, restored from the vault.
    """
    other = long_prompt(len(prompt.split()), seed=prompt.count(" ") + 1)
    plan = [
        ("cold", prompt),
        ("engine prefix hit", prompt),
        ("evicting run", other),
        ("vault restore", prompt),
    ]
    result = EngineBench(engine="exo", prompt_tokens=None)
    for label, text in plan:
        on_run(label)
        run, prompt_tokens = _exo_stream(api_url, model, text, label, max_tokens, timeout_s)
        run.same_prompt = text is prompt
        result.prompt_tokens = result.prompt_tokens or prompt_tokens
        result.runs.append(run)
    return result


def _exo_stream(
    api_url: str, model: str, prompt: str, label: str, max_tokens: int, timeout_s: float
) -> tuple[TTFTRun, int | None]:
    body = json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()
    request = urllib.request.Request(
        api_url.rstrip("/") + "/v1/chat/completions",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    start = time.perf_counter()
    ttft: float | None = None
    pieces: list[str] = []
    usage: dict[str, object] = {}
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data:") :])
            for choice in chunk.get("choices") or []:
                content = (choice.get("delta") or {}).get("content")
                if content:
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                    pieces.append(content)
            usage = chunk.get("usage") or usage
    if ttft is None:
        raise RuntimeError(f"{api_url} streamed no content for the {label} request")
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    prompt_tokens = usage.get("prompt_tokens")
    return (
        TTFTRun(label, ttft, cached, "".join(pieces)),
        prompt_tokens if isinstance(prompt_tokens, int) else None,
    )


def vllm_bench(
    model: str,
    prompt: str,
    *,
    tokens: int | None,
    connector_config: dict[str, object],
    kv_cache_bytes: int | None = None,
    max_tokens: int = 16,
) -> EngineBench:
    """Cold, vLLM prefix hit and vault restore of `prompt` (cut to `tokens` tokens when given) on
    an in-process vLLM engine with the TierKVConnector, run in a fresh Python process.

    `connector_config` is the connector's inline tierkv.toml (dotted keys); the bench stores with
    `connector.store = "on_finish"`, then drops vLLM's prefix cache, so the third run can only be
    served by the vault.
    """
    found = in_engine_process(
        "bench",
        {
            "model": model,
            "prompt": prompt,
            "tokens": tokens,
            "connector_config": {**connector_config, "connector.store": "on_finish"},
            "kv_cache_bytes": kv_cache_bytes,
            "max_tokens": max_tokens,
        },
    )
    runs = [TTFTRun(**run) for run in found["runs"]]
    return EngineBench(found["engine"], found["prompt_tokens"], runs)


def vllm_bench_in_this_process(
    model: str,
    prompt: str,
    tokens: int | None,
    connector_config: dict[str, object],
    kv_cache_bytes: int | None,
    max_tokens: int,
) -> dict[str, Any]:
    """The "bench" run of the engine process (see `vllm_bench`): its EngineBench as JSON."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    token_ids = AutoTokenizer.from_pretrained(model)(prompt)["input_ids"]
    token_ids = token_ids[:tokens] if tokens else token_ids
    llm = start_vllm(
        model,
        max_model_len=len(token_ids) + max_tokens + 8,
        connector_config=connector_config,
        kv_cache_bytes=kv_cache_bytes,
    )
    params = SamplingParams(max_tokens=max_tokens, temperature=0)

    def run(label: str, ids: list[int]) -> TTFTRun:
        output = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
        if output.metrics is None:
            raise RuntimeError("vLLM reported no request metrics (is log_stats off?)")
        text = " ".join(str(token) for token in output.outputs[0].token_ids)
        cached = output.num_cached_tokens
        return TTFTRun(label, output.metrics.first_token_latency, cached, text)

    run("warm-up", token_ids[:64])
    result = EngineBench(engine="vllm", prompt_tokens=len(token_ids))
    result.runs.append(run("cold", token_ids))
    result.runs.append(run("engine prefix hit", token_ids))
    run("store step", token_ids[-8:])  # one more step: the finished prompt's blocks are sent
    if not worker_connector().tier.flush(timeout=600):
        raise RuntimeError("the vault did not acknowledge the prompt's blocks")
    llm.reset_prefix_cache()
    result.runs.append(run("vault restore", token_ids))
    return result.as_json()
