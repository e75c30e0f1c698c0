"""What routes depend on: the app's shared state."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.ext.asyncio import AsyncEngine

from contracts.kinds import KindSpec
from manager.leader import Leadership
from manager.outbox import Outbox
from manager.publisher import Publisher
from manager.settings import ManagerSettings


@dataclass
class AppState:
    settings: ManagerSettings
    engine: AsyncEngine
    publisher: Publisher
    outbox: Outbox
    kinds: dict[str, KindSpec]
    leadership: Leadership


async def get_state(request: Request) -> AppState:  # async: sync ones run in a thread pool
    state: AppState = request.app.state.orch
    return state


StateDep = Annotated[AppState, Depends(get_state)]
