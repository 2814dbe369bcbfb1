"""`tierkv bench`: the restore pipeline timed end to end on synthetic KV of a real model's shape."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from tierkv.bench import (
    DEFAULT_MODEL_SHAPE,
    MODEL_SHAPES,
    BenchResult,
    run_bench,
    vault_addresses,
)
from tierkv.bench_engines import EngineBench, exo_bench, long_prompt, vllm_bench
from tierkv.cli import app
from tierkv.config import ConfigError, TierKVConfig, load_config, parse_cold_address, parse_size
from tierkv.quant import CODEC_NAMES

console = Console(stderr=True)
WIDE = 150
"""Table width when the output is not a terminal (a file, a pipe, a README)."""


@app.command()
def bench(
    tokens: Annotated[int, typer.Option(help="Prompt length in tokens.", min=1)] = 30_000,
    model_shape: Annotated[
        str, typer.Option(help=f"KV shape to imitate: {', '.join(MODEL_SHAPES)}.")
    ] = DEFAULT_MODEL_SHAPE,
    codec: Annotated[
        str | None,
        typer.Option(help=f"{', '.join(CODEC_NAMES)} or all [default: the config's codec]"),
    ] = None,
    vault: Annotated[
        list[str] | None,
        typer.Option(
            help="HOST:PORT of a running vault, or a redis:// URL; repeat to spread blocks over "
            "several [default: an embedded vault]."
        ),
    ] = None,
    workers: Annotated[
        int,
        typer.Option(help="Also promote the prefix from N concurrent worker processes.", min=1),
    ] = 1,
    dtype: Annotated[str, typer.Option(help="fp16 or fp32.")] = "fp16",
    block_tokens: Annotated[int, typer.Option(help="Tokens per stored block.", min=1)] = 256,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    config: Annotated[Path | None, typer.Option(help="tierkv.toml to read.")] = None,
    engine: Annotated[
        str | None,
        typer.Option(help="Time a real engine instead: vllm (needs --model) or exo (--exo-api)."),
    ] = None,
    model: Annotated[str | None, typer.Option(help="--engine vllm/exo: the model.")] = None,
    exo_api: Annotated[
        str | None, typer.Option(help="--engine exo: EXO's API, e.g. http://127.0.0.1:52415.")
    ] = None,
    kv_cache_bytes: Annotated[
        str | None,
        typer.Option(help="--engine vllm: KV cache size, e.g. 2GiB [default: vLLM's choice]."),
    ] = None,
    prompt_file: Annotated[
        Path | None,
        typer.Option(help="--engine: the prompt [default: a long varied built-in text]."),
    ] = None,
) -> None:
    """Encode, store, look up, promote and decode a prompt's KV; print each phase's speed.

    With --engine, time to first token of one prompt three ways instead: cold, from the engine's
    own prefix cache, and restored from the vault after the engine's cache lost it.
    """
    try:
        cfg = load_config(config)
    except ConfigError as exc:
        console.print(f"[red]{exc}")
        raise typer.Exit(2) from None
    vaults = vault or []
    for address in vaults:
        try:
            parse_cold_address(address)
        except ValueError as exc:
            console.print(f"[red]--vault: {exc}")
            raise typer.Exit(2) from None
    codec = codec or cfg.turbo_quant.codec_name
    if codec != "all" and codec not in CODEC_NAMES:
        console.print(
            f"[red]--codec {codec!r} is unknown; use one of {', '.join(CODEC_NAMES)}, all"
        )
        raise typer.Exit(2)
    if engine is not None:
        prompt = prompt_file.read_text() if prompt_file else long_prompt(words=tokens)
        limit = None if prompt_file else tokens
        if engine == "vllm":
            kv_bytes = _size_option("--kv-cache-bytes", kv_cache_bytes)
            _vllm_bench(cfg, model, vaults, codec, prompt, limit, kv_bytes, as_json)
        else:
            _exo_bench(engine, model, exo_api, prompt, as_json)
        return
    codecs = list(CODEC_NAMES) if codec == "all" else [codec]
    try:
        with Progress(
            TextColumn("{task.description:<18}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TimeElapsedColumn(),
            console=console,
            disable=as_json,
            transient=True,
        ) as progress:
            tasks: dict[tuple[str, str], TaskID] = {}

            def on_phase(name: str, phase: str, done: int, total: int) -> None:
                task = tasks.get((name, phase))
                if task is None:
                    task = tasks[(name, phase)] = progress.add_task(f"{name} {phase}", total=total)
                progress.update(task, completed=done, total=total)

            results = run_bench(
                tokens=tokens,
                model_shape=model_shape,
                codecs=codecs,
                dtype=dtype,
                block_tokens=block_tokens,
                vaults=vaults,
                workers=workers,
                on_phase=on_phase,
            )
    except (ValueError, RuntimeError) as exc:
        console.print(f"[red]{exc}")
        raise typer.Exit(2 if isinstance(exc, ValueError) else 1) from None
    if as_json:
        objects = [result.as_json() for result in results]
        print(json.dumps(objects if codec == "all" else objects[0], indent=2))
    else:
        Console(width=None if sys.stdout.isatty() else WIDE).print(results_table(results))


def results_table(results: list[BenchResult]) -> Table:
    """One row per codec; speeds in GB/s, with numpy memcpy of the same bytes in the title."""
    first = results[0]
    table = Table(
        title=(
            f"tierkv bench: {first.tokens} tokens of {first.model_shape} ({first.dtype}, "
            f"{first.raw_bytes / 1e6:,.0f} MB), memcpy {first.memcpy_gbps:.2f} GB/s"
        ),
        caption="GB/s: encode and decode of raw bytes, put and promote of stored bytes; "
        "restore = lookup + promote + decode; fidelity of the worst block",
    )
    columns: list[tuple[str, Callable[[BenchResult], str]]] = [
        ("codec", lambda r: r.codec),
        ("stored MB", lambda r: f"{r.stored_bytes / 1e6:,.0f}"),
        ("ratio", lambda r: f"{r.ratio:.2f}×"),
        ("encode", lambda r: f"{r.encode_gbps:.2f}"),
        ("put", lambda r: f"{r.store_gbps:.2f}"),
        ("lookup ms", lambda r: f"{r.lookup_s * 1000:.1f}"),
        ("promote", lambda r: f"{r.promote_gbps:.2f}"),
        ("decode", lambda r: f"{r.decode_gbps:.2f}"),
        ("restore s", lambda r: f"{r.restore_s:.2f}"),
        ("SNR dB", lambda r: f"{r.snr_db:.1f}"),
        ("cosine", lambda r: f"{r.cosine:.4f}"),
        ("1/10/25 GbE s", lambda r: "/".join(f"{s:.2f}" for s in r.link_s.values())),
        ("peak MB", lambda r: f"{r.peak_rss_bytes / 1e6:,.0f}"),
    ]
    if first.workers > 1:
        columns += [
            (f"{first.workers} workers: each", lambda r: _spread(r.worker_promote_gbps)),
            ("all", lambda r: f"{r.aggregate_promote_gbps:.2f}"),
        ]
    for header, _ in columns:
        codec_column = header == "codec"
        table.add_column(header, justify="left" if codec_column else "right", no_wrap=codec_column)
    for result in results:
        table.add_row(*(cell(result) for _, cell in columns))
    return table


def _spread(values: list[float]) -> str:
    """min–max of per-worker figures."""
    return f"{min(values):.2f}–{max(values):.2f}"


def _vllm_bench(
    cfg: TierKVConfig,
    model: str | None,
    vaults: list[str],
    codec: str,
    prompt: str,
    tokens: int | None,
    kv_cache_bytes: int | None,
    as_json: bool,
) -> None:
    if not model:
        console.print("[red]--engine vllm needs --model (a model directory or name)")
        raise typer.Exit(2)
    if codec == "all":
        console.print("[red]--codec all: --engine vllm runs one codec; name one")
        raise typer.Exit(2)
    with (
        vault_addresses(vaults) as addresses,
        console.status("vLLM: cold, prefix hit, vault restore"),
    ):
        settings: dict[str, object] = {
            "cluster.kv_cold": addresses,
            "cluster.ssm_cold": addresses,
            "turbo_quant.enabled": codec != "none",
            "turbo_quant.kv_dim": cfg.turbo_quant.kv_dim,
        }
        if codec != "none":
            settings["turbo_quant.codec"] = codec
        result = vllm_bench(
            model, prompt, tokens=tokens, connector_config=settings, kv_cache_bytes=kv_cache_bytes
        )
    _print_engine_bench(result, as_json)


def _size_option(name: str, value: str | None) -> int | None:
    try:
        return None if value is None else parse_size(value)
    except ValueError as exc:
        console.print(f"[red]{name}: {exc}")
        raise typer.Exit(2) from None


def _exo_bench(
    engine: str, model: str | None, exo_api: str | None, prompt: str, as_json: bool
) -> None:
    if engine != "exo":
        console.print(f"[red]--engine {engine!r} is unknown; use vllm or exo")
        raise typer.Exit(2)
    if not exo_api or not model:
        console.print("[red]--engine exo needs --exo-api URL and --model NAME")
        raise typer.Exit(2)
    with console.status("asking EXO") as status:
        result = exo_bench(exo_api, model, prompt, on_run=lambda label: status.update(label))
    _print_engine_bench(result, as_json)


def _print_engine_bench(result: EngineBench, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result.as_json(), indent=2))
    else:
        Console().print(engine_table(result))


def engine_table(result: EngineBench) -> Table:
    """One row per run: TTFT, speed-up over the cold run, tokens the engine reused."""
    table = Table(
        title=f"tierkv bench --engine {result.engine}: {result.prompt_tokens or '?'} prompt tokens",
        caption="greedy outputs "
        + ("match" if result.outputs_match else "[red]DIFFER[/] between runs of the same prompt"),
    )
    for column in ("run", "TTFT s", "speed-up", "cached tokens"):
        table.add_column(column, justify="left" if column == "run" else "right")
    for run in result.runs:
        table.add_row(
            run.label,
            f"{run.ttft_s:.3f}",
            f"{result.speedup(run.label):.1f}×" if run.same_prompt else "",
            "" if run.cached_tokens is None else str(run.cached_tokens),
        )
    return table
