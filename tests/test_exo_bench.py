"""`tierkv bench --engine exo` against an OpenAI-style streaming API served by the EXO fixture.

EXO itself does not install here. The API below streams what the EXO-shaped fixture package
generates with the tierkv hook armed, a tiny random MLX model and a real vault: the answer is
the model's greedy tokens for the prompt, and `cached_tokens` is what EXO's prefix cache (or the
vault, through the hook) spared the prefill. Words are the tokens. Like EXO started with
`EXO_MEMORY_THRESHOLD=0`, every new prompt cache evicts the older ones (to the vault).
"""

from __future__ import annotations

import json
import threading
import zlib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

import mlx.core as mx
import pytest
from fake_exo.tiny_mlx import VOCAB, tiny_llama
from helpers import VaultHandle
from test_exo_hook import BLOCK, READY_TIMEOUT_S, start_exo
from typer.testing import CliRunner

from tierkv.bench.engines import exo_bench
from tierkv.bench.prompts import long_prompt
from tierkv.cli import app
from tierkv.connectors.exo import hook

pytestmark = pytest.mark.mlx


def tokens_of(text: str) -> list[int]:
    return [zlib.crc32(word.encode()) % VOCAB for word in text.split()]


class _ExoApi(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert body["stream"] is True and body["temperature"] == 0
        generate = self.server.generate  # type: ignore[attr-defined]
        tokens, cached = generate(body["messages"][0]["content"], body["max_tokens"])
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for token in tokens:
            self._event({"choices": [{"delta": {"content": f" t{token}"}}]})
        usage = {"prompt_tokens": len(tokens_of(body["messages"][0]["content"]))}
        self._event(
            {"choices": [], "usage": {**usage, "prompt_tokens_details": {"cached_tokens": cached}}}
        )
        self.wfile.write(b"data: [DONE]\n\n")

    def _event(self, chunk: dict[str, object]) -> None:
        self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def exo_api(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, vault: VaultHandle
) -> Iterator[tuple[str, list[str]]]:
    """The API's URL, and the prompts it was sent so far."""
    exo = start_exo(tmp_path, monkeypatch, vault.address)
    runtime = hook.runtime()
    assert runtime.ready.wait(READY_TIMEOUT_S)
    monkeypatch.setattr(exo.cache, "_MEMORY_THRESHOLD", 0.0)
    model = tiny_llama()
    prefix_cache = exo.cache.KVPrefixCache(None)

    def generate(prompt: str, max_tokens: int) -> tuple[list[int], int]:
        prompts.append(prompt)
        assert runtime.flush(10)  # the spills of earlier requests have reached the vault
        ids = mx.array(tokens_of(prompt))
        result = exo.generate.mlx_generate(model, ids, prefix_cache, max_tokens)
        return result.tokens, len(ids) - result.prefilled

    prompts: list[str] = []
    server = HTTPServer(("127.0.0.1", 0), _ExoApi)
    server.generate = generate  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", prompts
    finally:
        server.shutdown()
        server.server_close()
        hook.shutdown()


def common_prefix(a: list[int], b: list[int]) -> int:
    same = [x == y for x, y in zip(a, b, strict=False)]
    return same.index(False) if False in same else len(same)


def test_exo_bench_runs_cold_hit_evict_restore(exo_api: tuple[str, list[str]]) -> None:
    url, prompts = exo_api
    prompt = long_prompt(100)
    n = len(prompt.split())
    result = exo_bench(url, "tiny", prompt, max_tokens=4)
    assert [run.label for run in result.runs] == [
        "cold",
        "engine prefix hit",
        "evicting run",
        "vault restore",
    ]
    assert result.prompt_tokens == n
    cold, hit, other, restore = result.runs
    assert cold.cached_tokens == 0
    # EXO reuses any common prefix: the evicting prompt shares its first tokens' ids, if any.
    assert other.cached_tokens == common_prefix(tokens_of(prompts[0]), tokens_of(prompts[2]))
    assert hit.cached_tokens == n - 2  # EXO keeps all but the last two prompt tokens
    assert restore.cached_tokens == (n - 2) // BLOCK * BLOCK  # the full blocks it spilled
    assert result.outputs_match  # the same greedy tokens from a restored cache as cold
    assert other.output != cold.output  # ... which depend on the prompt


def test_cli_engine_exo_json(exo_api: tuple[str, list[str]]) -> None:
    args = ["bench", "--engine", "exo", "--exo-api", exo_api[0], "--model", "tiny"]
    out = CliRunner().invoke(app, [*args, "--tokens", "64", "--json"])
    assert out.exit_code == 0, out.output
    report = json.loads(out.stdout)
    assert report["engine"] == "exo" and len(report["runs"]) == 4
    assert report["outputs_match"]
    assert [run["cached_tokens"] for run in report["runs"]][-1] > 0


def test_cli_engine_exo_prompt_file(exo_api: tuple[str, list[str]], tmp_path: Any) -> None:
    url, prompts = exo_api
    text = " ".join(f"word{i % 37}" for i in range(90))
    path = tmp_path / "prompt.txt"
    path.write_text(text)
    args = ["bench", "--engine", "exo", "--exo-api", url, "--model", "tiny"]
    out = CliRunner().invoke(app, [*args, "--prompt-file", str(path), "--json"])
    assert out.exit_code == 0, out.output
    assert prompts[0] == prompts[1] == prompts[3] == text  # the file's text is the prompt
    report = json.loads(out.stdout)
    assert report["prompt_tokens"] == 90 and report["outputs_match"]
