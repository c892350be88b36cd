"""Accounts and keys managed on the appliance itself: the admin API's service
(`/v1/admin/accounts`, `/v1/admin/keys`) and the bootstrap key of a site without a hub.
No aiohttp here.

Who owns the accounts of a node is decided once, by whether it has a hub: a node of a
fleet (enrolled, or provisioned to enroll) takes its accounts and keys from its hub's
desired state, so this service refuses to change them there (409 `hub_managed`) rather
than make accounts the hub does not know, whose usage the hub would never see, and keys
it could not revoke. It still lists them. A site without a hub manages its own.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from appliance.state.store import (
    AccountDisabledError,
    AccountExistsError,
    ConflictError,
    LastAdminKeyError,
    NotFoundError,
)
from shared.errors import (
    AccountDisabled,
    AccountExists,
    AccountNotFound,
    HubManaged,
    KeyNotFound,
    LastAdminKey,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from appliance.state.store import Account, ApiKey, AsyncStore
    from shared.classes import ServiceClass
    from shared.provisioning import BootstrapKey

log = logging.getLogger(__name__)


class AccountService:
    def __init__(self, store: AsyncStore, *, hub_managed: Callable[[], bool]) -> None:
        self._store = store
        # Asked at every write: a node that enrolls while it runs is the hub's from then.
        self._hub_managed = hub_managed

    async def accounts(self) -> list[Account]:
        return await self._store.run(self._store.sync.list_accounts)

    async def keys(self, account: str | None = None) -> list[ApiKey]:
        if (
            account is not None
            and await self._store.run(self._store.sync.get_account, account) is None
        ):
            raise AccountNotFound(f"no account named {account!r}", param="account")
        return await self._store.run(self._store.sync.list_keys, account)

    async def create_account(
        self,
        name: str,
        service_class: ServiceClass,
        *,
        requests_per_minute: int | None = None,
        tokens_per_day: int | None = None,
    ) -> Account:
        self._refuse_on_a_hub_managed_node()
        try:
            return await self._store.run(
                self._store.sync.create_account,
                name,
                service_class,
                requests_per_minute=requests_per_minute,
                tokens_per_day=tokens_per_day,
            )
        except AccountExistsError as err:
            raise AccountExists(str(err), param="name") from err

    async def disable_account(self, name: str) -> Account:
        """Disable it and revoke its keys (again: answered as it is)."""
        self._refuse_on_a_hub_managed_node()
        try:
            account = await self._store.run(self._store.sync.disable_account, name)
        except NotFoundError as err:
            raise AccountNotFound(str(err)) from err
        except LastAdminKeyError as err:
            raise LastAdminKey(str(err)) from err
        log.info("account %s disabled through the admin API, its keys revoked", name)
        return account

    async def create_key(self, account: str, *, admin: bool) -> tuple[ApiKey, str]:
        """A new key of an existing account: (its record, the key, to be shown once)."""
        self._refuse_on_a_hub_managed_node()
        try:
            return await self._store.run(self._store.sync.issue_key, account, admin=admin)
        except NotFoundError as err:
            raise AccountNotFound(str(err), param="account") from err
        except AccountDisabledError as err:
            raise AccountDisabled(str(err), param="account") from err

    async def revoke_key(self, prefix: str) -> ApiKey:
        """Revoke a key (one revoked already: answered as it is); never the last active
        admin key, which would leave a site without a shell with no way in."""
        self._refuse_on_a_hub_managed_node()
        store = self._store
        try:
            return await store.run(store.sync.revoke_key, prefix, keep_an_admin=True)
        except NotFoundError as err:
            raise KeyNotFound(str(err)) from err
        except LastAdminKeyError as err:
            raise LastAdminKey(str(err)) from err
        except ConflictError:  # revoked before: DELETE is idempotent
            keys = await store.run(store.sync.list_keys)
            return next(k for k in keys if k.prefix == prefix)

    async def import_bootstrap_key(self, key: BootstrapKey) -> None:
        """The provisioning file's admin key, once (see `Store.import_bootstrap_key`)."""
        store = self._store
        added = await store.run(store.sync.import_bootstrap_key, key.account, key.prefix, key.hash)
        if added:
            log.info("imported the bootstrap admin key %s of account %s", key.prefix, key.account)

    def _refuse_on_a_hub_managed_node(self) -> None:
        if self._hub_managed():
            raise HubManaged(
                "this node's accounts and keys come from its hub: make them there "
                "(`kvl hub accounts set`, `kvl hub keys create`, `kvl hub keys revoke`)",
            )
