"""The error tree of oncekit: one root class, one subclass per kind of failure.

Every error oncekit raises derives from :class:`OncekitError`, so a caller can catch the
kit's failures apart from Spark's and the clients'. Messages name what failed and where
(service, sink, batch, partition, column or offset) and never carry a secret.
"""

from __future__ import annotations


class OncekitError(Exception):
    """Root of every error oncekit raises."""


class ConfigError(OncekitError):
    """A setting is missing, malformed or contradicts another; the message says what to fix."""


class ServiceError(OncekitError):
    """An external service (Kafka, PostgreSQL, the container engine) could not be started,
    reached or controlled; the message says in one line what is missing."""
