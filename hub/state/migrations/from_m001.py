"""m001 to m005: the fleet, its desired state, quota leases, offload and placement."""

from __future__ import annotations

from hub.state.sql import Migration

MIGRATIONS = (
    Migration(
        "m001_fleet",
        """
        CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT);
        CREATE TABLE enrollment_tokens (
            prefix TEXT PRIMARY KEY,
            hash TEXT NOT NULL,
            site TEXT NOT NULL,
            uses_left {int} NOT NULL,
            expires_at {real} NOT NULL, -- unix seconds
            revoked_at {real},
            created_at {real} NOT NULL
        );
        CREATE TABLE nodes (
            id TEXT PRIMARY KEY,
            name TEXT NOT NULL,
            site TEXT NOT NULL,
            labels TEXT, -- JSON object
            wg_public_key TEXT NOT NULL,
            overlay_address TEXT NOT NULL,
            token_prefix TEXT NOT NULL,
            token_hash TEXT NOT NULL,
            enrolled_with TEXT, -- the enrollment token's prefix
            enrolled_at {real},
            last_seen {real},
            versions TEXT, -- JSON object
            capacity TEXT, -- JSON object, the last heartbeat's
            revoked_at {real}
        );
        CREATE UNIQUE INDEX idx_nodes_overlay_address ON nodes (overlay_address);
        CREATE UNIQUE INDEX idx_nodes_wg_public_key ON nodes (wg_public_key);
        CREATE UNIQUE INDEX idx_nodes_token_prefix ON nodes (token_prefix);
        -- The ledger: unique on the event id, so a resend is harmless.
        CREATE TABLE ledger (
            event_id TEXT PRIMARY KEY,
            node_id TEXT NOT NULL REFERENCES nodes (id),
            kind TEXT NOT NULL,
            body TEXT NOT NULL,
            received_at {real} NOT NULL
        );
        CREATE INDEX idx_ledger_node_id_received_at ON ledger (node_id, received_at);
        """,
    ),
    # Accounts and their API keys are managed on the hub and pushed to every node with a
    # serial that grows with each change (meta key `desired_serial`).
    Migration(
        "m002_desired_state",
        """
        CREATE TABLE accounts (
            name TEXT PRIMARY KEY,
            service_class TEXT NOT NULL,
            requests_per_minute {int}, -- NULL: the class's default
            tokens_per_day {int},
            created_at {real} NOT NULL
        );
        CREATE TABLE api_keys (
            prefix TEXT PRIMARY KEY,
            hash TEXT NOT NULL,
            account TEXT NOT NULL REFERENCES accounts (name),
            admin {int} NOT NULL,
            created_at {real} NOT NULL,
            revoked_at {real}
        );
        """,
    ),
    # A global budget per account (tokens per period), spent by nodes through leases. The
    # ledger's usage events, decoded once at ingest: whose tokens, how many, when (`at`,
    # when the node served it), and under which lease, so budgets are summed in SQL.
    Migration(
        "m003_quota_leases",
        """
        ALTER TABLE accounts ADD COLUMN budget_tokens {int}; -- NULL: no global budget
        ALTER TABLE accounts ADD COLUMN budget_period_s {real};
        ALTER TABLE ledger ADD COLUMN account TEXT;
        ALTER TABLE ledger ADD COLUMN tokens {int};
        ALTER TABLE ledger ADD COLUMN lease_id TEXT;
        ALTER TABLE ledger ADD COLUMN at {real};
        CREATE INDEX idx_ledger_account_at ON ledger (account, at);
        CREATE INDEX idx_ledger_lease_id ON ledger (lease_id);
        CREATE TABLE leases (
            id TEXT PRIMARY KEY,
            account TEXT NOT NULL REFERENCES accounts (name),
            node_id TEXT NOT NULL REFERENCES nodes (id),
            period_start {real} NOT NULL,
            granted {int} NOT NULL,
            final {int}, -- the node's final spend once reported; NULL while it may spend
            expires_at {real} NOT NULL,
            created_at {real} NOT NULL
        );
        CREATE INDEX idx_leases_account_period_start ON leases (account, period_start);
        """,
    ),
    # Where a node's LAN API answers the hub (the address its heartbeats come from: its
    # overlay address through the tunnel), and the secret the hub shows it when it hands
    # the node a request another node offloaded (sent to the node in its desired state).
    Migration(
        "m004_offload",
        """
        ALTER TABLE nodes ADD COLUMN address TEXT;
        ALTER TABLE nodes ADD COLUMN offload_secret TEXT;
        """,
    ),
    # Model artifacts the hub serves to nodes (content-addressed in the data directory);
    # what should run (a model, how many replicas across the fleet, under which
    # constraints); and where each replica runs: the planner's last answer, applied by the
    # reconciler.
    Migration(
        "m005_placement",
        """
        CREATE TABLE models (
            ref TEXT PRIMARY KEY, -- name@version
            name TEXT NOT NULL,
            version TEXT NOT NULL,
            sha256 TEXT NOT NULL,
            size_bytes {int} NOT NULL,
            format TEXT NOT NULL,
            memory_mib {int} NOT NULL, -- what one replica needs on a node (weights, KV, worker)
            created_at {real} NOT NULL
        );
        CREATE TABLE deployments (
            id TEXT PRIMARY KEY,
            model TEXT NOT NULL REFERENCES models (ref),
            replicas {int} NOT NULL,
            service_class TEXT NOT NULL,
            isolation TEXT NOT NULL,
            constraints TEXT NOT NULL, -- JSON: sites, regions, labels, gpu, gpu_memory_mib, tenant
            created_at {real} NOT NULL
        );
        CREATE TABLE placements (
            deployment_id TEXT,
            node_id TEXT,
            gpu {int}, -- the index of the node's GPU the replica runs on (NULL: CPU)
            created_at {real} NOT NULL,
            PRIMARY KEY (deployment_id, node_id)
        );
        ALTER TABLE nodes ADD COLUMN draining {int};
        """,
    ),
)
