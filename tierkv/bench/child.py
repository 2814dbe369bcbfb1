"""The engine process's entry point: `python -m tierkv.bench.child RUN REQUEST RESULT` runs
`RUNS[RUN]` with the JSON arguments in the file REQUEST and writes its JSON result to RESULT
(see `tierkv.bench.engine_process.in_engine_process`, which starts it)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tierkv.bench.engines import vllm_bench_in_this_process
from tierkv.bench.eval import eval_in_this_process

RUNS: dict[str, Callable[..., Any]] = {
    "bench": vllm_bench_in_this_process,
    "eval": eval_in_this_process,
}


def main(run: str, request: Path, result: Path) -> None:
    """Run `RUNS[run]` on the arguments in `request`; its result as JSON in `result`."""
    result.write_text(json.dumps(RUNS[run](**json.loads(request.read_text()))))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))
