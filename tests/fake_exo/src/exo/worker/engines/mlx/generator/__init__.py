"""Test fixture: a small package shaped like EXO (exo-explore/exo), written for tierkv tests."""
