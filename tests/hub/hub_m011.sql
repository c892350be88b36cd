-- A hub file as the code before the one migration list (sqlite-utils' Python migrations)
-- made it: migrations m001 to m011 applied, then a node and a name it claimed; written by
-- `sqlite3 hub.db .dump`. tests/hub/test_schema.py opens it with the code of today.
PRAGMA foreign_keys=OFF;
BEGIN TRANSACTION;
CREATE TABLE IF NOT EXISTS "_sqlite_migrations" (
   "id" INTEGER PRIMARY KEY,
   "migration_set" TEXT,
   "name" TEXT,
   "applied_at" TEXT
);
INSERT INTO _sqlite_migrations VALUES(1,'hub','m001_fleet','2026-12-06 08:57:02.828893+00:00');
INSERT INTO _sqlite_migrations VALUES(2,'hub','m002_desired_state','2026-12-06 08:57:02.830536+00:00');
INSERT INTO _sqlite_migrations VALUES(3,'hub','m003_quota_leases','2026-12-06 08:57:02.833678+00:00');
INSERT INTO _sqlite_migrations VALUES(4,'hub','m004_offload','2026-12-06 08:57:02.835309+00:00');
INSERT INTO _sqlite_migrations VALUES(5,'hub','m005_placement','2026-12-06 08:57:02.837703+00:00');
INSERT INTO _sqlite_migrations VALUES(6,'hub','m006_operators','2026-12-06 08:57:02.838833+00:00');
INSERT INTO _sqlite_migrations VALUES(7,'hub','m007_packages','2026-12-06 08:57:02.840459+00:00');
INSERT INTO _sqlite_migrations VALUES(8,'hub','m008_console','2026-12-06 08:57:02.842226+00:00');
INSERT INTO _sqlite_migrations VALUES(9,'hub','m009_retire_offload_secrets','2026-12-06 08:57:02.842860+00:00');
INSERT INTO _sqlite_migrations VALUES(10,'hub','m010_tenancy','2026-12-06 08:57:02.845111+00:00');
INSERT INTO _sqlite_migrations VALUES(11,'hub','m011_node_certificates','2026-12-06 08:57:02.846795+00:00');
CREATE TABLE IF NOT EXISTS "meta" (
   "key" TEXT PRIMARY KEY,
   "value" TEXT
);
INSERT INTO meta VALUES('desired_serial','41');
CREATE TABLE IF NOT EXISTS "enrollment_tokens" (
   "prefix" TEXT PRIMARY KEY,
   "hash" TEXT NOT NULL,
   "site" TEXT NOT NULL,
   "uses_left" INTEGER NOT NULL,
   "expires_at" REAL NOT NULL,
   "revoked_at" REAL,
   "created_at" REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS "nodes" (
   "id" TEXT PRIMARY KEY,
   "name" TEXT NOT NULL,
   "site" TEXT NOT NULL,
   "labels" TEXT,
   "wg_public_key" TEXT NOT NULL,
   "overlay_address" TEXT NOT NULL,
   "token_prefix" TEXT NOT NULL,
   "token_hash" TEXT NOT NULL,
   "enrolled_with" TEXT,
   "enrolled_at" REAL,
   "last_seen" REAL,
   "versions" TEXT,
   "capacity" TEXT,
   "revoked_at" REAL
, "address" TEXT, "offload_secret" TEXT, "draining" INTEGER);
INSERT INTO nodes VALUES('n1','n1','s','{"tenant": "acme", "private": "true"}','k1','100.64.0.1','p1','h',NULL,NULL,NULL,NULL,NULL,NULL,NULL,NULL,NULL);
CREATE TABLE IF NOT EXISTS "ledger" (
   "event_id" TEXT PRIMARY KEY,
   "node_id" TEXT NOT NULL REFERENCES "nodes"("id"),
   "kind" TEXT NOT NULL,
   "body" TEXT NOT NULL,
   "received_at" REAL NOT NULL
, "account" TEXT, "tokens" INTEGER, "lease_id" TEXT, "at" REAL);
CREATE TABLE IF NOT EXISTS "accounts" (
   "name" TEXT PRIMARY KEY,
   "service_class" TEXT NOT NULL,
   "requests_per_minute" INTEGER,
   "tokens_per_day" INTEGER,
   "created_at" REAL NOT NULL
, "budget_tokens" INTEGER, "budget_period_s" REAL, "tenant" TEXT, "sites" TEXT, "dedicated" INTEGER, "tenancy_at" REAL);
CREATE TABLE IF NOT EXISTS "api_keys" (
   "prefix" TEXT PRIMARY KEY,
   "hash" TEXT NOT NULL,
   "account" TEXT NOT NULL REFERENCES "accounts"("name"),
   "admin" INTEGER NOT NULL,
   "created_at" REAL NOT NULL,
   "revoked_at" REAL
);
CREATE TABLE IF NOT EXISTS "leases" (
   "id" TEXT PRIMARY KEY,
   "account" TEXT NOT NULL REFERENCES "accounts"("name"),
   "node_id" TEXT NOT NULL REFERENCES "nodes"("id"),
   "period_start" REAL NOT NULL,
   "granted" INTEGER NOT NULL,
   "final" INTEGER,
   "expires_at" REAL NOT NULL,
   "created_at" REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS "models" (
   "ref" TEXT PRIMARY KEY,
   "name" TEXT NOT NULL,
   "version" TEXT NOT NULL,
   "sha256" TEXT NOT NULL,
   "size_bytes" INTEGER NOT NULL,
   "format" TEXT NOT NULL,
   "memory_mib" INTEGER NOT NULL,
   "created_at" REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS "deployments" (
   "id" TEXT PRIMARY KEY,
   "model" TEXT NOT NULL REFERENCES "models"("ref"),
   "replicas" INTEGER NOT NULL,
   "service_class" TEXT NOT NULL,
   "isolation" TEXT NOT NULL,
   "constraints" TEXT NOT NULL,
   "created_at" REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS "placements" (
   "deployment_id" TEXT,
   "node_id" TEXT,
   "gpu" INTEGER,
   "created_at" REAL NOT NULL,
   PRIMARY KEY ("deployment_id", "node_id")
);
CREATE TABLE IF NOT EXISTS "operators" (
   "prefix" TEXT PRIMARY KEY,
   "hash" TEXT NOT NULL,
   "name" TEXT NOT NULL,
   "created_at" REAL NOT NULL,
   "revoked_at" REAL
);
CREATE TABLE IF NOT EXISTS "packages" (
   "id" TEXT,
   "version" TEXT,
   "title" TEXT NOT NULL,
   "topic" TEXT NOT NULL,
   "level" TEXT NOT NULL,
   "items" INTEGER NOT NULL,
   "size" INTEGER NOT NULL,
   "digest" TEXT NOT NULL,
   "lineage" TEXT NOT NULL,
   "origin_node" TEXT,
   "created_at" TEXT NOT NULL,
   "received_at" REAL NOT NULL,
   "bundle_sha256" TEXT,
   "bundle_size" INTEGER,
   PRIMARY KEY ("id", "version")
);
CREATE TABLE IF NOT EXISTS "package_copies" (
   "package_id" TEXT,
   "version" TEXT,
   "node_id" TEXT,
   "reported_at" REAL NOT NULL,
   PRIMARY KEY ("package_id", "version", "node_id")
);
CREATE TABLE IF NOT EXISTS "package_seeds" (
   "package_id" TEXT,
   "version" TEXT,
   "site" TEXT,
   "created_at" REAL NOT NULL,
   PRIMARY KEY ("package_id", "version")
);
CREATE TABLE IF NOT EXISTS "console_users" (
   "name" TEXT PRIMARY KEY,
   "hash" TEXT NOT NULL,
   "created_at" REAL NOT NULL,
   "disabled" INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS "console_sessions" (
   "id_hash" TEXT PRIMARY KEY,
   "user" TEXT NOT NULL REFERENCES "console_users"("name"),
   "csrf" TEXT NOT NULL,
   "created_at" REAL NOT NULL,
   "expires_at" REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS "node_samples" (
   "node_id" TEXT,
   "at" REAL,
   "cpu_percent" REAL,
   "memory_used_mib" INTEGER,
   "memory_total_mib" INTEGER,
   "queue_waiting" INTEGER,
   "outbox_lag" INTEGER,
   "models" INTEGER,
   PRIMARY KEY ("node_id", "at")
);
CREATE TABLE IF NOT EXISTS "account_departures" (
   "account" TEXT,
   "node_id" TEXT,
   "at" REAL NOT NULL,
   PRIMARY KEY ("account", "node_id")
);
CREATE TABLE IF NOT EXISTS "node_certificates" (
   "serial" TEXT PRIMARY KEY,
   "node_id" TEXT NOT NULL,
   "ca" TEXT NOT NULL,
   "names" TEXT NOT NULL,
   "issued_at" REAL NOT NULL,
   "not_after" REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS "node_names" (
   "name" TEXT PRIMARY KEY,
   "node_id" TEXT NOT NULL,
   "until" REAL NOT NULL
);
INSERT INTO node_names VALUES('Lab.Local','n1',1.0);
CREATE UNIQUE INDEX "idx__sqlite_migrations_migration_set_name"
    ON "_sqlite_migrations" ("migration_set", "name");
CREATE UNIQUE INDEX "idx_nodes_overlay_address"
    ON "nodes" ("overlay_address");
CREATE UNIQUE INDEX "idx_nodes_wg_public_key"
    ON "nodes" ("wg_public_key");
CREATE UNIQUE INDEX "idx_nodes_token_prefix"
    ON "nodes" ("token_prefix");
CREATE INDEX "idx_ledger_node_id_received_at"
    ON "ledger" ("node_id", "received_at");
CREATE INDEX "idx_ledger_account_at"
    ON "ledger" ("account", "at");
CREATE INDEX "idx_ledger_lease_id"
    ON "ledger" ("lease_id");
CREATE INDEX "idx_leases_account_period_start"
    ON "leases" ("account", "period_start");
CREATE INDEX "idx_console_sessions_expires_at"
    ON "console_sessions" ("expires_at");
CREATE INDEX "idx_node_samples_at"
    ON "node_samples" ("at");
CREATE INDEX "idx_node_certificates_node_id_not_after"
    ON "node_certificates" ("node_id", "not_after");
CREATE INDEX "idx_node_names_node_id"
    ON "node_names" ("node_id");
COMMIT;
