"""`kvl hub …`: serve the hub, and manage its enrollment tokens, nodes, accounts, keys,
models and deployments, packages, image releases and staged rollouts, the settings it
sets on its nodes, operators and console users, read the fleet's
objectives, and back the hub up and restore it. One module per command
group, imported only when one of its commands runs; each opens the store the one way
(`common.opened_store`)."""

from __future__ import annotations

import click

from shared.cli import LazyGroup


@click.group(
    "hub",
    cls=LazyGroup,
    lazy={
        "accounts": (
            "hub.cli.accounts",
            "accounts",
            "Accounts of the fleet: service class, quotas and tenancy, pushed to their nodes.",
        ),
        "admin": (
            "hub.cli.admin",
            "admin",
            "People who log in to the web console (/console/), with argon2id-hashed passwords.",
        ),
        "alerts": (
            "hub.cli.alerts",
            "alerts",
            "The hub's alerts (`kvl hub alerts` alone: those firing, as `list` prints them).",
        ),
        "backup": (
            "hub.cli.backup",
            "backup",
            "Back the hub up into the archive OUT (a tar; gzipped if OUT ends in .gz), while...",
        ),
        "ca": (
            "hub.cli.ca",
            "ca",
            "The fleet's certificate authority.",
        ),
        "config": (
            "hub.cli.serve",
            "show_config",
            "Validate the hub configuration and print the effective settings.",
        ),
        "deploy": (
            "hub.cli.models",
            "deploy",
            "Deploy MODEL (name@version) on the fleet; the placement reconciler picks the nodes.",
        ),
        "deployments": (
            "hub.cli.models",
            "deployments",
            "List deployments: model, replicas wanted and where they run.",
        ),
        "keys": (
            "hub.cli.keys",
            "keys",
            "API keys of fleet accounts (only hashes go to the nodes).",
        ),
        "models": (
            "hub.cli.models",
            "models",
            "Model files the hub places on nodes (stored by sha256, fetched through the tunnel).",
        ),
        "nodes": (
            "hub.cli.nodes",
            "nodes",
            "The node registry.",
        ),
        "objectives": (
            "hub.cli.objectives",
            "objectives",
            "The fleet's objectives over a window: per class (and group) and objective, the...",
        ),
        "operators": (
            "hub.cli.operators",
            "operators",
            "Operator tokens for the hub's admin API (/v1/admin) and its console.",
        ),
        "packages": (
            "hub.cli.packages",
            "packages",
            "Content packages across the fleet, and the archives the hub seeds to nodes.",
        ),
        "provision": (
            "hub.cli.tokens",
            "provision",
            "Make a provisioning file (kovenlab.json) for a node: a new enrollment token, the...",
        ),
        "releases": (
            "hub.cli.rollouts",
            "releases",
            "Image releases (RAUC bundles) the hub holds, and sites' update windows.",
        ),
        "restore": (
            "hub.cli.backup",
            "restore",
            "Restore a hub's backup into this hub's data directory (and database), with no hub...",
        ),
        "rollouts": (
            "hub.cli.rollouts",
            "rollouts",
            "Staged rollouts: a canary, then waves, each gated on its nodes' health.",
        ),
        "serve": (
            "hub.cli.serve",
            "serve",
            "Serve the hub API over HTTPS; prints the fingerprint of the hub's CA, which...",
        ),
        "settings": (
            "hub.cli.settings",
            "settings",
            "Node settings the hub sets: fleet-wide, per site, per node (the most specific wins).",
        ),
        "tokens": (
            "hub.cli.tokens",
            "tokens",
            "Enrollment tokens (only a hash is stored).",
        ),
        "undeploy": (
            "hub.cli.models",
            "undeploy",
            "Remove a deployment: its replicas are unloaded from the nodes.",
        ),
    },
)
def hub() -> None:
    """The hub of the fleet."""
