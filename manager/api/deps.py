"""What routes depend on: the manager's runtime (connections, outbox, kinds, leadership)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from orch_manager.runtime import ManagerRuntime


async def get_runtime(request: Request) -> ManagerRuntime:  # async: sync ones use a thread pool
    runtime: ManagerRuntime = request.app.state.orch
    return runtime


RuntimeDep = Annotated[ManagerRuntime, Depends(get_runtime)]
