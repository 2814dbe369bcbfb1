"""Deterministic long prompts for the engine benches and the eval: varied English-like text of a
chosen length, the same for the same seed."""

from __future__ import annotations

import random

_SUBJECTS = [
    "the vault",
    "a cold tier",
    "the engine",
    "every block",
    "the scheduler",
    "our cache",
    "the prefix",
    "a worker",
    "the network",
    "this request",
    "the model",
    "each layer",
]
_VERBS = [
    "keeps",
    "restores",
    "evicts",
    "compresses",
    "ships",
    "checks",
    "streams",
    "decodes",
    "counts",
    "promotes",
    "measures",
    "writes",
]
_OBJECTS = [
    "key value blocks",
    "the longest prefix",
    "a compact payload",
    "every checksum",
    "the paged buffer",
    "its byte budget",
    "stale entries",
    "the hit length",
    "a random rotation",
    "the codebook indices",
    "recent tokens",
    "the linear state",
]
_TAILS = [
    "before the next step",
    "without blocking",
    "over the local network",
    "in one round trip",
    "when memory runs short",
    "while the GPU keeps working",
    "for the next user",
    "at a fraction of the cost",
    "under a strict deadline",
    "after a restart",
]


def long_prompt(words: int, seed: int = 0) -> str:
    """A long, varied, deterministic English-like text of about `words` words (no repeated loop)."""
    rng = random.Random(seed)
    sentences: list[str] = []
    count = 0
    while count < words:
        sentence = (
            f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} "
            f"{rng.choice(_TAILS)}, number {rng.randrange(10_000)}."
        )
        sentences.append(sentence[0].upper() + sentence[1:])
        count += len(sentence.split())
    return " ".join(sentences)
