"""Keeping secrets out of text: client settings and connection strings as logs and reprs show them.

Every ``repr``, log line and error message that could carry a client configuration or a DSN goes
through these two functions.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

REDACTED = "***"

# Client settings whose value is a secret, in librdkafka's and psycopg's vocabularies.
_SECRET_KEY = re.compile(r"password|secret|jaas|token|sasl\.oauthbearer\.config|ssl\.key\.pem", re.I)
_DSN_URL_PASSWORD = re.compile(r"(://[^:/@\s]*:)([^@\s]*)(@)")
_DSN_KV_PASSWORD = re.compile(r"(password\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)", re.I)


def redact_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a client configuration with every secret value replaced, for logs and reprs."""
    return {key: (REDACTED if _SECRET_KEY.search(key) else value) for key, value in config.items()}


def redact_dsn(dsn: str) -> str:
    """A PostgreSQL connection string (URL or key=value form) with its password replaced."""
    return _DSN_KV_PASSWORD.sub(rf"\g<1>{REDACTED}", _DSN_URL_PASSWORD.sub(rf"\g<1>{REDACTED}\g<3>", dsn))


def split_dsn_password(dsn: str) -> tuple[str, str | None]:
    """``dsn`` with its password replaced as :func:`redact_dsn` does, and the password; the
    PostgreSQL sinks hand Spark the two as separate options, since Spark hides an option's value
    in its plans and UI when the option's key names a secret (``spark.redaction.regex``), and
    never a password inside a connection string. :func:`join_dsn_password` gives back ``dsn``."""
    for pattern in (_DSN_URL_PASSWORD, _DSN_KV_PASSWORD):
        found = pattern.search(dsn)
        if found:
            return dsn[:found.start(2)] + REDACTED + dsn[found.end(2):], found.group(2)
    return dsn, None


def join_dsn_password(dsn: str, password: str | None) -> str:
    """The reverse of :func:`split_dsn_password`."""
    if password is None:
        return dsn
    for pattern in (_DSN_URL_PASSWORD, _DSN_KV_PASSWORD):
        found = pattern.search(dsn)
        if found and found.group(2) == REDACTED:
            return dsn[:found.start(2)] + password + dsn[found.end(2):]
    return dsn
