"""``orch bench``: measures the orchestrator against its targets on this machine."""
