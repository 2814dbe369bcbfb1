"""tierkv's vLLM connector against the newest vLLM wheel the `vllm` extra allows, read without
installing or importing it (tests/vllm_api.py), and the check's own failures.

The wheel (about 340 MB) is downloaded once into ~/.cache/tierkv/wheels. When it cannot be
downloaded the test fails in CI (`CI` set) and is skipped with the reason elsewhere.
"""

from __future__ import annotations

import ast
import os
import zipfile
from pathlib import Path

import pytest

from tests import vllm_api


@pytest.fixture(scope="module")
def newest_wheel() -> Path:
    requirement = vllm_api.vllm_requirement()
    try:
        return vllm_api.newest_wheel(requirement)
    except vllm_api.WheelUnavailable as exc:
        if os.environ.get("CI"):
            pytest.fail(f"the vLLM API check cannot run: {exc}")
        pytest.skip(str(exc))


def connector_source() -> str:
    return (vllm_api.CONNECTOR_DIR / "connector.py").read_text()


def test_connector_matches_the_newest_allowed_vllm(newest_wheel: Path):
    print(f"checked against {newest_wheel.name}")
    assert vllm_api.check_wheel(newest_wheel) == []


def with_extra_parameter(source: str, class_name: str, method: str) -> str:
    """`source` with a required parameter `extra` added to class_name.method."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == method:
                    item.args.args.append(ast.arg("extra"))
                    item.args.defaults = []
                    return ast.unparse(tree)
    raise LookupError(f"{class_name}.{method} not found")


def test_a_changed_signature_in_the_wheel_fails_naming_the_method(newest_wheel: Path):
    with zipfile.ZipFile(newest_wheel) as wheel:
        base = wheel.read(vllm_api.BASE_MODULE).decode()
    changed = with_extra_parameter(base, "KVConnectorBase_V1", "get_num_new_matched_tokens")
    problems = vllm_api.connector_drift(changed, connector_source(), "vllm changed")
    assert problems == [
        "vllm changed: TierKVConnector.get_num_new_matched_tokens is the method "
        "get_num_new_matched_tokens(self, request, num_computed_tokens), but KVConnectorBase_V1 "
        "has the method get_num_new_matched_tokens(self, request, num_computed_tokens, extra)"
    ]


def base_like_ours() -> str:
    """A KVConnectorBase_V1 with exactly TierKVConnector's methods (and an empty SupportsHMA)."""
    tree = ast.parse(connector_source())
    (ours,) = (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TierKVConnector")
    ours.name, ours.bases = "KVConnectorBase_V1", []
    for item in ours.body:
        if isinstance(item, ast.FunctionDef):
            item.body = [ast.Expr(ast.Constant(...))]
    return ast.unparse(ours) + "\nclass SupportsHMA:\n    pass\n"


def test_every_kind_of_drift_is_named_without_a_download():
    base = base_like_ours()
    assert vllm_api.connector_drift(base, connector_source(), "v") == []

    changed = base.replace("def restore_kv_caches(self)", "def restore_kv_caches(self, *, tags)")
    changed = changed.replace("def reset_cache(", "def reset_caches(")
    changed = changed.replace(
        "    def shutdown(",
        "    @abstractmethod\n    def finish_forward(self): ...\n    def shutdown(",
    )
    changed = changed.replace(
        "@classmethod\n    def supports_sleep_mode", "@staticmethod\n    def supports_sleep_mode"
    )
    assert sorted(vllm_api.connector_drift(changed, connector_source(), "v")) == [
        "v: TierKVConnector.reset_cache overrides nothing: the base classes have no reset_cache "
        "(renamed or removed?)",
        "v: TierKVConnector.restore_kv_caches is the method restore_kv_caches(self), but "
        "KVConnectorBase_V1 has the method restore_kv_caches(self, *, tags)",
        "v: TierKVConnector.supports_sleep_mode is the classmethod "
        "supports_sleep_mode(cls, kv_transfer_config), but KVConnectorBase_V1 has the "
        "staticmethod supports_sleep_mode(cls, kv_transfer_config)",
        "v: abstract method KVConnectorBase_V1.finish_forward(self) is not defined by "
        "TierKVConnector",
    ]


def test_a_moved_import_is_named(tmp_path: Path):
    wheel_path = tmp_path / "vllm-9.9.9-py3-none-any.whl"
    with zipfile.ZipFile(wheel_path, "w") as wheel:
        wheel.writestr("vllm/__init__.py", "from .version import __version__\n")
        wheel.writestr("vllm/v1/core/kv_cache_utils.py", "def get_block_hash(h): ...\n")
    sources = {"scheduler.py": "from vllm.v1.core.kv_cache_utils import get_block_hash, gone\n"}
    sources["groups.py"] = "from vllm import __version__\nfrom vllm.moved import Thing\n"
    with zipfile.ZipFile(wheel_path) as wheel:
        assert vllm_api.import_drift(wheel, "v", sources) == [
            "v: vllm.v1.core.kv_cache_utils has no gone (imported by scheduler.py)",
            "v: module vllm.moved (imported by groups.py) is gone",
        ]
