"""Runs the scenarios with a progress bar each, prints one table and writes the same as JSON."""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
import os
import platform
import shutil
import subprocess
from pathlib import Path
from typing import Any

import asyncpg
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from orch_bench.harness import Bench, Figure
from orch_bench.scenarios import FULL, FULL_ONLY, QUICK, SCENARIOS
from orch_contracts.settings import CommonSettings, asyncpg_dsn, on_database


async def run(
    settings: CommonSettings,
    *,
    quick: bool,
    only: list[str] | None,
    json_path: Path | None,
    console: Console,
) -> list[Figure]:
    size = QUICK if quick else FULL
    bench = Bench(settings, lease_ttl=settings.lease_ttl)
    logging.getLogger().setLevel(logging.WARNING)
    await bench.prepare()
    figures: list[Figure] = []
    started = datetime.datetime.now(datetime.UTC)
    load_before = [round(x, 2) for x in os.getloadavg()]  # the machine's own noise, 1/5/15 min
    try:
        with Progress(
            TextColumn("{task.description:<12}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
        ) as progress:
            for name, (scenario, total) in SCENARIOS.items():
                if only and name not in only:
                    continue
                if quick and not only and name in FULL_ONLY:
                    continue
                task = progress.add_task(name, total=total(size))

                def tick(advance: int = 1, task: Any = task) -> None:
                    progress.update(task, advance=advance)

                try:
                    figures += await scenario(bench, size, tick)
                except Exception as exc:
                    figures.append(Figure(name, "scenario failed", None, "", note=repr(exc)[:300]))
                progress.update(task, completed=total(size))
    finally:
        await bench.cleanup()
        shutil.rmtree(bench.workdir, ignore_errors=True)
    console.print(table(figures, quick=quick))
    if json_path is not None:
        pg = await _postgres_version(settings)
        report = {
            "date": started.isoformat(timespec="seconds"),
            "quick": quick,
            "lease_ttl": settings.lease_ttl,
            "load_average_before": load_before,
            "machine": await asyncio.to_thread(machine, pg),
            "figures": [f.as_dict() for f in figures],
        }
        await asyncio.to_thread(json_path.write_text, json.dumps(report, indent=2) + "\n")
        console.print(f"written to {json_path}")
    return figures


def table(figures: list[Figure], *, quick: bool) -> Table:
    t = Table(title=f"orch bench{' --quick' if quick else ''}")
    for col in ("scenario", "figure", "value", "target", ""):
        t.add_column(col)
    for f in figures:
        value = "n/a" if f.value is None else f"{f.value:g} {f.unit}".strip()
        mark = {True: "[green]pass[/green]", False: "[red]miss[/red]", None: ""}[f.passed]
        t.add_row(f.scenario, f.name + (f" ({f.note})" if f.note else ""), value, f.target, mark)
    return t


async def _postgres_version(settings: CommonSettings) -> str:
    conn = await asyncpg.connect(asyncpg_dsn(on_database(settings.database_url, "postgres")))
    try:
        return str(await conn.fetchval("SHOW server_version"))
    finally:
        await conn.close()


def machine(postgres: str) -> dict[str, Any]:
    try:
        mq = subprocess.run(
            ["rabbitmqctl", "version"], capture_output=True, text=True, timeout=30
        ).stdout.strip()
    except OSError:
        mq = "unknown"
    mem = next(
        (
            line.split()[1]
            for line in Path("/proc/meminfo").read_text().splitlines()
            if line.startswith("MemTotal:")
        ),
        "0",
    )
    return {
        "cpus": os.cpu_count(),
        "memory_gib": round(int(mem) / 2**20, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "postgres": postgres,
        "rabbitmq": mq,
    }


def main(
    settings: CommonSettings, *, quick: bool, only: list[str] | None, json_path: Path | None
) -> int:
    console = Console()
    figures = asyncio.run(
        run(settings, quick=quick, only=only, json_path=json_path, console=console)
    )
    return 1 if any(f.name == "scenario failed" for f in figures) else 0
