"""What the manager and the observer services agree on: tables, messages, statuses, topology."""
