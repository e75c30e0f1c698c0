"""Where a running copy came from, and so how its start message is settled.

- ``Queued(delivery)``: a work-queue delivery, held unacked while the copy runs. If the service
  dies, the broker hands the message to another service at once.
- ``Directed``: no delivery behind the copy: a directed start from the leader, or a delivery
  whose broker session closed while the copy went on (the broker requeued that message; it
  reaches some service, which drops it as a duplicate, or reaches us and is adopted).

A delivery whose session has closed settles nothing, so a ``Queued`` copy whose session is gone
behaves as ``Directed``: what cannot be settled on the delivery is published anew (a start to
the work queue, or to the error queue). A duplicate message that this may leave is dropped by the
take rule; a lost one would strand an observer.
"""

from __future__ import annotations

from dataclasses import dataclass

from observer_service.ports import Delivery


class Directed:
    """No delivery: every settlement but an ack publishes anew."""

    live = False

    async def ack(self) -> bool:
        return True

    async def requeue(self) -> bool:
        return False

    async def reject(self) -> bool:
        return False

    def __repr__(self) -> str:
        return "Directed()"


DIRECTED = Directed()


@dataclass(frozen=True)
class Queued:
    delivery: Delivery

    @property
    def live(self) -> bool:
        """Its session is open: the delivery is still ours to settle."""
        return self.delivery.live

    async def ack(self) -> bool:
        return await self.delivery.ack()

    async def requeue(self) -> bool:
        return await self.delivery.requeue()

    async def reject(self) -> bool:
        return await self.delivery.reject()


Origin = Queued | Directed
