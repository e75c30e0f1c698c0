"""``orch verify``: a seeded fault campaign over a throw-away local cluster running the user's
kinds, judged from the witness the services write (``contracts/witness.py``)."""
