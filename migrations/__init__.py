"""Alembic migrations of the orchestrator's schema (applied by ``orch migrate``)."""

from __future__ import annotations

from pathlib import Path

from alembic.config import Config

HERE = Path(__file__).resolve().parent


def alembic_config(database_url: str) -> Config:
    """An Alembic config for this package's scripts and the given database."""
    cfg = Config()
    cfg.set_main_option("script_location", str(HERE))
    cfg.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    return cfg
