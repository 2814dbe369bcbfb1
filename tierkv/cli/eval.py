"""`tierkv eval`: each codec's effect on a model's greedy continuations, and the codec gate."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from tierkv.cli import app
from tierkv.cli.bench import _size_option
from tierkv.cli.engine import engine_config
from tierkv.cli.errors import fail
from tierkv.codecs import CODEC_BITS, kv_pair_codecs

if TYPE_CHECKING:
    from tierkv.bench.eval import EvalReport

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
    passkey_lengths: Annotated[
        str,
        typer.Option(
            metavar="TOKENS",
            help="Passkey prompts of these lengths (capped at the model's context); '' for none.",
        ),
    ] = "1024,2048,4096,8192",
    counting: Annotated[bool, typer.Option(help="Score the few-shot counting task.")] = True,
    min_task_accuracy: Annotated[
        float,
        typer.Option(
            metavar="SHARE",
            help="Gate: share of each task's prompts answered right after a restore.",
            min=0,
            max=1,
        ),
    ] = 0.0,
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
        typer.Option(
            metavar="PATH",
            help="tierkv.toml to read ([compression] group_size).",
            show_default=False,
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Store each prompt through each codec, drop the engine's prefix cache, restore it from the
    vault and generate again: how often the continuation stays identical, where it first
    differs, the KL divergence of the next-token distributions and the bytes saved.
    """
    from tierkv.bench.eval import (
        EngineFailed,
        builtin_prompts,
        task_prompts,
        vllm_eval,
        write_verdict,
    )
    from tierkv.bench.pipeline import vault_addresses  # the codecs (Numba): not for `tierkv --help`
    from tierkv.patches.vllm import check_model

    cfg = engine_config(config)
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
    lengths = _passkey_lengths(passkey_lengths, model, new_tokens)
    scored = task_prompts(lengths)
    prompt_set += scored if counting else [p for p in scored if p["task"] != "counting"]
    kv_bytes = _size_option("--kv-cache-bytes", kv_cache_bytes)
    check_model(model, "--model")
    with vault_addresses(vault or []) as addresses:
        settings: dict[str, object] = {"cluster.kv_cold": addresses, "cluster.ssm_cold": addresses}
        try:
            report = vllm_eval(
                model,
                prompt_set,
                names,
                new_tokens=new_tokens,
                connector_config=settings,
                group_size=cfg.compression.group_size,
                kv_cache_bytes=kv_bytes,
            )
        except EngineFailed as exc:
            raise fail("eval", str(exc), 1) from None
    verdict = report.verdict(min_identical, max_kl, min_task_accuracy)
    if as_json:
        found = report.as_json()
        found["verdict"] = verdict.codec if verdict else None
        print(json.dumps(found, indent=2))
    else:
        Console().print(eval_table(report, min_identical, max_kl, min_task_accuracy))
    failures = report.self_test_failures()
    if failures:
        raise fail(
            "eval",
            f"self-test failed: codec none differed from vLLM's own prefix-cache hit on "
            f"{failures} prompts (the restore or the harness is broken)",
            1,
        )
    if write_config is None:
        return
    if verdict is None:
        raise fail("eval", "no codec passed the gate, not even none: nothing written", 1)
    try:
        write_verdict(write_config, report, verdict, min_identical, max_kl)
    except OSError as exc:
        raise fail("eval", f"--write-config {write_config}: {exc.strerror or exc}", 1) from None
    except ValueError as exc:
        raise fail("eval", f"--write-config {write_config}: {exc}", 1) from None
    console.print(
        f"{write_config}: [codec_verdicts] {report.fingerprint} = {verdict.codec!r}; "
        '[compression] enabled = true, codec = "auto" uses it'
    )


def _pair(name: str) -> tuple[str, str] | None:
    try:
        return kv_pair_codecs(name)
    except ValueError:
        return None


def _passkey_lengths(option: str, model: str, new_tokens: int) -> list[int]:
    """--passkey-lengths as token counts, each capped to fit the model's context."""
    from tierkv.bench.eval import TASK_NEW_TOKENS
    from tierkv.patches.vllm import read_hf_config

    try:
        lengths = [int(part) for part in option.split(",") if part.strip()]
    except ValueError:
        message = f"--passkey-lengths {option!r}: expected token counts like 1024,4096"
        raise fail("eval", message, 2) from None
    if any(length < 64 for length in lengths):
        raise fail("eval", f"--passkey-lengths {option!r}: each length must be >= 64", 2)
    context = (read_hf_config(model) or {}).get("max_position_embeddings")
    if isinstance(context, int):
        room = context - max(new_tokens, TASK_NEW_TOKENS) - 16
        lengths = [min(length, room) for length in lengths]
    return list(dict.fromkeys(lengths))


def _read_prompts(path: Path, tokens: int) -> list[dict[str, Any]]:
    """The prompts of a JSONL file: each line a JSON string or an object with "prompt"."""
    found = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise fail("eval", f"--prompts {path}: {exc.strerror or exc}", 2) from None
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
        found.append({"text": text, "keep": tokens})
    if not found:
        raise fail("eval", f"--prompts {path}: no prompts in it", 2)
    return found


def eval_table(
    report: EvalReport, min_identical: float, max_kl: float, min_task_accuracy: float = 0.0
) -> Table:
    """One row per codec and the engine's own floor first; the gate's verdict in the caption."""
    from tierkv.bench.eval import ARTICLE_TOKENS

    verdict = report.verdict(min_identical, max_kl, min_task_accuracy)
    rows = [report.floor, *report.codecs] if report.floor else report.codecs
    texts = len(rows[0].texts) if rows else 0
    tasks = rows[0].tasks() if rows else []
    table = Table(
        title=(
            f"tierkv eval: {Path(report.model).name}, {texts} prompts x {report.new_tokens} "
            f"greedy tokens ({report.seconds:.0f} s)"
        ),
        caption=(
            "restored run vs vLLM's own prefix-cache hit of the same prompt (vs hit) and vs the "
            "cold run; the 'vLLM hit' row is the engine's own hit vs cold, no tierkv (the floor). "
            f"KL: mean over the positions before the first difference (and at it), from the "
            f"top-{report.top_k} log-probabilities, the rest of the vocabulary folded into one "
            "bucket. Accuracy: restored (cold). "
            f"Gate: >= {min_identical:.0%} identical to the hit, KL <= {max_kl:g}, every task "
            f">= {min_task_accuracy:.0%}: {verdict.codec if verdict else 'nothing passes'}"
        ),
    )
    columns = [
        "codec",
        "identical vs hit",
        f"first {ARTICLE_TOKENS} identical",
        "first diff",
        "KL vs hit",
        "identical vs cold",
        "KL vs cold",
        *tasks,
        "restored",
        "ratio",
        "gate",
    ]
    for column in columns:
        table.add_column(column, justify="left" if column == "codec" else "right")
    for c in rows:
        accuracy = [
            f"{c.accuracy(task) or 0:.0%} ({c.accuracy(task, cold=True) or 0:.0%})"
            for task in tasks
        ]
        floor = c is report.floor
        table.add_row(
            c.codec,
            "-" if floor else f"{c.identical:.0%}",
            f"{c.article_identical}/{len(c.texts)}",
            f"{c.mean_first_diff:.1f}",
            "-" if floor else f"{c.mean_kl:.2g}",
            f"{c.cold_identical:.0%}",
            f"{c.mean_cold_kl:.2g}",
            *accuracy,
            f"{c.restored_fraction:.0%}",
            "-" if floor else f"{c.stored_ratio:.2f}x",
            "-"
            if floor
            else "pass"
            if c.passes(min_identical, max_kl, min_task_accuracy)
            else "[red]fail",
        )
    return table
