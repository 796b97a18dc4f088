"""How big this run's campaigns are: ``make test`` runs each campaign's real-service part,
``make test-long`` sets ``ONCEKIT_FULL_SIZE=1`` and runs every campaign in full (the tests marked
``full_size`` too, and the larger fault lists of the others)."""

from __future__ import annotations

import os

FULL_SIZE_ENV = "ONCEKIT_FULL_SIZE"


def full_size() -> bool:
    """Whether this run sizes its campaigns in full (``make test-long``)."""
    return os.environ.get(FULL_SIZE_ENV) == "1"
