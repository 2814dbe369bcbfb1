"""`tierkv secrets init`: provision a LAN (tokens, data keys, a CA and vault certificates, and the
tierkv.toml fragments that use them; tierkv/provision.py), each file written with mode 0600."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from tierkv.cli import app
from tierkv.cli.errors import fail
from tierkv.cli.usage import NamedArgumentsCommand

secrets_app = typer.Typer(
    help="Provision tokens, data keys and TLS certificates for vaults and engines.",
    no_args_is_help=True,
)
app.add_typer(secrets_app, name="secrets")


@secrets_app.command("init", cls=NamedArgumentsCommand)
def init(
    directory: Annotated[Path, typer.Argument(metavar="DIR", help="A new or empty directory.")],
    tenant: Annotated[
        list[str] | None,
        typer.Option(metavar="NAME", help="A tenant (repeatable): its own token and data key."),
    ] = None,
    tls: Annotated[
        list[str] | None,
        typer.Option(
            metavar="HOST",
            help="A name or address of the vault (repeatable): write a CA and a vault "
            "certificate for them, and turn TLS on in the fragments.",
            show_default="no TLS",
        ),
    ] = None,
    port: Annotated[
        int, typer.Option(min=1, max=65535, metavar="PORT", help="The vault's port.")
    ] = 50051,
) -> None:
    """Write DIR/vault/ (the vault's tokens and tierkv.toml), DIR/NAME/ per tenant (its token,
    data key and an engine's tierkv.toml) and, with --tls, DIR/ca/ and the vault's certificate.
    Copy vault/ to each vault and NAME/ to that tenant's engines; run tierkv in that directory."""
    from tierkv.provision import init_secrets, valid_host
    from tierkv.wire.secrets import valid_tenant

    tenants = tenant or ["default"]
    for name in tenants:
        if not valid_tenant(name) or name in ("vault", "ca"):
            raise fail(
                "secrets", f"--tenant {name!r}: letters, digits, _.- (not ., .., vault, ca)", 2
            )
    if len(set(tenants)) != len(tenants):
        raise fail("secrets", "--tenant: each tenant once", 2)
    for host in tls or []:
        if not valid_host(host):
            raise fail(
                "secrets",
                f"--tls {host!r}: expected a host name or an IP address engines reach the "
                "vault at (not a wildcard such as 0.0.0.0 or ::)",
                2,
            )
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise fail("secrets", f"{directory}: not a new or empty directory", 2)
    try:
        written = init_secrets(directory, tenants, tls or [], port)
    except OSError as exc:
        raise fail("secrets", f"{directory}: {exc.strerror or exc}", 1) from None
    for path in written:
        typer.echo(f"wrote {path} (0600)")
    typer.echo(
        f"next: copy {directory / 'vault'}/ to each vault and run `tierkv vault --config "
        f"tierkv.toml` in it; copy {directory}/NAME/ to that tenant's engines and run tierkv in it"
        + ("" if tls else " (add the vaults to [cluster] in its tierkv.toml)")
    )
