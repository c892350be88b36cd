"""`kvl hub …`: serve the hub, and manage its enrollment tokens, nodes, accounts, keys,
models and deployments, packages, image releases and staged rollouts,
operators and console users, read the fleet's
objectives, and back the hub up and restore it. One module per command
group; each opens the store the one way (`common.opened_store`)."""

from __future__ import annotations

import click

from hub.cli import (
    accounts,
    admin,
    alerts,
    backup,
    ca,
    keys,
    models,
    nodes,
    objectives,
    operators,
    packages,
    rollouts,
    serve,
    tokens,
)


@click.group("hub")
def hub() -> None:
    """The hub of the fleet."""


for command in (
    serve.show_config,
    serve.serve,
    tokens.tokens,
    tokens.provision,
    nodes.nodes,
    objectives.objectives,
    accounts.accounts,
    keys.keys,
    models.models,
    models.deploy,
    models.undeploy,
    models.deployments,
    packages.packages,
    rollouts.releases,
    rollouts.rollouts,
    operators.operators,
    admin.admin,  # `kvl hub admin …`: the console's users
    ca.ca,
    alerts.alerts,
    backup.backup,
    backup.restore,
):
    hub.add_command(command)
