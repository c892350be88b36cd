"""m006 to m011: operators, packages, the console, tenancy and node certificates."""

from __future__ import annotations

from hub.state.sql import Migration

MIGRATIONS = (
    # Tokens of the people and tools that run the fleet (the /v1/admin API).
    Migration(
        "m006_operators",
        """
        CREATE TABLE operators (
            prefix TEXT PRIMARY KEY,
            hash TEXT NOT NULL,
            name TEXT NOT NULL,
            created_at {real} NOT NULL,
            revoked_at {real}
        );
        """,
    ),
    # Content packages known to the fleet: reported by the node that made or holds them
    # (their lineage, through the outbox), and bundles the hub holds to seed to nodes;
    # which nodes hold which package versions (reported), and which are to be seeded.
    Migration(
        "m007_packages",
        """
        CREATE TABLE packages (
            id TEXT,
            version TEXT,
            title TEXT NOT NULL,
            topic TEXT NOT NULL,
            level TEXT NOT NULL,
            items {int} NOT NULL,
            size {int} NOT NULL, -- bytes of the package's files
            digest TEXT NOT NULL, -- of its OCI manifest, "sha256:<hex>"
            lineage TEXT NOT NULL, -- JSON: model, voice, template version, seed, appliance id
            origin_node TEXT, -- the node that reported it first (NULL: uploaded here)
            created_at TEXT NOT NULL, -- the manifest's
            received_at {real} NOT NULL,
            bundle_sha256 TEXT, -- the OCI layout archive the hub holds (NULL: not held)
            bundle_size {int},
            PRIMARY KEY (id, version)
        );
        CREATE TABLE package_copies (
            package_id TEXT,
            version TEXT,
            node_id TEXT,
            reported_at {real} NOT NULL,
            PRIMARY KEY (package_id, version, node_id)
        );
        CREATE TABLE package_seeds (
            package_id TEXT,
            version TEXT,
            site TEXT, -- seed to the nodes of this site only (NULL: to every node)
            created_at {real} NOT NULL,
            PRIMARY KEY (package_id, version)
        );
        """,
    ),
    # The web console's people (argon2id hashes; `kvl hub admin create`) and their logins:
    # a session is stored by the sha256 of its cookie, with its CSRF token and expiry.
    # Each node's load over time, from its heartbeats, for the node page's charts; kept for
    # `console.samples_kept_s`.
    Migration(
        "m008_console",
        """
        CREATE TABLE console_users (
            name TEXT PRIMARY KEY,
            hash TEXT NOT NULL,
            created_at {real} NOT NULL,
            disabled {int} NOT NULL
        );
        -- "user" is a reserved word in PostgreSQL: quoted here and in every query.
        CREATE TABLE console_sessions (
            id_hash TEXT PRIMARY KEY,
            "user" TEXT NOT NULL REFERENCES console_users (name),
            csrf TEXT NOT NULL,
            created_at {real} NOT NULL,
            expires_at {real} NOT NULL
        );
        CREATE INDEX idx_console_sessions_expires_at ON console_sessions (expires_at);
        CREATE TABLE node_samples (
            node_id TEXT,
            at {real}, -- the heartbeat's time, unix seconds
            cpu_percent {real},
            memory_used_mib {int},
            memory_total_mib {int},
            queue_waiting {int},
            outbox_lag {int},
            models {int}, -- how many models it served
            PRIMARY KEY (node_id, at)
        );
        CREATE INDEX idx_node_samples_at ON node_samples (at);
        """,
    ),
    # Offloaded requests now carry the client's own key (protocol 2): the per-node secrets,
    # master credentials kept in plain text, are wiped. The column stays (append-only).
    Migration("m009_retire_offload_secrets", "UPDATE nodes SET offload_secret = NULL;"),
    # An account bound to a tenant (NULL: a shared account), to sites (a JSON list; empty:
    # every site), and restricted to its tenant's dedicated nodes (`dedicated`): which
    # nodes' desired states give it (hub/state/accounts.py has the rule); `tenancy_at`,
    # when it was bound (NULL: made). Nodes an account was withdrawn from when its binding
    # changed (nodes that called the hub while it reached them, so may have served it):
    # usage they served before is still theirs to report (never a foreign account), until
    # the account reaches them again.
    Migration(
        "m010_tenancy",
        """
        ALTER TABLE accounts ADD COLUMN tenant TEXT;
        ALTER TABLE accounts ADD COLUMN sites TEXT;
        ALTER TABLE accounts ADD COLUMN dedicated {int};
        ALTER TABLE accounts ADD COLUMN tenancy_at {real};
        CREATE TABLE account_departures (
            account TEXT,
            node_id TEXT,
            at {real} NOT NULL,
            PRIMARY KEY (account, node_id)
        );
        """,
    ),
    # Every certificate the hub's CA issued a node (short-lived; renewed through the
    # tunnel), and the names each one holds: a name (DNS or address) is one live node's
    # at a time, so no node can get a certificate for another's.
    Migration(
        "m011_node_certificates",
        """
        CREATE TABLE node_certificates (
            serial TEXT PRIMARY KEY, -- hex
            node_id TEXT NOT NULL,
            ca TEXT NOT NULL, -- the issuing CA's fingerprint
            names TEXT NOT NULL, -- JSON list
            issued_at {real} NOT NULL,
            not_after {real} NOT NULL
        );
        CREATE INDEX idx_node_certificates_node_id_not_after
            ON node_certificates (node_id, not_after);
        CREATE TABLE node_names (
            name TEXT PRIMARY KEY,
            node_id TEXT NOT NULL,
            until {real} NOT NULL
        );
        CREATE INDEX idx_node_names_node_id ON node_names (node_id);
        """,
    ),
)
