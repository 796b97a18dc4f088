"""Package attributes that import their module on first use (PEP 562), so that importing a
package does not import every library its names need."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from importlib import import_module
from typing import Any


def lazy_attributes(package: str, owners: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package`` that loads each name in ``owners`` from its
    module (name -> module path) when it is first asked for."""

    def __getattr__(name: str) -> Any:
        if name in owners:
            return getattr(import_module(owners[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
