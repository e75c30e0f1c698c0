"""The ``orch`` command line: migrate, run a manager or a service, run a local cluster."""
