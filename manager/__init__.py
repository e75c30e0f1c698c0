"""Manager: the HTTP API over Postgres, and the background loops one elected replica runs."""
