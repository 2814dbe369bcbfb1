"""Test fixture: EXO's model download package (only what the tierkv hook reads)."""
