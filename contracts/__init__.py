"""What the manager and the observer services agree on: tables, messages, statuses, topology."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("observer-orchestrator")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0+unknown"
