"""Test fixture helpers: an EXO-shaped package and a fake EXO checkout with a venv."""
