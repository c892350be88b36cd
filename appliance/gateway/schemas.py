"""Request bodies of the HTTP-only routes (the admin API), as pydantic models; those of the
OpenAI-compatible API are `appliance.inference.schemas`."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from appliance.serving.registry import MAX_REPLICAS


class AdminModelRequest(BaseModel):
    """Load a model, or change its replicas or pin."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=200, description="`name` or `name@version`.")
    replicas: int | None = Field(
        None, ge=1, le=MAX_REPLICAS, description="Worker processes serving it (default 1)."
    )
    pinned: bool | None = Field(
        None, description="Pinned models stay loaded and are loaded again at start."
    )
