"""The appliance's one SQLite database: migrations and the store (the only module with SQL)."""
