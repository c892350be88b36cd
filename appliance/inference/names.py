"""The model a request names: its own name, an operator's alias, or the default.

Many applications hard-code a model name (`gpt-4o-mini`, `text-embedding-3-small`); the
operator maps it to a local model with `model.aliases` rather than asking every
application to change. A request without `model` gets the default, as llama-server and
vLLM serve theirs. On an enrolled node the hub may set the defaults and aliases too
(protocol.NodeSettings, `kvl hub settings`): its values win over the node's own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from shared.protocol import NodeSettings

if TYPE_CHECKING:
    from collections.abc import Mapping


@dataclass
class ModelNames:
    # alias → `name` or `name@version` of a registered model (a generation or embedding one)
    aliases: Mapping[str, str] = field(default_factory=dict)
    default: str | None = None  # a text completion without `model`
    chat_default: str | None = None  # a chat request without `model`; None: `default`
    embedding: str | None = None  # an embedding request without `model`
    # What the hub sets (the fleet link replaces it as desired states arrive): over the above.
    hub: NodeSettings = field(default_factory=NodeSettings)

    def _aliases(self) -> Mapping[str, str]:
        if not self.hub.aliases:
            return self.aliases
        return {**self.aliases, **self.hub.aliases}

    def generation(self, requested: str | None, *, chat: bool = False) -> str:
        """The model a completion runs on (a chat one, or a text one)."""
        if requested is None:
            default = self.hub.default or self.default
            return ((self.hub.chat_default or self.chat_default) if chat else None) or default or ""
        return self._aliases().get(requested, requested)

    def embedding_model(self, requested: str | None) -> str:
        """The model an embedding request runs on."""
        if requested is None:
            return self.embedding or ""
        return self._aliases().get(requested, requested)

    def aliases_of(self, ref: str, name: str) -> list[str]:
        """The aliases that lead to a model (by its ref or its name), sorted."""
        return sorted(alias for alias, target in self._aliases().items() if target in {ref, name})
