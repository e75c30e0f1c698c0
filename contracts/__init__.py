"""What the manager and the observer services agree on: tables, messages, statuses, topology."""

#: This release (the package's version: pyproject reads it from here). A literal, so that
#: ``orch --version`` needs no package metadata (reading it took a tenth of a second).
__version__ = "0.2.0"
