"""`tierkv bench --engine exo` against a stand-in for EXO's OpenAI-compatible streaming API.

EXO itself does not install here; the stand-in is a loopback HTTP server that streams chat
completion chunks the way EXO does and reports cached prompt tokens for a prompt it has seen.
"""

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest
from tiny_models import build_tiny_llama
from typer.testing import CliRunner

from tierkv.bench_engines import exo_bench, long_prompt
from tierkv.cli import app


class _FakeExo(BaseHTTPRequestHandler):
    seen: ClassVar[set[str]] = set()

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert body["stream"] is True and body["temperature"] == 0
        prompt = body["messages"][0]["content"]
        cached = len(prompt.split()) if prompt in self.seen else 0
        self.seen.add(prompt)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for word in ("same", " answer") if cached or prompt.startswith("A") else ("other",):
            self._event({"choices": [{"delta": {"content": word}}]})
        usage = {
            "prompt_tokens": len(prompt.split()),
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        self._event({"choices": [], "usage": usage})
        self.wfile.write(b"data: [DONE]\n\n")

    def _event(self, chunk: dict[str, object]) -> None:
        self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def fake_exo() -> Iterator[str]:
    _FakeExo.seen = set()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeExo)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_long_prompt_is_varied_and_deterministic() -> None:
    text = long_prompt(3000)
    sentences = text.split(". ")
    assert len(text.split()) >= 3000
    assert len(set(sentences)) > 0.95 * len(sentences), "no sentence loop"
    assert long_prompt(3000) == text
    assert long_prompt(3000, seed=1) != text


def test_exo_bench_runs_cold_hit_evict_restore(fake_exo: str) -> None:
    prompt = "A " + long_prompt(200)
    result = exo_bench(fake_exo, "tiny", prompt, max_tokens=4)
    labels = [run.label for run in result.runs]
    assert labels == ["cold", "engine prefix hit", "evicting run", "vault restore"]
    assert result.runs[0].cached_tokens == 0
    assert result.runs[3].cached_tokens == result.prompt_tokens
    assert result.outputs_match
    assert result.speedup("cold") == 1.0


def test_cli_engine_exo_json(fake_exo: str) -> None:
    out = CliRunner().invoke(
        app,
        [
            "bench",
            "--engine",
            "exo",
            "--exo-api",
            fake_exo,
            "--model",
            "tiny",
            "--tokens",
            "64",
            "--json",
        ],
    )
    assert out.exit_code == 0, out.output
    report = json.loads(out.stdout)
    assert report["engine"] == "exo" and len(report["runs"]) == 4


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
    assert report["runs"][0]["cached_tokens"] == 0
    assert report["runs"][2]["cached_tokens"] > 0, "the third run must be served from the vault"
    assert report["outputs_match"]
