"""How long to wait before the next try: one shape for every retry loop of both sides."""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass
class Backoff:
    """``first`` seconds, doubling up to ``cap``, each with up to ``jitter`` of it added at
    random (so that many processes that failed together do not retry together).
    ``reset()`` after a success."""

    first: float
    cap: float
    jitter: float = 0.0
    _next: float = field(default=0.0, init=False)

    def next(self) -> float:
        """The wait before the next try."""
        self._next = self.first if self._next == 0.0 else min(self.cap, self._next * 2)
        return self._next * (1.0 + random.uniform(0.0, self.jitter))

    def reset(self) -> None:
        self._next = 0.0
