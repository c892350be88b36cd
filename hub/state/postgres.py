"""The hub's schema on PostgreSQL: the SQLite migrations (hub/state/migrations.py), one for
one and under the same names, as SQL. Append-only like them: a new SQLite migration gets
its twin here, and tests/hub/test_schema.py fails while the two schemas differ.

Types: TEXT, BIGINT for SQLite's INTEGER, DOUBLE PRECISION for its REAL (PostgreSQL's
INTEGER and REAL are 32-bit). Index names are the ones sqlite-utils gives.
"""

from __future__ import annotations

from hub.state.sql import SQLMigration

# The counter columns of m012's tables, as hub/state/migrations.py's `_M012_COUNTERS`.
_M012_COUNTERS = ",\n            ".join(
    f"{name} BIGINT NOT NULL"
    for name in (
        "requests", "admitted", "refused_admit", "refused_first_token", "refused_shed",
        "refused_outbox", "refused_error", "refused_quota", "met_admit", "met_first_token",
        "met_complete", "missed_admit", "missed_first_token", "missed_complete",
        *(f"ttft_{i}" for i in range(19)), *(f"completion_{i}" for i in range(19)),
    )
)  # fmt: skip

MIGRATIONS = (
    SQLMigration(
        "m001_fleet",
        """
        CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT);
        CREATE TABLE enrollment_tokens (
            prefix TEXT PRIMARY KEY,
            hash TEXT NOT NULL,
            site TEXT NOT NULL,
            uses_left BIGINT NOT NULL,
            expires_at DOUBLE PRECISION NOT NULL,
            revoked_at DOUBLE PRECISION,
            created_at DOUBLE PRECISION NOT NULL
        );
        CREATE TABLE nodes (
            id TEXT PRIMARY KEY,
            name TEXT NOT NULL,
            site TEXT NOT NULL,
            labels TEXT,
            wg_public_key TEXT NOT NULL,
            overlay_address TEXT NOT NULL,
            token_prefix TEXT NOT NULL,
            token_hash TEXT NOT NULL,
            enrolled_with TEXT,
            enrolled_at DOUBLE PRECISION,
            last_seen DOUBLE PRECISION,
            versions TEXT,
            capacity TEXT,
            revoked_at DOUBLE PRECISION
        );
        CREATE UNIQUE INDEX idx_nodes_overlay_address ON nodes (overlay_address);
        CREATE UNIQUE INDEX idx_nodes_wg_public_key ON nodes (wg_public_key);
        CREATE UNIQUE INDEX idx_nodes_token_prefix ON nodes (token_prefix);
        CREATE TABLE ledger (
            event_id TEXT PRIMARY KEY,
            node_id TEXT NOT NULL REFERENCES nodes (id),
            kind TEXT NOT NULL,
            body TEXT NOT NULL,
            received_at DOUBLE PRECISION NOT NULL
        );
        CREATE INDEX idx_ledger_node_id_received_at ON ledger (node_id, received_at);
        """,
    ),
    SQLMigration(
        "m002_desired_state",
        """
        CREATE TABLE accounts (
            name TEXT PRIMARY KEY,
            service_class TEXT NOT NULL,
            requests_per_minute BIGINT,
            tokens_per_day BIGINT,
            created_at DOUBLE PRECISION NOT NULL
        );
        CREATE TABLE api_keys (
            prefix TEXT PRIMARY KEY,
            hash TEXT NOT NULL,
            account TEXT NOT NULL REFERENCES accounts (name),
            admin BIGINT NOT NULL,
            created_at DOUBLE PRECISION NOT NULL,
            revoked_at DOUBLE PRECISION
        );
        """,
    ),
    SQLMigration(
        "m003_quota_leases",
        """
        ALTER TABLE accounts ADD COLUMN budget_tokens BIGINT;
        ALTER TABLE accounts ADD COLUMN budget_period_s DOUBLE PRECISION;
        ALTER TABLE ledger ADD COLUMN account TEXT;
        ALTER TABLE ledger ADD COLUMN tokens BIGINT;
        ALTER TABLE ledger ADD COLUMN lease_id TEXT;
        ALTER TABLE ledger ADD COLUMN at DOUBLE PRECISION;
        CREATE INDEX idx_ledger_account_at ON ledger (account, at);
        CREATE INDEX idx_ledger_lease_id ON ledger (lease_id);
        CREATE TABLE leases (
            id TEXT PRIMARY KEY,
            account TEXT NOT NULL REFERENCES accounts (name),
            node_id TEXT NOT NULL REFERENCES nodes (id),
            period_start DOUBLE PRECISION NOT NULL,
            granted BIGINT NOT NULL,
            final BIGINT,
            expires_at DOUBLE PRECISION NOT NULL,
            created_at DOUBLE PRECISION NOT NULL
        );
        CREATE INDEX idx_leases_account_period_start ON leases (account, period_start);
        """,
    ),
    SQLMigration(
        "m004_offload",
        """
        ALTER TABLE nodes ADD COLUMN address TEXT;
        ALTER TABLE nodes ADD COLUMN offload_secret TEXT;
        """,
    ),
    SQLMigration(
        "m005_placement",
        """
        CREATE TABLE models (
            ref TEXT PRIMARY KEY,
            name TEXT NOT NULL,
            version TEXT NOT NULL,
            sha256 TEXT NOT NULL,
            size_bytes BIGINT NOT NULL,
            format TEXT NOT NULL,
            memory_mib BIGINT NOT NULL,
            created_at DOUBLE PRECISION NOT NULL
        );
        CREATE TABLE deployments (
            id TEXT PRIMARY KEY,
            model TEXT NOT NULL REFERENCES models (ref),
            replicas BIGINT NOT NULL,
            service_class TEXT NOT NULL,
            isolation TEXT NOT NULL,
            constraints TEXT NOT NULL,
            created_at DOUBLE PRECISION NOT NULL
        );
        CREATE TABLE placements (
            deployment_id TEXT,
            node_id TEXT,
            gpu BIGINT,
            created_at DOUBLE PRECISION NOT NULL,
            PRIMARY KEY (deployment_id, node_id)
        );
        ALTER TABLE nodes ADD COLUMN draining BIGINT;
        """,
    ),
    SQLMigration(
        "m006_operators",
        """
        CREATE TABLE operators (
            prefix TEXT PRIMARY KEY,
            hash TEXT NOT NULL,
            name TEXT NOT NULL,
            created_at DOUBLE PRECISION NOT NULL,
            revoked_at DOUBLE PRECISION
        );
        """,
    ),
    SQLMigration(
        "m007_packages",
        """
        CREATE TABLE packages (
            id TEXT,
            version TEXT,
            title TEXT NOT NULL,
            topic TEXT NOT NULL,
            level TEXT NOT NULL,
            items BIGINT NOT NULL,
            size BIGINT NOT NULL,
            digest TEXT NOT NULL,
            lineage TEXT NOT NULL,
            origin_node TEXT,
            created_at TEXT NOT NULL,
            received_at DOUBLE PRECISION NOT NULL,
            bundle_sha256 TEXT,
            bundle_size BIGINT,
            PRIMARY KEY (id, version)
        );
        CREATE TABLE package_copies (
            package_id TEXT,
            version TEXT,
            node_id TEXT,
            reported_at DOUBLE PRECISION NOT NULL,
            PRIMARY KEY (package_id, version, node_id)
        );
        CREATE TABLE package_seeds (
            package_id TEXT,
            version TEXT,
            site TEXT,
            created_at DOUBLE PRECISION NOT NULL,
            PRIMARY KEY (package_id, version)
        );
        """,
    ),
    SQLMigration(
        "m008_console",
        """
        CREATE TABLE console_users (
            name TEXT PRIMARY KEY,
            hash TEXT NOT NULL,
            created_at DOUBLE PRECISION NOT NULL,
            disabled BIGINT NOT NULL
        );
        -- "user" is a reserved word in PostgreSQL: quoted here and in every query.
        CREATE TABLE console_sessions (
            id_hash TEXT PRIMARY KEY,
            "user" TEXT NOT NULL REFERENCES console_users (name),
            csrf TEXT NOT NULL,
            created_at DOUBLE PRECISION NOT NULL,
            expires_at DOUBLE PRECISION NOT NULL
        );
        CREATE INDEX idx_console_sessions_expires_at ON console_sessions (expires_at);
        CREATE TABLE node_samples (
            node_id TEXT,
            at DOUBLE PRECISION,
            cpu_percent DOUBLE PRECISION,
            memory_used_mib BIGINT,
            memory_total_mib BIGINT,
            queue_waiting BIGINT,
            outbox_lag BIGINT,
            models BIGINT,
            PRIMARY KEY (node_id, at)
        );
        CREATE INDEX idx_node_samples_at ON node_samples (at);
        """,
    ),
    SQLMigration(
        "m009_retire_offload_secrets",
        """
        UPDATE nodes SET offload_secret = NULL;
        """,
    ),
    SQLMigration(
        "m010_tenancy",
        """
        ALTER TABLE accounts ADD COLUMN tenant TEXT;
        ALTER TABLE accounts ADD COLUMN sites TEXT;
        ALTER TABLE accounts ADD COLUMN dedicated BIGINT;
        ALTER TABLE accounts ADD COLUMN tenancy_at DOUBLE PRECISION;
        CREATE TABLE account_departures (
            account TEXT,
            node_id TEXT,
            at DOUBLE PRECISION NOT NULL,
            PRIMARY KEY (account, node_id)
        );
        """,
    ),
    SQLMigration(
        "m011_node_certificates",
        """
        CREATE TABLE node_certificates (
            serial TEXT PRIMARY KEY,
            node_id TEXT NOT NULL,
            ca TEXT NOT NULL,
            names TEXT NOT NULL,
            issued_at DOUBLE PRECISION NOT NULL,
            not_after DOUBLE PRECISION NOT NULL
        );
        CREATE INDEX idx_node_certificates_node_id_not_after
            ON node_certificates (node_id, not_after);
        CREATE TABLE node_names (
            name TEXT PRIMARY KEY,
            node_id TEXT NOT NULL,
            until DOUBLE PRECISION NOT NULL
        );
        CREATE INDEX idx_node_names_node_id ON node_names (node_id);
        """,
    ),
    SQLMigration(
        "m012_objectives",
        f"""
        CREATE TABLE slo_cursors (
            node_id TEXT,
            service_class TEXT,
            account TEXT,
            epoch TEXT NOT NULL,
            at DOUBLE PRECISION NOT NULL,
            counters TEXT NOT NULL,
            PRIMARY KEY (node_id, service_class, account)
        );
        CREATE TABLE slo_node_cursors (
            node_id TEXT PRIMARY KEY,
            epoch TEXT NOT NULL,
            at DOUBLE PRECISION NOT NULL,
            worker_restarts BIGINT NOT NULL
        );
        CREATE TABLE slo_buckets (
            width BIGINT NOT NULL,
            start BIGINT NOT NULL,
            node_id TEXT NOT NULL,
            service_class TEXT NOT NULL,
            account TEXT NOT NULL,
            node TEXT,
            site TEXT,
            {_M012_COUNTERS},
            ttft_sum_s DOUBLE PRECISION NOT NULL,
            completion_sum_s DOUBLE PRECISION NOT NULL,
            worker_restarts BIGINT NOT NULL,
            PRIMARY KEY (width, start, node_id, service_class, account)
        );
        CREATE INDEX idx_slo_buckets_width_start ON slo_buckets (width, start);
        CREATE TABLE slo_fleet_buckets (
            width BIGINT NOT NULL,
            start BIGINT NOT NULL,
            service_class TEXT NOT NULL,
            account TEXT NOT NULL,
            site TEXT NOT NULL,
            {_M012_COUNTERS},
            ttft_sum_s DOUBLE PRECISION NOT NULL,
            completion_sum_s DOUBLE PRECISION NOT NULL,
            PRIMARY KEY (width, start, service_class, account, site)
        );
        """,
    ),
    SQLMigration(
        "m013_alerts",
        """
        CREATE TABLE alerts (
            id TEXT PRIMARY KEY,
            rule TEXT NOT NULL,
            labels TEXT NOT NULL,
            severity TEXT NOT NULL,
            state TEXT NOT NULL,
            fired_at DOUBLE PRECISION NOT NULL,
            resolved_at DOUBLE PRECISION,
            value DOUBLE PRECISION NOT NULL,
            summary TEXT NOT NULL,
            silenced BIGINT NOT NULL
        );
        CREATE UNIQUE INDEX idx_alerts_firing ON alerts (rule, labels) WHERE state = 'firing';
        CREATE INDEX idx_alerts_fired_at ON alerts (fired_at);
        CREATE TABLE alert_silences (
            id TEXT PRIMARY KEY,
            matchers TEXT NOT NULL,
            until DOUBLE PRECISION NOT NULL,
            created_by TEXT NOT NULL,
            comment TEXT NOT NULL,
            created_at DOUBLE PRECISION NOT NULL
        );
        CREATE TABLE alert_deliveries (
            id TEXT PRIMARY KEY,
            alert_id TEXT NOT NULL REFERENCES alerts (id),
            event TEXT NOT NULL,
            url TEXT NOT NULL,
            payload TEXT NOT NULL,
            status TEXT NOT NULL,
            attempts BIGINT NOT NULL,
            next_at DOUBLE PRECISION NOT NULL,
            last_error TEXT,
            created_at DOUBLE PRECISION NOT NULL,
            delivered_at DOUBLE PRECISION
        );
        CREATE INDEX idx_alert_deliveries_status_next_at ON alert_deliveries (status, next_at);
        """,
    ),
    SQLMigration(
        "m014_rollouts",
        """
        CREATE TABLE releases (
            version TEXT PRIMARY KEY, notes TEXT NOT NULL, sha256 TEXT NOT NULL,
            size_bytes BIGINT NOT NULL, created_at DOUBLE PRECISION NOT NULL
        );
        CREATE TABLE update_windows (
            site TEXT PRIMARY KEY, start_min BIGINT NOT NULL, end_min BIGINT NOT NULL
        );
        CREATE TABLE node_releases (
            node_id TEXT PRIMARY KEY, version TEXT NOT NULL, rollout_id TEXT,
            set_at DOUBLE PRECISION NOT NULL
        );
        CREATE TABLE placement_models (
            deployment_id TEXT, node_id TEXT, model TEXT NOT NULL, rollout_id TEXT,
            PRIMARY KEY (deployment_id, node_id)
        );
        CREATE INDEX idx_placement_models_rollout_id ON placement_models (rollout_id);
        CREATE TABLE rollouts (
            id TEXT PRIMARY KEY,
            kind TEXT NOT NULL,
            target TEXT NOT NULL,
            strategy TEXT NOT NULL,
            state TEXT NOT NULL,
            wave BIGINT NOT NULL,
            wave_started_at DOUBLE PRECISION NOT NULL,
            reason TEXT NOT NULL,
            created_by TEXT NOT NULL,
            created_at DOUBLE PRECISION NOT NULL,
            updated_at DOUBLE PRECISION NOT NULL
        );
        CREATE INDEX idx_rollouts_state ON rollouts (state);
        CREATE TABLE rollout_nodes (
            rollout_id TEXT REFERENCES rollouts (id),
            node_id TEXT,
            name TEXT NOT NULL,
            wave BIGINT NOT NULL,
            state TEXT NOT NULL,
            previous TEXT,
            targeted_at DOUBLE PRECISION,
            healthy_since DOUBLE PRECISION,
            note TEXT NOT NULL,
            PRIMARY KEY (rollout_id, node_id)
        );
        """,
    ),
    SQLMigration(
        "m015_tenancy_from_the_operator",
        """
        ALTER TABLE enrollment_tokens ADD COLUMN tenant TEXT;
        ALTER TABLE enrollment_tokens ADD COLUMN private BIGINT NOT NULL DEFAULT 0;
        ALTER TABLE nodes ADD COLUMN tenant TEXT;
        ALTER TABLE nodes ADD COLUMN private BIGINT NOT NULL DEFAULT 0;
        ALTER TABLE nodes ADD COLUMN certificate_refused TEXT;
        UPDATE nodes SET tenant = NULLIF(labels::json ->> 'tenant', ''), private = CASE WHEN
            labels::json ->> 'private' = 'true' THEN 1 ELSE 0 END WHERE labels <> '';
        UPDATE node_names AS n SET name = lower(n.name) WHERE n.name <> lower(n.name) AND NOT
            EXISTS (SELECT 1 FROM node_names AS o WHERE lower(o.name) = lower(n.name) AND
            o.name <> n.name AND (o.name = lower(o.name) OR o.until > n.until OR
            (o.until = n.until AND o.name < n.name)));
        """,
    ),
)
