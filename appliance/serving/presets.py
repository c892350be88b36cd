"""The hub's presets for the models it placed on this node (protocol.ModelPreset): how each
is loaded (context, slots, KV cache type) and served (default sampling, a system prompt,
stop strings, the tool-call format), and the names it answers to.

They come with the desired state (`meta.desired_models`), so a node that restarts offline
loads its placed models as the hub set them. The node's own `model.aliases` win over the
hub's: the site's operator has the last word on the names its applications use.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

from pydantic import ValidationError

from shared.protocol import ModelPreset

if TYPE_CHECKING:
    from collections.abc import Mapping

log = logging.getLogger(__name__)


class Presets:
    def __init__(self) -> None:
        self._by_ref: dict[str, ModelPreset] = {}
        # alias → ref, updated in place: the gateway's model names read it live.
        self.aliases: dict[str, str] = {}

    def of(self, ref: str) -> ModelPreset | None:
        return self._by_ref.get(ref)

    def set(self, presets: Mapping[str, ModelPreset | None]) -> None:
        """The presets of the models placed here now (ref → preset); the rest are gone."""
        self._by_ref = {ref: p for ref, p in presets.items() if p is not None}
        wanted: dict[str, str] = {}
        for ref, preset in sorted(self._by_ref.items()):
            for alias in preset.aliases:
                # Two placed models claiming one alias: the first by ref, every time.
                wanted.setdefault(alias, ref)
        self.aliases.clear()
        self.aliases.update(wanted)

    def set_desired(self, raw: str | None) -> None:
        """From the desired models as the store keeps them (None: nothing placed)."""
        self.set(from_desired(raw))


def from_desired(raw: str | None) -> dict[str, ModelPreset | None]:
    """ref → preset of the desired models the store keeps (JSON of protocol.PlacedModel)."""
    presets: dict[str, ModelPreset | None] = {}
    for model in json.loads(raw or "[]"):
        ref = f"{model['name']}@{model['version']}"
        try:
            presets[ref] = (
                None if model.get("preset") is None else ModelPreset.model_validate(model["preset"])
            )
        except ValidationError as err:  # checked when it arrived; a later node reads it so
            log.warning("the preset of %s is not one this node reads: %s", ref, err)
            presets[ref] = None
    return presets
