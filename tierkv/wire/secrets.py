"""Secret files as both ends of a vault connection read them: the token file's format, the
rule that a secret file is private to its owner, and the `[security]` TLS files.

Tokens come from `[security] token_file` (one per line: `TOKEN`, or `TENANT TOKEN`; `#` starts a
comment) or, when no file is configured, the `TIERKV_TOKEN` environment variable; never from a
command line.
"""

from __future__ import annotations

import re
import ssl
import stat
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from tierkv.config import ConfigError, SecurityConfig

T = TypeVar("T")

TOKEN_ENV = "TIERKV_TOKEN"
MIN_TOKEN_CHARS = 16
TENANT_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
"""Letters, digits, _.- (so no path separator); `valid_tenant` also refuses "." and ".."."""


def check_private_file(path: str | Path, setting: str) -> None:
    """ConfigError when the secret file `path` (of `setting`) is open to group or others:
    refused rather than warned about, since a warning does not stop a local user reading it."""
    try:
        mode = Path(path).stat().st_mode
    except OSError:
        return  # reading it reports what is wrong
    if mode & 0o077:
        raise ConfigError(
            f"{setting} {path}: open to group or others (mode {mode & 0o777:04o}); "
            f"run chmod 600 {path}"
        )


def make_private_dir(directory: Path) -> None:
    """Create `directory` (and its parents) where needed, and make it 0700 whatever the umask
    (also one that was open before): what it holds is its owner's alone."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    if stat.S_IMODE(directory.stat().st_mode) != 0o700:
        directory.chmod(0o700)


def refuse_unpaired_tls(security: SecurityConfig) -> None:
    """ConfigError when a TLS certificate is configured without its key, or a key without its
    certificate (either end would start without the TLS it was given)."""
    if security.tls_cert and not security.tls_key:
        raise ConfigError("security.tls_cert needs security.tls_key (the certificate's key)")
    if security.tls_key and not security.tls_cert:
        raise ConfigError("security.tls_key needs security.tls_cert (the key's certificate)")


def check_secret_files(security: SecurityConfig) -> None:
    """ConfigError naming the first secret file of `security` (token file, TLS key, data key
    file) that group or others may read."""
    for setting, path in (
        ("security.token_file", security.token_file),
        ("security.tls_key", security.tls_key),
        ("security.data_key_file", security.data_key_file),
    ):
        if path:
            check_private_file(path, setting)


def valid_tenant(name: str) -> bool:
    """Whether `name` may name a tenant: TENANT_RE, and neither "." nor ".." (a tenant's name
    is a directory's in `tierkv secrets init` and a namespace prefix in the vault)."""
    return bool(TENANT_RE.match(name)) and name not in (".", "..")


def read_token_file(path: str | Path) -> list[tuple[str, str]]:
    """(tenant, token) of each line of a token file; ConfigError naming the file and line (or
    its mode, when others may read it)."""
    check_private_file(path, "security.token_file")
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"security.token_file {path}: cannot read: {exc}") from None
    entries = []
    for number, line in enumerate(lines, 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        if len(fields) > 2 or (len(fields) == 2 and not valid_tenant(fields[0])):
            raise ConfigError(
                f"{path}:{number}: expected TOKEN or TENANT TOKEN (tenant: letters, digits, _.-;"
                " not . or ..)"
            )
        tenant, token = (fields[0], fields[1]) if len(fields) == 2 else ("default", fields[0])
        if len(token) < MIN_TOKEN_CHARS:
            raise ConfigError(f"{path}:{number}: a token needs at least {MIN_TOKEN_CHARS} chars")
        entries.append((tenant, token))
    if not entries:
        raise ConfigError(f"security.token_file {path}: no token in it")
    return entries


def read_secret(path: str) -> bytes:
    """The bytes of a `[security]` file; ConfigError naming it when it cannot be read."""
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from None


def load_tls_files(files: str, load: Callable[[], T]) -> T:
    """`load()` of the TLS files `files` (their settings and paths, e.g. "security.tls_ca
    ca.pem"); ConfigError naming them when they cannot be read or are not usable PEM."""
    try:
        return load()
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"{files}: not a usable PEM file ({exc})") from None
