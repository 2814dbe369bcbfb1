"""`tierkv eval`: each codec's effect on a model's greedy continuations, and the codec gate."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from tierkv.bench.eval import TASK_NEW_TOKENS, TIE_NATS, Gate, passkey_probes
from tierkv.cli import app
from tierkv.cli.bench import _size_option
from tierkv.cli.engine import engine_config
from tierkv.cli.errors import fail
from tierkv.codecs import CODEC_NAMES, PRESETS, kv_pair_codecs
from tierkv.patches.vllm import read_hf_config

if TYPE_CHECKING:
    from tierkv.bench.eval import EvalReport

console = Console(stderr=True)
DEFAULT_GATE = Gate()


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
            show_default="every codec and preset",
        ),
    ] = "",
    dtype: Annotated[
        str,
        typer.Option(
            metavar="DTYPES",
            help='Compute dtypes, one engine each: "float32", "model" (the model\'s own).',
        ),
    ] = "float32,model",
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
        int,
        typer.Option(metavar="N", help="Continuation tokens compared per text.", min=1),
    ] = 64,
    probes: Annotated[int, typer.Option(metavar="N", help="Passkey probes (0: none).", min=0)] = 30,
    passkey_tokens: Annotated[
        int | None,
        typer.Option(
            metavar="N",
            help="The longest passkey probe, in tokens.",
            show_default="the model's context",
            min=64,
        ),
    ] = None,
    max_kl: Annotated[
        float,
        typer.Option(
            metavar="NATS", help="Gate: mean teacher-forced KL in float32 compute.", min=0
        ),
    ] = DEFAULT_GATE.max_kl,
    min_top1: Annotated[
        float,
        typer.Option(
            metavar="SHARE",
            help="Gate: share of positions whose top-1 is the hit's, float32 compute.",
            min=0,
            max=1,
        ),
    ] = DEFAULT_GATE.min_top1,
    tie_nats: Annotated[
        float,
        typer.Option(
            metavar="NATS",
            help="A first difference where the hit's top-2 gap is under this is a tie.",
            min=0,
        ),
    ] = TIE_NATS,
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
    vault and compare with the engine's own prefix-cache hit: the teacher-forced KL and top-1
    agreement over a fixed continuation, greedy identity (ties apart), passkeys kept, bytes saved.
    """
    from tierkv.bench.eval import EngineFailed, builtin_prompts, vllm_eval, write_verdict
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
    names = names or [*CODEC_NAMES, *PRESETS]
    for name in names:
        if name not in CODEC_NAMES and _pair(name) is None:
            raise fail(
                "eval",
                f"--codecs: unknown codec {name!r}; use {', '.join([*CODEC_NAMES, *PRESETS])} "
                'or a K/V pair like "k8v4"',
                2,
            )
    hf_config = read_hf_config(model) or {}
    model_dtype = _model_dtype(hf_config)
    dtypes = _dtypes(dtype, model_dtype)
    gate = Gate(max_kl=max_kl, min_top1=min_top1)
    if write_config is not None and {"float32", model_dtype} - set(dtypes):
        raise fail(
            "eval",
            f"--write-config: the gate needs float32 and the model's {model_dtype}; "
            f"--dtype {dtype!r} leaves one out",
            2,
        )
    prompt_set = _read_prompts(prompts, tokens) if prompts else builtin_prompts(tokens)
    context = hf_config.get("max_position_embeddings")
    longest = passkey_tokens or (context if isinstance(context, int) else 8192)
    if isinstance(context, int):
        longest = min(longest, context - TASK_NEW_TOKENS - 16)
    prompt_set += passkey_probes(probes, longest) if probes else []
    kv_bytes = _size_option("--kv-cache-bytes", kv_cache_bytes)
    check_model(model, "--model")
    with vault_addresses(vault or []) as addresses:
        settings: dict[str, object] = {"cluster.kv_cold": addresses, "cluster.ssm_cold": addresses}
        try:
            report = vllm_eval(
                model,
                prompt_set,
                names,
                dtypes=dtypes,
                model_dtype=model_dtype,
                new_tokens=new_tokens,
                connector_config=settings,
                group_size=cfg.compression.group_size,
                kv_cache_bytes=kv_bytes,
                tie_nats=tie_nats,
            )
        except EngineFailed as exc:
            raise fail("eval", str(exc), 1) from None
    verdict = report.verdict(gate)
    if as_json:
        found = report.as_json()
        found["gate"] = {"max_kl": gate.max_kl, "min_top1": gate.min_top1}
        found["verdict"] = verdict.codec if verdict else None
        print(json.dumps(found, indent=2))
    else:
        for run in report.runs:
            Console().print(eval_table(report, run.dtype, gate))
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
        write_verdict(write_config, report, verdict, gate)
    except OSError as exc:
        raise fail("eval", f"--write-config {write_config}: {exc.strerror or exc}", 1) from None
    except ValueError as exc:
        raise fail("eval", f"--write-config {write_config}: {exc}", 1) from None
    console.print(
        f"{write_config}: [codec_verdicts] {report.fingerprint} = {verdict.codec!r}; "
        '[compression] enabled = true, codec = "auto" uses it'
    )


def _model_dtype(hf_config: dict[str, Any]) -> str:
    """The dtype the model's config.json names (vLLM's spelling), float32 when it names none."""
    named = hf_config.get("torch_dtype") or hf_config.get("dtype") or "float32"
    return {"float": "float32", "half": "float16"}.get(str(named), str(named))


def _dtypes(option: str, model_dtype: str) -> list[str]:
    """--dtype as vLLM dtype names ("model" is the model's own), each once."""
    found = []
    for part in (p.strip() for p in option.split(",") if p.strip()):
        name = model_dtype if part == "model" else part
        if name not in ("float32", "bfloat16", "float16"):
            message = f"--dtype {option!r}: {part!r} is not float32, bfloat16, float16 or model"
            raise fail("eval", message, 2)
        found.append(name)
    if not found:
        raise fail("eval", "--dtype: name at least one dtype", 2)
    return list(dict.fromkeys(found))


def _pair(name: str) -> tuple[str, str] | None:
    try:
        return kv_pair_codecs(name)
    except ValueError:
        return None


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


def eval_table(report: EvalReport, dtype: str, gate: Gate) -> Table:
    """One row per codec in one compute dtype, the engine's own floor first; the gate in the
    caption."""
    run = report.run(dtype)
    assert run is not None
    verdict = report.verdict(gate)
    rows = [run.floor, *run.codecs]
    texts, probes = len(run.floor.texts), len(run.floor.probes)
    table = Table(
        title=(
            f"tierkv eval: {Path(report.model).name} computing in {dtype}, {texts} texts x "
            f"{report.new_tokens} tokens, {probes} passkey probes ({run.seconds:.0f} s)"
        ),
        caption=(
            "Each codec's restored run against vLLM's own prefix-cache hit of the same prompt; "
            "the first row is the hit against the cold run, no tierkv (the floor). KL: "
            "KL(hit || restored), mean over the continuation's positions, from the "
            f"top-{report.top_k} log-probabilities: the tokens both list, the rest one bucket. "
            "Greedy: "
            f"texts identical / ties (hit's top-2 gap < {report.tie_nats:g} nat) / diverged. "
            f"Passkeys: kept of those the hit finds (found by the hit of all probes). Gate: "
            f"{gate.describe()}: {verdict.codec if verdict else 'nothing passes'}"
        ),
    )
    for column in ("codec", "ratio", "KL", "top-1", "greedy", "passkeys", "restored", "gate"):
        table.add_column(column, justify="left" if column == "codec" else "right")
    for c in rows:
        floor = c is run.floor
        passes = None if floor else report.passes(c.codec, gate)
        table.add_row(
            c.codec,
            "-" if floor else f"{c.stored_ratio:.2f}x",
            f"{c.kl:.2g}",
            f"{c.top1:.1%}",
            f"{c.identical}/{c.ties}/{c.diverged}",
            f"{c.kept}/{c.reference_found} ({c.reference_found} of {len(c.probes)})",
            f"{c.restored_fraction:.0%}",
            "-" if passes is None else "pass" if passes else "[red]fail",
        )
    return table
