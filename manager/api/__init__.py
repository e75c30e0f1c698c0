"""HTTP routes; thin: validation here, data access in manager.repository."""
