"""The hub's schema: one list of migrations, `MIGRATIONS`, that SQLite and PostgreSQL both
run (hub.state.sql), in order, each once. Append-only: never edit, reorder or remove one;
add one at the end of the last module.

Each migration is written once (`hub.state.sql.Migration`): its SQL runs on both, with
`{int}` and `{real}` for the column types the two name differently (SQLite's INTEGER and
REAL, PostgreSQL's BIGINT and DOUBLE PRECISION), and a branch of its own for a database
only where the SQL itself differs (m015 reads JSON). An index is named as sqlite-utils
named the first ones, `idx_<table>_<columns>`.

The modules split the list by era, to keep each short; the list is the one below. Where a
database records what it applied, by name: SQLite in sqlite-utils' `_sqlite_migrations`
under the set `MIGRATION_SET` (the hub's first migrations were sqlite-utils' own, and every
file keeps their records there), PostgreSQL in `schema_migrations`.
"""

from __future__ import annotations

from hub.state.migrations import from_m001, from_m006, from_m012

MIGRATIONS = (*from_m001.MIGRATIONS, *from_m006.MIGRATIONS, *from_m012.MIGRATIONS)

MIGRATION_SET = "hub"
