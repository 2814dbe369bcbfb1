"""The errors that reach a person share one root, keep their builtin bases, and never leave the
CLI as a traceback."""

from __future__ import annotations

import sys

import pytest

import tierkv.cli.status
from tierkv.__main__ import main
from tierkv.backends.base import BackendUnavailable
from tierkv.backends.vault import VaultRefused
from tierkv.cli.errors import TRACEBACK_ENV
from tierkv.config import ConfigError
from tierkv.connectors.vllm.groups import UnsupportedGroupError
from tierkv.errors import TierKVError
from tierkv.patches.exo import ExoLayoutError, ExoPathError
from tierkv.vault.disk import DiskLockedError
from tierkv.vault.server import VaultBindError


@pytest.mark.parametrize(
    ("error", "builtin"),
    [
        (ConfigError, ValueError),
        (BackendUnavailable, RuntimeError),
        (VaultRefused, RuntimeError),
        (VaultBindError, OSError),
        (DiskLockedError, RuntimeError),
        (ExoLayoutError, ValueError),
        (ExoPathError, ValueError),
        (UnsupportedGroupError, ValueError),
    ],
)
def test_management_errors_have_one_root_and_keep_their_builtin_base(
    error: type[Exception], builtin: type[Exception]
) -> None:
    assert issubclass(error, TierKVError) and issubclass(error, builtin)


def test_an_error_that_leaves_a_command_is_one_line_and_exit_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def unanswered(*args: object) -> None:
        raise BackendUnavailable("vault at 127.0.0.1:9 did not answer")

    monkeypatch.setattr(tierkv.cli.status, "check_vaults", unanswered)
    monkeypatch.setattr(sys, "argv", ["tierkv", "status", "--vault", "127.0.0.1:9"])
    with pytest.raises(SystemExit) as exited:
        main()
    assert exited.value.code == 1
    assert capsys.readouterr().err == "tierkv status: vault at 127.0.0.1:9 did not answer\n"


def test_an_error_tierkv_did_not_expect_is_one_line_exit_1_unless_a_traceback_is_asked(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken(*args: object) -> None:
        raise KeyError("oops")

    monkeypatch.setattr(tierkv.cli.status, "check_vaults", broken)
    monkeypatch.setattr(sys, "argv", ["tierkv", "status", "--vault", "127.0.0.1:9"])
    with pytest.raises(SystemExit) as exited:
        main()
    assert exited.value.code == 1
    err = capsys.readouterr().err
    assert err == f"tierkv status: unexpected KeyError: 'oops' ({TRACEBACK_ENV}=1 shows where)\n"
    monkeypatch.setenv(TRACEBACK_ENV, "1")
    with pytest.raises(KeyError):
        main()


def test_a_configuration_error_leaving_a_command_is_exit_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def misconfigured(*args: object) -> None:
        raise ConfigError("tierkv.toml: cluster.kv_cold: expected host:port")

    monkeypatch.setattr(tierkv.cli.status, "check_vaults", misconfigured)
    monkeypatch.setattr(sys, "argv", ["tierkv", "status", "--vault", "127.0.0.1:9"])
    with pytest.raises(SystemExit) as exited:
        main()
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "tierkv status: tierkv.toml: cluster.kv_cold: expected host:port"
    ]
