"""`tierkv eval`: each codec's effect on a model's greedy continuations, and the codec gate."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

from tierkv.cli import app
from tierkv.cli.bench import _size_option
from tierkv.cli.errors import fail
from tierkv.config import CODEC_BITS, ConfigError, kv_pair_codecs, load_config

if TYPE_CHECKING:
    from tierkv.bench_eval import EvalReport

console = Console(stderr=True)
DEFAULT_CODECS = "none,int8,k8v4,tq4,tq3.5,tq3"
DEFAULT_MAX_KL = 0.01


@app.command("eval")
def eval_command(
    model: Annotated[
        str, typer.Option(metavar="DIR|NAME", help="The model directory (or a cached hub name).")
    ],
    engine: Annotated[str, typer.Option(metavar="vllm", help="The engine.")] = "vllm",
    codecs: Annotated[
        str,
        typer.Option(
            metavar="NAMES",
            help='Codecs to compare, e.g. "none,int8,k8v4,tq4" (none first).',
        ),
    ] = DEFAULT_CODECS,
    prompts: Annotated[
        Path | None,
        typer.Option(
            metavar="PATH",
            help="A JSONL file, one prompt per line.",
            show_default="built-in texts",
        ),
    ] = None,
    tokens: Annotated[
        int,
        typer.Option(
            metavar="N",
            help="Built-in prompts run up to this many tokens; any prompt is cut there.",
            min=32,
        ),
    ] = 2048,
    new_tokens: Annotated[
        int, typer.Option(metavar="N", help="Greedy tokens generated per run.", min=1)
    ] = 50,
    min_identical: Annotated[
        float,
        typer.Option(
            metavar="SHARE",
            help="Gate: share of prompts with identical continuations.",
            min=0,
            max=1,
        ),
    ] = 0.95,
    max_kl: Annotated[
        float,
        typer.Option(
            metavar="NATS", help="Gate: mean KL divergence (nats) over shared positions.", min=0
        ),
    ] = DEFAULT_MAX_KL,
    write_config: Annotated[
        Path | None,
        typer.Option(
            metavar="PATH",
            help="Record the smallest codec that passes the gate in this tierkv.toml.",
            show_default=False,
        ),
    ] = None,
    vault: Annotated[
        list[str] | None,
        typer.Option(
            metavar="HOST:PORT",
            help="A running vault (repeatable).",
            show_default="an embedded vault",
        ),
    ] = None,
    kv_cache_bytes: Annotated[
        str | None,
        typer.Option(
            metavar="SIZE", help="vLLM's KV cache size, e.g. 2GiB.", show_default="vLLM's choice"
        ),
    ] = None,
    config: Annotated[
        Path | None,
        typer.Option(metavar="PATH", help="tierkv.toml to read (kv_dim).", show_default=False),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Store each prompt through each codec, drop the engine's prefix cache, restore it from the
    vault and generate again: how often the continuation stays identical, where it first
    differs, the KL divergence of the next-token distributions and the bytes saved.
    """
    from tierkv.bench import vault_addresses  # the codecs (Numba): not for `tierkv --help`
    from tierkv.bench_eval import builtin_prompts, vllm_eval, write_verdict

    try:
        cfg = load_config(config)
    except ConfigError as exc:
        raise fail("eval", str(exc), 2) from None
    if engine != "vllm":
        raise fail(
            "eval",
            f"--engine {engine!r}: tierkv eval drives vLLM only (EXO's API returns no "
            "log-probabilities and cannot switch codecs between runs)",
            2,
        )
    names = [name.strip() for name in codecs.split(",") if name.strip()]
    for name in names:
        if name not in CODEC_BITS and _pair(name) is None:
            raise fail(
                "eval",
                f"--codecs: unknown codec {name!r}; use {', '.join(CODEC_BITS)} or a K/V "
                'pair like "k8v4"',
                2,
            )
    prompt_set = _read_prompts(prompts, tokens) if prompts else builtin_prompts(tokens)
    kv_bytes = _size_option("--kv-cache-bytes", kv_cache_bytes)
    with (
        vault_addresses(vault or []) as addresses,
        console.status(f"vLLM: {len(prompt_set)} prompts x {len(names)} codecs"),
    ):
        settings: dict[str, object] = {"cluster.kv_cold": addresses, "cluster.ssm_cold": addresses}
        report = vllm_eval(
            model,
            prompt_set,
            names,
            new_tokens=new_tokens,
            connector_config=settings,
            kv_dim=cfg.turbo_quant.kv_dim,
            kv_cache_bytes=kv_bytes,
        )
    verdict = report.verdict(min_identical, max_kl)
    if as_json:
        found = report.as_json()
        found["verdict"] = verdict.codec if verdict else None
        print(json.dumps(found, indent=2))
    else:
        Console().print(eval_table(report, min_identical, max_kl))
    if write_config is None:
        return
    if verdict is None:
        raise fail("eval", "no codec passed the gate, not even none: nothing written", 1)
    try:
        write_verdict(write_config, report, verdict, min_identical, max_kl)
    except (OSError, ValueError) as exc:
        raise fail("eval", f"--write-config {write_config}: {exc}", 1) from None
    console.print(
        f"{write_config}: [codec_verdicts] {report.fingerprint} = {verdict.codec!r}; "
        '[turbo_quant] enabled = true, codec = "auto" uses it'
    )


def _pair(name: str) -> tuple[str, str] | None:
    try:
        return kv_pair_codecs(name)
    except ValueError:
        return None


def _read_prompts(path: Path, tokens: int) -> list[tuple[str, int]]:
    """The prompts of a JSONL file: each line a JSON string or an object with "prompt"."""
    found = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise fail("eval", f"--prompts {path}: {exc}", 2) from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            text = item["prompt"] if isinstance(item, dict) else item
        except (ValueError, KeyError):
            text = None
        if not isinstance(text, str) or not text:
            raise fail(
                "eval",
                f'--prompts {path}:{number}: expected a JSON string or {{"prompt": "..."}}',
                2,
            )
        found.append((text, tokens))
    if not found:
        raise fail("eval", f"--prompts {path}: no prompts in it", 2)
    return found


def eval_table(report: EvalReport, min_identical: float, max_kl: float) -> Table:
    """One row per codec, the gate's verdict in the caption."""
    from tierkv.bench_eval import ARTICLE_TOKENS

    verdict = report.verdict(min_identical, max_kl)
    prompts = len(report.codecs[0].prompts) if report.codecs else 0
    table = Table(
        title=(
            f"tierkv eval: {Path(report.model).name}, {prompts} prompts x {report.new_tokens} "
            f"greedy tokens ({report.seconds:.0f} s)"
        ),
        caption=(
            f"restored run vs cold run. KL: mean over the positions before the first difference "
            f"(and at it), from the top-{report.top_k} log-probabilities, the rest of the "
            f"vocabulary folded into one bucket. Gate: >= {min_identical:.0%} identical and KL "
            f"<= {max_kl:g}: {verdict.codec if verdict else 'nothing passes'}"
        ),
    )
    columns = (
        "codec",
        "identical",
        f"first {ARTICLE_TOKENS} identical",
        "first diff",
        "mean KL",
        "restored",
        "ratio",
        "gate",
    )
    for column in columns:
        table.add_column(column, justify="left" if column == "codec" else "right")
    for c in report.codecs:
        table.add_row(
            c.codec,
            f"{c.identical:.0%}",
            f"{c.article_identical}/{len(c.prompts)}",
            f"{c.mean_first_diff:.1f}",
            f"{c.mean_kl:.2g}",
            f"{c.restored_fraction:.0%}",
            f"{c.stored_ratio:.2f}x",
            "pass" if c.passes(min_identical, max_kl) else "[red]fail",
        )
    return table
