"""Tenancy (docs/hub.md#tenancy-and-isolation): which accounts reach which nodes. Pure: the
store (hub/state/accounts.py) reads the rows and writes what changes.

An account may be bound to a tenant (None: a shared account), to sites (none: every site),
and, with a tenant, restricted to that tenant's dedicated nodes (`dedicated`). A node's own
tenancy is the operator's, never what the node says (its labels describe it and grant
nothing): its enrollment token's (`kvl hub tokens create --tenant T [--private]`), changed
by an operator only (`kvl hub nodes set`, the console): dedicated to T (class S3), or T's
private site (`private`, class S4). An account reaches a node, or not, until either changes
(`account_reaches`):

- an account bound to sites reaches only nodes of those sites, whatever else holds;
- a node with a tenant gets only that tenant's accounts;
- a private node without a tenant gets only accounts that name its site and are not
  restricted to dedicated nodes;
- a shared node gets the shared accounts and the tenants' accounts not restricted to
  their dedicated nodes."""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class Tenancy:
    """An account's binding: its tenant (None: shared), its sites (empty: every site), and
    whether only its tenant's dedicated nodes serve it."""

    tenant: str | None = None
    sites: tuple[str, ...] = ()
    dedicated: bool = False

    def __post_init__(self) -> None:
        if self.dedicated and self.tenant is None:
            raise ValueError("an account restricted to dedicated nodes names its tenant")

    @classmethod
    def of(cls, tenant: str | None, sites: str | None, dedicated: int | None) -> Tenancy:
        """From an `accounts` row's columns (sites: a JSON list)."""
        return cls(tenant or None, tuple(json.loads(sites or "[]")), bool(dedicated))


def account_reaches(account: Tenancy, site: str, tenant: str | None, private: bool) -> bool:
    """Whether a node of `site` dedicated to `tenant` (None: to none), `private` or not,
    is given the account (the module's rules)."""
    if account.sites and site not in account.sites:
        return False
    if tenant is not None:
        return account.tenant == tenant
    if private:
        return bool(account.sites) and not account.dedicated
    return not account.dedicated
