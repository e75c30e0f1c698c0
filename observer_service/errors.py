"""Why an observer stops other than by its own error. These are BaseExceptions so that kind code
catching ``Exception`` cannot swallow them, and the restart policy never retries them."""

from __future__ import annotations


class Fenced(BaseException):
    """A write carried a stale epoch: another service has taken this observer. Stop at once."""


class LeaseLost(BaseException):
    """This service's lease is no longer surely valid: it must assume others took its observers."""
