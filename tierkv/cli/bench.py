"""`tierkv bench`: the restore pipeline timed end to end on synthetic KV of a real model's shape."""

from __future__ import annotations

import json
import math
import time
import urllib.error
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich import box
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from tierkv.addresses import parse_cold_address
from tierkv.cli import app
from tierkv.cli.engine import engine_config
from tierkv.cli.errors import fail
from tierkv.codecs import CODEC_NAMES, WHOLE_BLOCK_CODECS, kv_pair_codecs
from tierkv.config import SecurityConfig, TierKVConfig
from tierkv.heap import keep_freed_memory
from tierkv.model_shapes import DEFAULT_MODEL_SHAPE, MODEL_SHAPES
from tierkv.sizes import parse_size

if TYPE_CHECKING:  # numpy, gRPC and Numba are imported when a bench runs, not for --help
    from tierkv.bench.engines import EngineBench
    from tierkv.bench.pipeline import BenchResult

console = Console(stderr=True)


def _note(message: str) -> None:
    console.print(f"tierkv bench: {message}", highlight=False, soft_wrap=True)


@app.command()
def bench(
    tokens: Annotated[
        int, typer.Option(metavar="N", help="Prompt length in tokens.", min=1)
    ] = 30_000,
    model_shape: Annotated[
        str, typer.Option(metavar="NAME", help=f"KV shape to imitate: {', '.join(MODEL_SHAPES)}.")
    ] = DEFAULT_MODEL_SHAPE,
    codec: Annotated[
        str | None,
        typer.Option(
            metavar="NAME",
            help=f"A codec ({', '.join(WHOLE_BLOCK_CODECS)}, ...), a K/V pair or preset, or all.",
            show_default="the config's codec",
        ),
    ] = None,
    vault: Annotated[
        list[str] | None,
        typer.Option(
            metavar="HOST:PORT|URL",
            help="A running vault, or a redis:// URL; repeat to spread blocks over several.",
            show_default="an embedded vault",
        ),
    ] = None,
    workers: Annotated[
        int,
        typer.Option(
            metavar="N", help="Also promote the prefix from N concurrent worker processes.", min=1
        ),
    ] = 1,
    dtype: Annotated[str, typer.Option(metavar="fp16|fp32", help="KV dtype.")] = "fp16",
    repeat: Annotated[
        int,
        typer.Option(
            metavar="N",
            help="Timed runs of each codec, after one untimed warm-up; each phase reports "
            "their median.",
            min=1,
        ),
    ] = 3,
    block_tokens: Annotated[
        int, typer.Option(metavar="N", help="Tokens per stored block.", min=1)
    ] = 256,
    as_json: Annotated[
        bool,
        typer.Option(
            "--json",
            help="Print JSON: an object of figures, or an array of them with --codec all.",
        ),
    ] = False,
    config: Annotated[
        Path | None, typer.Option(metavar="PATH", help="tierkv.toml to read.", show_default=False)
    ] = None,
    engine: Annotated[
        str | None,
        typer.Option(
            metavar="vllm|exo",
            help="Time a real engine instead: vllm (needs --model) or exo (--exo-api).",
            show_default=False,
        ),
    ] = None,
    model: Annotated[
        str | None,
        typer.Option(metavar="NAME", help="--engine vllm/exo: the model.", show_default=False),
    ] = None,
    exo_api: Annotated[
        str | None,
        typer.Option(
            metavar="URL",
            help="--engine exo: EXO's API, e.g. http://127.0.0.1:52415.",
            show_default=False,
        ),
    ] = None,
    kv_cache_bytes: Annotated[
        str | None,
        typer.Option(
            metavar="SIZE",
            help="--engine vllm: KV cache size, e.g. 2GiB.",
            show_default="vLLM's choice",
        ),
    ] = None,
    links: Annotated[
        bool,
        typer.Option(
            "--links",
            help="Also restore over 1, 10 and 25 GbE links (paced to each; takes their time).",
        ),
    ] = False,
    cpu: Annotated[
        str | None,
        typer.Option(
            metavar="native|haswell",
            help="Run the kernels built for this CPU: native, or haswell (AVX2, FMA, F16C).",
            show_default="the faster for the codec, measured once per machine",
        ),
    ] = None,
    prompt_file: Annotated[
        Path | None,
        typer.Option(
            metavar="PATH",
            help="--engine: the prompt.",
            show_default="a long varied built-in text",
        ),
    ] = None,
) -> None:
    """Encode, store, look up, promote and decode a prompt's KV; print each phase's speed.

    With --engine, time to first token of one prompt three ways instead: cold, from the engine's
    own prefix cache, and restored from the vault after the engine's cache lost it.
    """
    cfg = engine_config(config)
    origin = "--codec" if codec else f"{cfg.source}: compression.codec"
    codec = codec or cfg.compression.codec_name
    if codec != "all" and codec not in CODEC_NAMES and not _is_pair(codec):
        raise fail(
            "bench",
            f"{origin} {codec!r} is unknown; use one of {', '.join(CODEC_NAMES)}, all, or a K/V "
            'pair like "k8v4"',
            2,
        )
    vaults = vault or []
    for address in vaults:
        _check_address("--vault", address)
    if engine is not None:
        from tierkv.bench.prompts import long_prompt

        prompt = _read_prompt(prompt_file) if prompt_file else long_prompt(words=tokens)
        limit = None if prompt_file else tokens
        if engine == "vllm":
            kv_bytes = _size_option("--kv-cache-bytes", kv_cache_bytes)
            _vllm_bench(cfg, model, vaults, codec, prompt, limit, kv_bytes, as_json)
        else:
            _exo_bench(engine, model, exo_api, prompt, as_json)
        return
    build = _kernel_build(cpu, cfg.compression.codec_name if codec == "all" else codec)
    keep_freed_memory(cfg.client.kept_freed_bytes)  # as an engine's tier does when it starts
    results = _run_bench(
        tokens,
        model_shape,
        codec,
        dtype,
        block_tokens,
        repeat,
        vaults,
        cfg.security,
        workers,
        as_json,
        links,
    )
    if as_json:
        objects = [result.as_json() for result in results]
        typer.echo(json.dumps(objects if codec == "all" else objects[0], indent=2, allow_nan=False))
    else:
        Console().print(results_table(results, build))


def _is_pair(codec: str) -> bool:
    """Whether `codec` names a K/V pair of codecs, like "k8v4"."""
    try:
        return kv_pair_codecs(codec) is not None
    except ValueError:
        return False


def _read_prompt(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise fail("bench", f"--prompt-file {path}: {exc.strerror or exc}", 2) from None
    except UnicodeDecodeError:
        raise fail("bench", f"--prompt-file {path}: not UTF-8 text", 2) from None


def _check_address(option: str, address: str) -> None:
    try:
        parse_cold_address(address)
    except ValueError as exc:
        raise fail("bench", f"{option}: {exc}", 2) from None


def _run_bench(
    tokens: int,
    model_shape: str,
    codec: str,
    dtype: str,
    block_tokens: int,
    repeat: int,
    vaults: list[str],
    security: SecurityConfig,
    workers: int,
    quiet: bool,
    links: bool,
) -> list[BenchResult]:
    """run_bench with live progress when stderr is a terminal (one row per codec; with --json
    too: the JSON goes to stdout), plain lines elsewhere unless `quiet`."""
    from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

    from tierkv.backends.base import BackendUnavailable
    from tierkv.bench.pipeline import run_bench

    live = console.is_terminal
    with Progress(
        TextColumn("{task.description:<26}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=console,
        disable=not live,
        transient=True,
    ) as progress:
        rows: dict[str, TaskID] = {}
        phases: dict[str, str] = {}  # the phase each row shows
        compile_started = time.perf_counter()

        def on_phase(name: str, phase: str, done: int, total: int) -> None:
            nonlocal compile_started
            if phase == "compile":
                if done == 0:
                    compile_started = time.perf_counter()
                    if not live and not quiet:
                        _note("preparing the codec kernels (compiled on a first run, then cached)")
                elif done == total and not live and not quiet:
                    _note(f"kernels ready in {time.perf_counter() - compile_started:.1f} s")
                name, phase = "kernels", f"compiling {name}" if done < total else "ready"
            elif phase == "generate" and done == 0 and tokens % block_tokens:
                measured = tokens // block_tokens * block_tokens
                _note(
                    f"measuring {measured} of the {tokens} tokens: whole blocks of {block_tokens}"
                )
            row = rows.get(name)
            if row is None:
                row = rows[name] = progress.add_task(name, total=total)
            started = phases.get(name) != phase
            phases[name] = phase
            progress.update(row, description=f"{name} {phase}", completed=done, total=total)
            if started and live:
                progress.refresh()  # each phase drawn as it starts, however soon it ends

        try:
            return run_bench(
                tokens=tokens,
                model_shape=model_shape,
                codecs=list(WHOLE_BLOCK_CODECS) if codec == "all" else [codec],
                dtype=dtype,
                block_tokens=block_tokens,
                vaults=vaults,
                security=security,
                workers=workers,
                repeat=repeat,
                links=links,
                on_phase=on_phase,
            )
        except ValueError as exc:
            raise fail("bench", str(exc), 2) from None
        except (BackendUnavailable, RuntimeError, OSError) as exc:
            raise fail("bench", _one_line(str(exc)), 1) from None


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _figure(value: float | None, fmt: str) -> str:
    return "lossless" if value is None or not math.isfinite(value) else format(value, fmt)


def _kernel_build(cpu: str | None, codec: str) -> str:
    """Choose the kernels' build (--cpu, else measured for `codec`: kernel_builds) and run it in
    this process; what the bench's title says of it."""
    from tierkv import kernel_builds as builds

    if cpu is not None and cpu not in builds.runnable_builds():
        runnable = " or ".join(builds.runnable_builds())
        raise fail("bench", f"--cpu {cpu!r}: this CPU runs {runnable}", 2)
    choice = builds.Choice(cpu, "--cpu", {}) if cpu else builds.choose(codec)
    builds.apply(choice)
    return str(choice)


def results_table(results: list[BenchResult], build: str | None = None) -> Group:
    """One column per codec, one row per figure (fits an 80-column terminal with every codec);
    speeds in GB/s, with numpy memcpy of the same bytes and the kernels' instruction set and
    vector width in the title line. Title and caption
    are lines of their own, so a narrow table (one codec) does not wrap them."""
    from tierkv.quant.target import instruction_set  # Numba: loaded by the bench already

    first = results[0]
    tokens = f"{first.tokens_measured} tokens"
    if first.tokens_measured != first.tokens:
        tokens = f"{first.tokens_measured} of {first.tokens} tokens (whole blocks)"
    title = (
        f"{tokens} of {first.model_shape}, {first.dtype}, "
        f"{first.raw_bytes / 1e6:,.0f} MB; memcpy {first.memcpy_gbps:.2f} GB/s; "
        f"kernels for {instruction_set()}" + (f", build {build}" if build else "")
    )
    runs = "1 timed run" if first.runs == 1 else f"the median of {first.runs} timed runs"
    caption = (
        f"each figure {runs} after {first.warmup_runs} untimed"
        + ("" if first.spread_s is None else ", restore ± half the range of their restore s")
        + "; encode (on the tier's encode threads, as a store), decode: GB/s of raw bytes; "
        "put, promote: GB/s of stored bytes; kB/token: stored kB per restored token"
        + (
            ", kB/tok full: the same were every layer full attention (this run's stored bytes "
            "per token and layer of the blocks before the window, times every layer); "
            if first.full_attention_bytes_per_token is not None
            else "; "
        )
        + "restore = ColdTier's lookup and load on loopback (each Promote run decoded while the "
        "next is on the wire), GbE s = the same with every Promote held to that line rate; "
        "fidelity of the worst block; sealed: the same blocks sealed (AES-256-GCM, "
        f"{first.sealed_with}), seal and open on one thread, sealed s = lookup and load of them "
        "by a tier with the key, kept sealed = restore s ÷ sealed s"
    )
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    rows: list[tuple[str, Callable[[BenchResult], str]]] = [
        ("stored MB", lambda r: f"{r.stored_bytes / 1e6:,.0f}"),
        ("ratio", lambda r: f"{r.ratio:.2f}×"),
        ("kB/token", lambda r: f"{(r.stored_bytes_per_token or 0) / 1e3:.1f}"),
        *(
            [("kB/tok full", lambda r: f"{(r.full_attention_bytes_per_token or 0) / 1e3:.1f}")]
            if first.full_attention_bytes_per_token is not None
            else []
        ),
        ("encode GB/s", lambda r: f"{r.encode_gbps:.2f}"),
        ("put GB/s", lambda r: f"{r.store_gbps:.2f}"),
        ("lookup ms", lambda r: f"{r.lookup_s * 1000:.1f}"),
        ("promote GB/s", lambda r: f"{r.promote_gbps:.2f}"),
        ("decode GB/s", lambda r: f"{r.decode_gbps:.2f}"),
        ("restore s", lambda r: f"{r.restore_s:.2f}"),
        *([("restore ±", _half_range)] if first.spread_s is not None else []),
        ("seal GB/s", lambda r: f"{r.seal_gbps:.2f}"),
        ("open GB/s", lambda r: f"{r.open_gbps:.2f}"),
        ("sealed s", lambda r: f"{r.sealed_restore_s:.2f}"),
        ("kept sealed", lambda r: f"{r.sealed_vs_unsealed_restore:.2f}×"),
        ("SNR dB", lambda r: _figure(r.snr_db, ".1f")),
        ("cosine", lambda r: f"{r.cosine:.4f}"),
        *(
            (f"{link} s", lambda r, link=link: f"{r.link_restore_s[link]:.2f}")
            for link in first.link_restore_s
        ),
        ("peak MB", lambda r: f"{r.peak_rss_bytes / 1e6:,.0f}"),
    ]
    if first.worker_promote_gbps is not None:
        rows += [
            (f"{first.workers} workers GB/s", lambda r: _spread(r.worker_promote_gbps or [])),
            ("all workers GB/s", lambda r: f"{r.aggregate_promote_gbps or 0:.2f}"),
        ]
    table.add_column("codec", no_wrap=True)
    for result in results:
        table.add_column(result.codec, justify="right", no_wrap=True)
    for label, cell in rows:
        table.add_row(label, *(cell(result) for result in results))
    return Group(Text(title), table, Text(caption))


def _spread(values: list[float]) -> str:
    """min–max of per-worker figures."""
    return f"{min(values):.2f}–{max(values):.2f}"


def _half_range(result: BenchResult) -> str:
    """Half the min–max range of the timed runs' restore seconds, as a share of their median."""
    low, high = (result.spread_s or {}).get("restore_s", (result.restore_s, result.restore_s))
    return f"±{(high - low) / 2 / result.restore_s:.0%}"


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
        raise fail("bench", "--engine vllm needs --model (a model directory or name)", 2)
    if codec == "all":
        raise fail("bench", "--codec all: --engine vllm runs one codec; name one", 2)
    from tierkv.bench.engines import vllm_bench
    from tierkv.patches.vllm import check_model

    check_model(model, "--model")
    from tierkv.bench.pipeline import vault_addresses

    with (
        vault_addresses(vaults) as addresses,
        console.status("vLLM: cold, prefix hit, vault restore"),
    ):
        settings: dict[str, object] = {
            "cluster.kv_cold": addresses,
            "cluster.ssm_cold": addresses,
            "compression.enabled": codec != "none",
            "compression.group_size": cfg.compression.group_size,
        }
        if codec != "none":
            settings["compression.codec"] = codec
        result = vllm_bench(
            model, prompt, tokens=tokens, connector_config=settings, kv_cache_bytes=kv_cache_bytes
        )
    _print_engine_bench(result, as_json)


def _size_option(name: str, value: str | None) -> int | None:
    try:
        return None if value is None else parse_size(value)
    except ValueError as exc:
        raise fail("bench", f"{name}: {exc}", 2) from None


def _exo_bench(
    engine: str, model: str | None, exo_api: str | None, prompt: str, as_json: bool
) -> None:
    if engine != "exo":
        raise fail("bench", f"--engine {engine!r} is unknown; use vllm or exo", 2)
    if not exo_api or not model:
        raise fail("bench", "--engine exo needs --exo-api URL and --model NAME", 2)
    url = urllib.parse.urlsplit(exo_api)
    if url.scheme not in ("http", "https") or not url.hostname:
        message = f"--exo-api: expected a URL like http://127.0.0.1:52415, got {exo_api!r}"
        raise fail("bench", message, 2)
    from tierkv.bench.engines import exo_bench

    try:
        with console.status("asking EXO") as status:
            result = exo_bench(exo_api, model, prompt, on_run=lambda label: status.update(label))
    except urllib.error.URLError as exc:
        reason = getattr(exc.reason, "strerror", None) or exc.reason
        raise fail("bench", f"EXO at {exo_api} did not answer: {reason}", 1) from None
    except (OSError, RuntimeError, ValueError) as exc:
        raise fail("bench", f"EXO at {exo_api}: {_one_line(str(exc))}", 1) from None
    _print_engine_bench(result, as_json)


def _print_engine_bench(result: EngineBench, as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps(result.as_json(), indent=2, allow_nan=False))
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
