"""m012 on: objectives, alerts, rollouts, and tenancy from the operator. New migrations
go at the end of this tuple."""

from __future__ import annotations

from hub.state.sql import Migration

# The counters of the objectives' buckets, as columns (hub/planning/slo.py COUNTER_NAMES as of
# m012): requests, admitted, refusals by reason, objectives met and missed, and the latency
# histograms' buckets (protocol 4's 19 bounds and one above).
_M012_COUNTERS = ",\n            ".join(
    f"{name} {{int}} NOT NULL"
    for name in (
        "requests", "admitted", "refused_admit", "refused_first_token", "refused_shed",
        "refused_outbox", "refused_error", "refused_quota", "met_admit", "met_first_token",
        "met_complete", "missed_admit", "missed_first_token", "missed_complete",
        *(f"ttft_{i}" for i in range(19)), *(f"completion_{i}" for i in range(19)),
    )
)  # fmt: skip

MIGRATIONS = (
    # The fleet's objectives from heartbeats (hub/state/objectives.py). Per node, class and
    # account, the last cumulative values counted (JSON) and their epoch; per node, its
    # worker restarts likewise: what the next heartbeat's deltas are taken from. The
    # deltas in buckets of `width` seconds (300, kept 2 days; 3600, kept 35 days) from
    # `start` (unix seconds); the node's name and site beside its id. A node's worker
    # restarts are a row of their own, with class and account "". And the same sums
    # without the node (what windows by class, account or site read).
    Migration(
        "m012_objectives",
        f"""
        CREATE TABLE slo_cursors (
            node_id TEXT,
            service_class TEXT,
            account TEXT,
            epoch TEXT NOT NULL,
            at {{real}} NOT NULL,
            counters TEXT NOT NULL,
            PRIMARY KEY (node_id, service_class, account)
        );
        CREATE TABLE slo_node_cursors (
            node_id TEXT PRIMARY KEY,
            epoch TEXT NOT NULL,
            at {{real}} NOT NULL,
            worker_restarts {{int}} NOT NULL
        );
        CREATE TABLE slo_buckets (
            width {{int}} NOT NULL,
            start {{int}} NOT NULL,
            node_id TEXT NOT NULL,
            service_class TEXT NOT NULL,
            account TEXT NOT NULL,
            node TEXT,
            site TEXT,
            {_M012_COUNTERS},
            ttft_sum_s {{real}} NOT NULL,
            completion_sum_s {{real}} NOT NULL,
            worker_restarts {{int}} NOT NULL,
            PRIMARY KEY (width, start, node_id, service_class, account)
        );
        CREATE INDEX idx_slo_buckets_width_start ON slo_buckets (width, start);
        CREATE TABLE slo_fleet_buckets (
            width {{int}} NOT NULL,
            start {{int}} NOT NULL,
            service_class TEXT NOT NULL,
            account TEXT NOT NULL,
            site TEXT NOT NULL,
            {_M012_COUNTERS},
            ttft_sum_s {{real}} NOT NULL,
            completion_sum_s {{real}} NOT NULL,
            PRIMARY KEY (width, start, service_class, account, site)
        );
        """,
    ),
    # Alerts the hub evaluated (hub/alerting/): each firing of a rule for one subject (its
    # labels, JSON with sorted keys), until it resolves. One firing row per rule and
    # subject at a time (the partial unique index), so replicas evaluating together
    # record, and deliver, a firing once. Silences: an alert whose rule and labels match
    # every matcher (exact values) until `until` is recorded but not delivered. The
    # webhook outbox: one row per alert change and receiver, made in the transaction that
    # records the change, retried with backoff until a 2xx or `alerts.retry_s`.
    Migration(
        "m013_alerts",
        """
        CREATE TABLE alerts (
            id TEXT PRIMARY KEY,
            rule TEXT NOT NULL,
            labels TEXT NOT NULL, -- JSON object, sorted keys
            severity TEXT NOT NULL, -- page, ticket
            state TEXT NOT NULL, -- firing, resolved
            fired_at {real} NOT NULL,
            resolved_at {real},
            value {real} NOT NULL,
            summary TEXT NOT NULL,
            silenced {int} NOT NULL -- a silence matched it when it fired: recorded, not sent
        );
        CREATE UNIQUE INDEX idx_alerts_firing ON alerts (rule, labels) WHERE state = 'firing';
        CREATE INDEX idx_alerts_fired_at ON alerts (fired_at);
        CREATE TABLE alert_silences (
            id TEXT PRIMARY KEY,
            matchers TEXT NOT NULL, -- JSON object: label (or "rule") -> value
            until {real} NOT NULL,
            created_by TEXT NOT NULL,
            comment TEXT NOT NULL,
            created_at {real} NOT NULL
        );
        CREATE TABLE alert_deliveries (
            id TEXT PRIMARY KEY, -- the Kvl-Delivery id, the same on every retry
            alert_id TEXT NOT NULL REFERENCES alerts (id),
            event TEXT NOT NULL, -- firing, resolved
            url TEXT NOT NULL,
            payload TEXT NOT NULL, -- the JSON body, fixed when made
            status TEXT NOT NULL, -- pending, delivered, failed
            attempts {int} NOT NULL,
            next_at {real} NOT NULL,
            last_error TEXT,
            created_at {real} NOT NULL,
            delivered_at {real}
        );
        CREATE INDEX idx_alert_deliveries_status_next_at ON alert_deliveries (status, next_at);
        """,
    ),
    # Image releases (the bundle is kept under its sha256 in the artifacts folder), each
    # site's update window (minutes of the day, UTC), and the release each node should run
    # (set by a rollout, wave by wave). A model rollout's new model for one placement, over
    # its deployment's model. Staged rollouts (hub/rollouts.py): target and strategy as
    # JSON; each member node with its wave, its state in the rollout and what it had before.
    Migration(
        "m014_rollouts",
        """
        CREATE TABLE releases (
            version TEXT PRIMARY KEY, notes TEXT NOT NULL, sha256 TEXT NOT NULL,
            size_bytes {int} NOT NULL, created_at {real} NOT NULL
        );
        CREATE TABLE update_windows (
            site TEXT PRIMARY KEY, start_min {int} NOT NULL, end_min {int} NOT NULL
        );
        CREATE TABLE node_releases (
            node_id TEXT PRIMARY KEY, version TEXT NOT NULL, rollout_id TEXT,
            set_at {real} NOT NULL
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
            wave {int} NOT NULL,
            wave_started_at {real} NOT NULL,
            reason TEXT NOT NULL,
            created_by TEXT NOT NULL,
            created_at {real} NOT NULL,
            updated_at {real} NOT NULL
        );
        CREATE INDEX idx_rollouts_state ON rollouts (state);
        CREATE TABLE rollout_nodes (
            rollout_id TEXT REFERENCES rollouts (id),
            node_id TEXT,
            name TEXT NOT NULL,
            wave {int} NOT NULL,
            state TEXT NOT NULL,
            previous TEXT,
            targeted_at {real},
            healthy_since {real},
            note TEXT NOT NULL,
            PRIMARY KEY (rollout_id, node_id)
        );
        """,
    ),
    # Tenancy is the operator's, not labels' (earlier nodes keep theirs); refusals, why.
    # Claims held lowercase; of case variants, the lowercase (else the longest held) kept.
    # Each database reads the labels' JSON its own way.
    Migration(
        "m015_tenancy_from_the_operator",
        """
        ALTER TABLE enrollment_tokens ADD COLUMN tenant TEXT;
        ALTER TABLE enrollment_tokens ADD COLUMN private {int} NOT NULL DEFAULT 0;
        ALTER TABLE nodes ADD COLUMN tenant TEXT;
        ALTER TABLE nodes ADD COLUMN private {int} NOT NULL DEFAULT 0;
        ALTER TABLE nodes ADD COLUMN certificate_refused TEXT;
        UPDATE node_names AS n SET name = lower(n.name) WHERE n.name <> lower(n.name) AND NOT
            EXISTS (SELECT 1 FROM node_names AS o WHERE lower(o.name) = lower(n.name) AND
            o.name <> n.name AND (o.name = lower(o.name) OR o.until > n.until OR
            (o.until = n.until AND o.name < n.name)));
        """,
        sqlite="""
        UPDATE nodes SET tenant = NULLIF(json_extract(labels, '$.tenant'), ''),
            private = json_extract(labels, '$.private') IS 'true' WHERE json_valid(labels);
        """,
        postgres="""
        UPDATE nodes SET tenant = NULLIF(labels::json ->> 'tenant', ''), private = CASE WHEN
            labels::json ->> 'private' = 'true' THEN 1 ELSE 0 END WHERE labels <> '';
        """,
    ),
    # Where a model came from (the pinned reference it was pulled by, its licence), and
    # what reading its file found (JSON: hub/models/inspect.py).
    Migration(
        "m016_model_sources",
        """
        ALTER TABLE models ADD COLUMN source TEXT;
        ALTER TABLE models ADD COLUMN license TEXT;
        ALTER TABLE models ADD COLUMN inspection TEXT;
        """,
    ),
    # Model pulls the operator asked for: durable jobs with their progress.
    Migration(
        "m017_model_pulls",
        """
        CREATE TABLE model_pulls (
            id TEXT PRIMARY KEY,
            reference TEXT NOT NULL,
            name TEXT,
            version TEXT,
            memory_mib {int},
            state TEXT NOT NULL,
            done_bytes {int} NOT NULL,
            total_bytes {int},
            model TEXT,
            error_kind TEXT,
            error TEXT,
            created_by TEXT NOT NULL,
            created_at {real} NOT NULL,
            updated_at {real} NOT NULL
        );
        CREATE INDEX idx_model_pulls_state ON model_pulls (state);
        """,
    ),
    # A deployment's settings for its model (JSON: protocol.ModelPreset).
    Migration("m018_deployment_presets", "ALTER TABLE deployments ADD COLUMN preset TEXT;"),
    # What the hub sets of its nodes' settings: fleet-wide, per site, per node (the scope).
    Migration(
        "m019_node_settings",
        """
        CREATE TABLE node_settings (
            scope TEXT NOT NULL,
            key TEXT NOT NULL,
            value TEXT NOT NULL,
            set_by TEXT NOT NULL,
            set_at {real} NOT NULL,
            PRIMARY KEY (scope, key)
        );
        """,
    ),
    # Model files an operator uploads in pieces (resumable); the bytes so far are its part file.
    Migration(
        "m020_model_uploads",
        """
        CREATE TABLE model_uploads (
            id TEXT PRIMARY KEY,
            name TEXT NOT NULL,
            version TEXT NOT NULL,
            size_bytes {int} NOT NULL,
            sha256 TEXT,
            memory_mib {int},
            state TEXT NOT NULL,
            model TEXT,
            error TEXT,
            created_by TEXT NOT NULL,
            created_at {real} NOT NULL,
            updated_at {real} NOT NULL
        );
        """,
    ),
    # A site's bandwidth for the files its nodes fetch from the hub (bytes a second, shared
    # by the site's nodes): a narrow link is not filled by one release.
    Migration(
        "m021_site_bandwidth",
        """
        CREATE TABLE site_bandwidth (
            site TEXT PRIMARY KEY,
            bytes_per_s {int} NOT NULL
        );
        """,
    ),
)
