"""Test fixture: the runner entry point with the shape of EXO's `exo.worker.runner.bootstrap`.

EXO starts each runner in a spawned interpreter with `entrypoint(bound_instance, ...)`;
`bound_instance.bound_shard` describes the model and the layers/heads this runner holds. Here the
entry point runs `bound_instance.work()` in place of EXO's runner loop. `logger` stands for EXO's
loguru logger, which its modules (cache.py) import from here.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("exo")


def entrypoint(
    bound_instance: Any,
    event_sender: Any,
    task_receiver: Any,
    cancel_receiver: Any,
    _logger: Any,
) -> Any:
    return bound_instance.work()
