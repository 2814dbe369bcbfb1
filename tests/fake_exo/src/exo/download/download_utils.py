"""Test fixture: EXO's `build_model_path`, over the folder $FAKE_EXO_MODELS_DIR.

EXO keeps each model's files in a folder of its models directory named after the model id with
"/" written as "--"; the fixture does the same under a folder the test chooses.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def build_model_path(model_id: Any) -> Path:
    return Path(os.environ["FAKE_EXO_MODELS_DIR"]) / str(model_id).replace("/", "--")
