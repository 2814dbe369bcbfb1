"""Test fixture: EXO's `MediaRegion`, where a prompt's image tokens are and what the image was."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class MediaRegion:
    content_hash: str
    start_pos: int
    end_pos: int
