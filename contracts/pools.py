"""Pools: a service joins one, an observer names one, and it runs only on services of its pool
(a region, an exchange that whitelists source addresses, a host with a hardware token, a new
release tried on a few observers first). Each pool has a work queue of its own on the broker,
so a service never receives a start of another pool."""

from __future__ import annotations

import re

#: The pool of a service that names none, of an observer created without one, and of every
#: service and observer of a release before pools.
DEFAULT_POOL = "default"
#: What a pool name may be: it becomes part of a queue name.
POOL_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,62}$"
_POOL = re.compile(POOL_PATTERN)


def check_pool(name: str) -> str:
    """``name`` if it may name a pool, else ValueError saying what a pool name is."""
    if not _POOL.fullmatch(name):
        raise ValueError(
            "a pool name is 1 to 63 lowercase letters, digits, '-' or '_', starting with a "
            "letter or digit"
        )
    return name
