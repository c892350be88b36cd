"""Append-only schema migrations of the hub. Never edit, reorder or remove one: add one."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sqlite_utils.migrations import Migrations

if TYPE_CHECKING:
    from sqlite_utils import Database

migrations = Migrations("hub")


@migrations()
def m001_fleet(db: Database) -> None:
    db.table("meta").create({"key": str, "value": str}, pk="key")
    db.table("enrollment_tokens").create(
        {
            "prefix": str,
            "hash": str,
            "site": str,
            "uses_left": int,
            "expires_at": float,  # unix seconds
            "revoked_at": float,
            "created_at": float,
        },
        pk="prefix",
        not_null={"hash", "site", "uses_left", "expires_at", "created_at"},
    )
    db.table("nodes").create(
        {
            "id": str,
            "name": str,
            "site": str,
            "labels": str,  # JSON object
            "wg_public_key": str,
            "overlay_address": str,
            "token_prefix": str,
            "token_hash": str,
            "enrolled_with": str,  # the enrollment token's prefix
            "enrolled_at": float,
            "last_seen": float,
            "versions": str,  # JSON object
            "capacity": str,  # JSON object, the last heartbeat's
            "revoked_at": float,
        },
        pk="id",
        not_null={"name", "site", "wg_public_key", "overlay_address", "token_prefix", "token_hash"},
    )
    db.table("nodes").create_index(["overlay_address"], unique=True)
    db.table("nodes").create_index(["wg_public_key"], unique=True)
    db.table("nodes").create_index(["token_prefix"], unique=True)
    # The ledger: unique on the event id, so a resend is harmless.
    db.table("ledger").create(
        {"event_id": str, "node_id": str, "kind": str, "body": str, "received_at": float},
        pk="event_id",
        not_null={"node_id", "kind", "body", "received_at"},
        foreign_keys=[("node_id", "nodes", "id")],
    )
    db.table("ledger").create_index(["node_id", "received_at"])


@migrations()
def m002_desired_state(db: Database) -> None:
    # Accounts and their API keys are managed on the hub and pushed to every node with a
    # serial that grows with each change (meta key `desired_serial`).
    db.table("accounts").create(
        {
            "name": str,
            "service_class": str,
            "requests_per_minute": int,  # None: the class's default
            "tokens_per_day": int,
            "created_at": float,
        },
        pk="name",
        not_null={"service_class", "created_at"},
    )
    db.table("api_keys").create(
        {
            "prefix": str,
            "hash": str,
            "account": str,
            "admin": int,
            "created_at": float,
            "revoked_at": float,
        },
        pk="prefix",
        not_null={"hash", "account", "admin", "created_at"},
        foreign_keys=[("account", "accounts", "name")],
    )


@migrations()
def m003_quota_leases(db: Database) -> None:
    # A global budget per account (tokens per period), spent by nodes through leases.
    db.table("accounts").add_column("budget_tokens", int)  # None: no global budget
    db.table("accounts").add_column("budget_period_s", float)
    # The ledger's usage events, decoded once at ingest: whose tokens, how many, when,
    # and under which lease, so budgets are summed in SQL.
    db.table("ledger").add_column("account", str)
    db.table("ledger").add_column("tokens", int)
    db.table("ledger").add_column("lease_id", str)
    db.table("ledger").add_column("at", float)  # when the node served it, unix seconds
    db.table("ledger").create_index(["account", "at"])
    db.table("ledger").create_index(["lease_id"])
    db.table("leases").create(
        {
            "id": str,
            "account": str,
            "node_id": str,
            "period_start": float,
            "granted": int,
            "final": int,  # the node's final spend once reported; None while it may spend
            "expires_at": float,
            "created_at": float,
        },
        pk="id",
        not_null={"account", "node_id", "period_start", "granted", "expires_at", "created_at"},
        foreign_keys=[("node_id", "nodes", "id"), ("account", "accounts", "name")],
    )
    db.table("leases").create_index(["account", "period_start"])


@migrations()
def m004_offload(db: Database) -> None:
    # Where a node's LAN API answers the hub (the address its heartbeats come from: its
    # overlay address through the tunnel), and the secret the hub shows it when it hands
    # the node a request another node offloaded (sent to the node in its desired state).
    db.table("nodes").add_column("address", str)
    db.table("nodes").add_column("offload_secret", str)


@migrations()
def m005_placement(db: Database) -> None:
    # Model artifacts the hub serves to nodes (content-addressed in the data directory).
    db.table("models").create(
        {
            "ref": str,  # name@version
            "name": str,
            "version": str,
            "sha256": str,
            "size_bytes": int,
            "format": str,
            "memory_mib": int,  # what one replica needs on a node (weights, KV, worker)
            "created_at": float,
        },
        pk="ref",
        not_null={"name", "version", "sha256", "size_bytes", "format", "memory_mib", "created_at"},
    )
    # What should run: a model, how many replicas across the fleet, under which constraints.
    db.table("deployments").create(
        {
            "id": str,
            "model": str,  # models.ref
            "replicas": int,
            "service_class": str,
            "isolation": str,
            "constraints": str,  # JSON: sites, regions, labels, gpu, gpu_memory_mib, tenant
            "created_at": float,
        },
        pk="id",
        not_null={"model", "replicas", "service_class", "isolation", "constraints", "created_at"},
        foreign_keys=[("model", "models", "ref")],
    )
    # Where each replica runs: the planner's last answer, applied by the reconciler.
    db.table("placements").create(
        # gpu: the index of the node's GPU the replica runs on (None: CPU)
        {"deployment_id": str, "node_id": str, "gpu": int, "created_at": float},
        pk=("deployment_id", "node_id"),
        not_null={"created_at"},
    )
    db.table("nodes").add_column("draining", int)


@migrations()
def m006_operators(db: Database) -> None:
    # Tokens of the people and tools that run the fleet (the /v1/admin API).
    db.table("operators").create(
        {"prefix": str, "hash": str, "name": str, "created_at": float, "revoked_at": float},
        pk="prefix",
        not_null={"hash", "name", "created_at"},
    )


@migrations()
def m007_packages(db: Database) -> None:
    # Content packages known to the fleet: reported by the node that made or holds them
    # (their lineage, through the outbox), and bundles the hub holds to seed to nodes.
    db.table("packages").create(
        {
            "id": str,
            "version": str,
            "title": str,
            "topic": str,
            "level": str,
            "items": int,
            "size": int,  # bytes of the package's files
            "digest": str,  # of its OCI manifest, "sha256:<hex>"
            "lineage": str,  # JSON: model, voice, template version, seed, appliance id
            "origin_node": str,  # the node that reported it first (None: uploaded here)
            "created_at": str,  # the manifest's
            "received_at": float,
            "bundle_sha256": str,  # the OCI layout archive the hub holds (None: not held)
            "bundle_size": int,
        },
        pk=("id", "version"),
        not_null={"title", "topic", "level", "items", "size", "digest", "lineage",
                  "created_at", "received_at"},
    )  # fmt: skip
    # Which nodes hold which package versions (reported), and which are to be seeded.
    db.table("package_copies").create(
        {"package_id": str, "version": str, "node_id": str, "reported_at": float},
        pk=("package_id", "version", "node_id"),
        not_null={"reported_at"},
    )
    db.table("package_seeds").create(
        # site: seed to the nodes of this site only (None: to every node)
        {"package_id": str, "version": str, "site": str, "created_at": float},
        pk=("package_id", "version"),
        not_null={"created_at"},
    )


@migrations()
def m008_console(db: Database) -> None:
    # The web console's people (argon2id hashes; `kvl hub admin create`) and their logins:
    # a session is stored by the sha256 of its cookie, with its CSRF token and expiry.
    db.table("console_users").create(
        {"name": str, "hash": str, "created_at": float, "disabled": int},
        pk="name",
        not_null={"hash", "created_at", "disabled"},
    )
    db.table("console_sessions").create(
        {"id_hash": str, "user": str, "csrf": str, "created_at": float, "expires_at": float},
        pk="id_hash",
        not_null={"user", "csrf", "created_at", "expires_at"},
        foreign_keys=[("user", "console_users", "name")],
    )
    db.table("console_sessions").create_index(["expires_at"])
    # Each node's load over time, from its heartbeats, for the node page's charts; kept for
    # `console.samples_kept_s`.
    db.table("node_samples").create(
        {
            "node_id": str,
            "at": float,  # the heartbeat's time, unix seconds
            "cpu_percent": float,
            "memory_used_mib": int,
            "memory_total_mib": int,
            "queue_waiting": int,
            "outbox_lag": int,
            "models": int,  # how many models it served
        },
        pk=("node_id", "at"),
    )
    db.table("node_samples").create_index(["at"])


@migrations()
def m009_retire_offload_secrets(db: Database) -> None:
    # Offloaded requests now carry the client's own key (protocol 2): the per-node secrets,
    # master credentials kept in plain text, are wiped. The column stays (append-only).
    db.execute("UPDATE nodes SET offload_secret = NULL")


@migrations()
def m010_tenancy(db: Database) -> None:
    # An account bound to a tenant (None: a shared account), to sites (a JSON list; empty:
    # every site), and restricted to its tenant's dedicated nodes (`dedicated`): which
    # nodes' desired states give it (hub/state/accounts.py has the rule).
    db.table("accounts").add_column("tenant", str)
    db.table("accounts").add_column("sites", str)
    db.table("accounts").add_column("dedicated", int)
    db.table("accounts").add_column("tenancy_at", float)  # when it was bound (None: made)
    # Nodes an account was withdrawn from when its binding changed (nodes that called the
    # hub while it reached them, so may have served it): usage they served before is
    # still theirs to report (never a foreign account), until the account reaches them
    # again.
    db.table("account_departures").create(
        {"account": str, "node_id": str, "at": float},
        pk=("account", "node_id"),
        not_null={"at"},
    )


@migrations()
def m011_node_certificates(db: Database) -> None:
    # Every certificate the hub's CA issued a node (short-lived; renewed through the
    # tunnel), and the names each one holds: a name (DNS or address) is one live node's
    # at a time, so no node can get a certificate for another's.
    db.table("node_certificates").create(
        {
            "serial": str,  # hex
            "node_id": str,
            "ca": str,  # the issuing CA's fingerprint
            "names": str,  # JSON list
            "issued_at": float,
            "not_after": float,
        },
        pk="serial",
        not_null={"node_id", "ca", "names", "issued_at", "not_after"},
    )
    db.table("node_certificates").create_index(["node_id", "not_after"])
    db.table("node_names").create(
        {"name": str, "node_id": str, "until": float},
        pk="name",
        not_null={"node_id", "until"},
    )
    db.table("node_names").create_index(["node_id"])


# The counters of the objectives' buckets, as columns (hub/state/slo.py
# COUNTER_NAMES as of this migration): requests, admitted, refusals by reason, objectives
# met and missed, and the latency histograms' buckets (protocol 4's 19 bounds and one above).
_M012_COUNTERS = (
    "requests", "admitted", "refused_admit", "refused_first_token", "refused_shed",
    "refused_outbox", "refused_error", "refused_quota", "met_admit", "met_first_token",
    "met_complete", "missed_admit", "missed_first_token", "missed_complete", "ttft_0", "ttft_1",
    "ttft_2", "ttft_3", "ttft_4", "ttft_5", "ttft_6", "ttft_7", "ttft_8", "ttft_9", "ttft_10",
    "ttft_11", "ttft_12", "ttft_13", "ttft_14", "ttft_15", "ttft_16", "ttft_17", "ttft_18",
    "completion_0", "completion_1", "completion_2", "completion_3", "completion_4",
    "completion_5", "completion_6", "completion_7", "completion_8", "completion_9",
    "completion_10", "completion_11", "completion_12", "completion_13", "completion_14",
    "completion_15", "completion_16", "completion_17", "completion_18",
)  # fmt: skip


@migrations()
def m012_objectives(db: Database) -> None:
    # The fleet's objectives from heartbeats (hub/state/objectives.py). Per node, class and
    # account, the last cumulative values counted (JSON) and their epoch; per node, its
    # worker restarts likewise: what the next heartbeat's deltas are taken from.
    db.table("slo_cursors").create(
        {"node_id": str, "service_class": str, "account": str, "epoch": str,
         "at": float, "counters": str},
        pk=("node_id", "service_class", "account"),
        not_null={"epoch", "at", "counters"},
    )  # fmt: skip
    db.table("slo_node_cursors").create(
        {"node_id": str, "epoch": str, "at": float, "worker_restarts": int},
        pk="node_id",
        not_null={"epoch", "at", "worker_restarts"},
    )
    # The deltas in buckets of `width` seconds (300, kept 2 days; 3600, kept 35 days) from
    # `start` (unix seconds); the node's name and site beside its id. A node's worker
    # restarts are a row of their own, with class and account "".
    columns: dict[str, type] = {
        "width": int, "start": int, "node_id": str, "service_class": str, "account": str,
        "node": str, "site": str,
    }  # fmt: skip
    columns.update(dict.fromkeys(_M012_COUNTERS, int))
    columns.update({"ttft_sum_s": float, "completion_sum_s": float, "worker_restarts": int})
    db.table("slo_buckets").create(
        columns,
        pk=("width", "start", "node_id", "service_class", "account"),
        not_null=set(columns) - {"node", "site"},
    )
    db.table("slo_buckets").create_index(["width", "start"])
    # The same sums without the node (what windows by class, account or site read).
    fleet: dict[str, type] = {
        "width": int, "start": int, "service_class": str, "account": str, "site": str,
    }  # fmt: skip
    fleet.update(dict.fromkeys(_M012_COUNTERS, int))
    fleet.update({"ttft_sum_s": float, "completion_sum_s": float})
    db.table("slo_fleet_buckets").create(
        fleet, pk=("width", "start", "service_class", "account", "site"), not_null=set(fleet)
    )


@migrations()
def m013_alerts(db: Database) -> None:
    # Alerts the hub evaluated (hub/alerting/): each firing of a rule for one subject (its
    # labels, JSON with sorted keys), until it resolves. One firing row per rule and
    # subject at a time (the partial unique index), so replicas evaluating together
    # record, and deliver, a firing once.
    db.table("alerts").create(
        {
            "id": str,
            "rule": str,
            "labels": str,  # JSON object, sorted keys
            "severity": str,  # page, ticket
            "state": str,  # firing, resolved
            "fired_at": float,
            "resolved_at": float,
            "value": float,
            "summary": str,
            "silenced": int,  # a silence matched it when it fired: recorded, not delivered
        },
        pk="id",
        not_null={"rule", "labels", "severity", "state", "fired_at", "value", "summary",
                  "silenced"},
    )  # fmt: skip
    db.execute(
        "CREATE UNIQUE INDEX idx_alerts_firing ON alerts (rule, labels) WHERE state = 'firing'"
    )
    db.table("alerts").create_index(["fired_at"])
    # Silences: an alert whose rule and labels match every matcher (exact values) until
    # `until` is recorded but not delivered.
    db.table("alert_silences").create(
        {
            "id": str,
            "matchers": str,  # JSON object: label (or "rule") -> value
            "until": float,
            "created_by": str,
            "comment": str,
            "created_at": float,
        },
        pk="id",
        not_null={"matchers", "until", "created_by", "comment", "created_at"},
    )
    # The webhook outbox: one row per alert change and receiver, made in the transaction
    # that records the change, retried with backoff until a 2xx or `alerts.retry_s`.
    db.table("alert_deliveries").create(
        {
            "id": str,  # the Kvl-Delivery id, the same on every retry
            "alert_id": str,
            "event": str,  # firing, resolved
            "url": str,
            "payload": str,  # the JSON body, fixed when made
            "status": str,  # pending, delivered, failed
            "attempts": int,
            "next_at": float,
            "last_error": str,
            "created_at": float,
            "delivered_at": float,
        },
        pk="id",
        not_null={"alert_id", "event", "url", "payload", "status", "attempts", "next_at",
                  "created_at"},
        foreign_keys=[("alert_id", "alerts", "id")],
    )  # fmt: skip
    db.table("alert_deliveries").create_index(["status", "next_at"])


@migrations()
def m014_rollouts(db: Database) -> None:
    # Image releases (the bundle is kept under its sha256 in the artifacts folder), each
    # site's update window (minutes of the day, UTC), and the release each node should run
    # (set by a rollout, wave by wave).
    db.table("releases").create(
        {"version": str, "notes": str, "sha256": str, "size_bytes": int, "created_at": float},
        pk="version",
        not_null={"notes", "sha256", "size_bytes", "created_at"},
    )
    db.table("update_windows").create(
        {"site": str, "start_min": int, "end_min": int},
        pk="site",
        not_null={"start_min", "end_min"},
    )
    db.table("node_releases").create(
        {"node_id": str, "version": str, "rollout_id": str, "set_at": float},
        pk="node_id",
        not_null={"version", "set_at"},
    )
    # A model rollout's new model for one placement, over its deployment's model.
    db.table("placement_models").create(
        {"deployment_id": str, "node_id": str, "model": str, "rollout_id": str},
        pk=("deployment_id", "node_id"),
        not_null={"model"},
    )
    db.table("placement_models").create_index(["rollout_id"])
    # Staged rollouts (hub/rollouts.py): target and strategy as JSON; each member node
    # with its wave, its state in the rollout and what it had before.
    db.table("rollouts").create(
        {"id": str, "kind": str, "target": str, "strategy": str, "state": str, "wave": int,
         "wave_started_at": float, "reason": str, "created_by": str, "created_at": float,
         "updated_at": float},
        pk="id",
        not_null={"kind", "target", "strategy", "state", "wave", "wave_started_at", "reason",
                  "created_by", "created_at", "updated_at"},
    )  # fmt: skip
    db.table("rollouts").create_index(["state"])
    db.table("rollout_nodes").create(
        {"rollout_id": str, "node_id": str, "name": str, "wave": int, "state": str,
         "previous": str, "targeted_at": float, "healthy_since": float, "note": str},
        pk=("rollout_id", "node_id"),
        not_null={"name", "wave", "state", "note"},
        foreign_keys=[("rollout_id", "rollouts", "id")],
    )  # fmt: skip


@migrations()
def m015_tenancy_from_the_operator(db: Database) -> None:
    # Tenancy is the operator's, not labels' (earlier nodes keep theirs); refusals, why.
    for table in ("enrollment_tokens", "nodes"):
        db.table(table).add_column("tenant", str)
        db.table(table).add_column("private", int, not_null_default=0)
    db.table("nodes").add_column("certificate_refused", str)
    db.execute(
        "UPDATE nodes SET tenant = NULLIF(json_extract(labels, '$.tenant'), ''), private ="
        " json_extract(labels, '$.private') IS 'true' WHERE json_valid(labels)"
    )
    # Claims held lowercase; of case variants, the lowercase (else the longest held) kept.
    db.execute(
        "UPDATE node_names SET name = lower(name) WHERE name <> lower(name) AND NOT EXISTS"
        " (SELECT 1 FROM node_names AS o WHERE lower(o.name) = lower(node_names.name)"
        " AND o.name <> node_names.name AND (o.name = lower(o.name) OR o.until > node_names.until"
        " OR (o.until = node_names.until AND o.name < node_names.name)))"
    )
