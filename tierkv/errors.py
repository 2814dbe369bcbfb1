"""TierKVError: the root of the errors that reach a person (configuration, start-up, status,
install, bench), which the CLI turns into one line naming the bad thing and a non-zero exit.

The data path has errors of its own (bulk frames, payloads, seals) that never reach a person:
there a failure is a miss and a recompute, never an exception out of tierkv.
"""


class TierKVError(Exception):
    """Something tierkv was asked to do cannot be done as asked; the message says what."""
