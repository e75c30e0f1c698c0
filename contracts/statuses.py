"""Observer lifecycle statuses, shared by the API, the services and the database."""

from __future__ import annotations

from enum import StrEnum


class ObserverStatus(StrEnum):
    CREATED = "created"
    PROCESSING = "processing"
    ON_DELETING = "on_deleting"
    DELETED = "deleted"
    FAILED = "failed"
