"""tierkv's loggers: one per module, named after it, every line starting "tierkv: ".

The prefix is added here, once: engines log into one stream with their own format (vLLM shows
the file, not the logger's name), and a library adds no handlers, so the name alone may not
show. `log = get_logger(__name__)` in each module that logs.
"""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from typing import Any

PREFIX = "tierkv: "


class _Prefixed(logging.LoggerAdapter[logging.Logger]):
    def process(
        self, msg: Any, kwargs: MutableMapping[str, Any]
    ) -> tuple[Any, MutableMapping[str, Any]]:
        return f"{PREFIX}{msg}", kwargs


def get_logger(name: str) -> logging.LoggerAdapter[logging.Logger]:
    """The logger `name` (a module's `__name__`), its messages prefixed "tierkv: "."""
    return _Prefixed(logging.getLogger(name), {})
