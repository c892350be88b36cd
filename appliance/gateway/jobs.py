"""`/v1/jobs`: durable batches of completions (IF-4), with items shaped like OpenAI's Batch API.

    POST   /v1/jobs                {"requests": [{"custom_id", "url", "body"}, ...],
                                    "webhook_url"?, "metadata"?}          → 202, the job
    GET    /v1/jobs                the account's jobs, newest first (paged; admin: all)
    GET    /v1/jobs/{id}           the job: status, progress, webhook delivery
    GET    /v1/jobs/{id}/results   the items' results so far, in request order (paged)
    DELETE /v1/jobs/{id}           cancel it

Every item is validated up front as its route validates a request, so a bad one refuses the
whole job with the error shape and `param` naming it (`requests[3].body.messages`).
"""

from __future__ import annotations

import asyncio
import json
import urllib.parse
from typing import TYPE_CHECKING, Annotated, Any, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, field_validator

from appliance.gateway.appkeys import NAMES, SETTINGS, api_key
from appliance.gateway.parsing import read_json
from appliance.inference.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    ResponseFormatJsonSchema,
    completion_request,
    parse_body,
)
from appliance.jobs.bodies import job_object, result_object
from appliance.jobs.runner import CHAT_URL
from appliance.jobs.service import JobService
from appliance.state.jobs import NewItem
from appliance.validation.structured import SchemaUnusableError, json_schema_output
from shared.errors import ApiError, DomainError, ErrorCode

if TYPE_CHECKING:
    from appliance.inference.names import ModelNames

JOBS = web.AppKey("jobs", JobService)

RESULTS_PAGE = 100
JOBS_PAGE = 20
RESULTS_PAGE_MAX = 1000


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class JobRequestItem(_Body):
    custom_id: str = Field(
        min_length=1,
        max_length=256,
        description="Your id for the item, unique within the job; its result carries it.",
    )
    method: Literal["POST"] = Field("POST", description="Always POST (OpenAI's batch field).")
    url: Literal["/v1/chat/completions", "/v1/completions"] = Field(
        description="The route the item runs as."
    )
    body: dict[str, Any] = Field(
        description="That route's request body, validated as the route does; no `stream`."
    )


class JobRequest(_Body):
    requests: list[JobRequestItem] = Field(
        min_length=1, description="The items, run in order; at most `jobs.max_items`."
    )
    webhook_url: str | None = Field(
        None,
        max_length=2048,
        pattern=r"^[Hh][Tt][Tt][Pp][Ss]?://",
        description=(
            "http(s) URL that gets a signed POST when the job ends (completed, failed or "
            "cancelled); see docs/api.md for verifying it."
        ),
    )
    metadata: (
        Annotated[
            dict[
                Annotated[str, Field(min_length=1, max_length=64)],
                Annotated[str, Field(max_length=512)],
            ],
            Field(max_length=16),
        ]
        | None
    ) = Field(None, description="Up to 16 string pairs of yours, returned with the job.")

    @field_validator("webhook_url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        try:
            url = urllib.parse.urlsplit(value)
            url.port  # noqa: B018 - raises ValueError for a port that is not one
        except ValueError as err:
            raise ValueError(f"not a URL: {err}") from err
        if url.scheme.lower() not in {"http", "https"}:
            raise ValueError("the webhook URL must be http or https")
        if not url.hostname or any(c.isspace() for c in value):
            raise ValueError("the webhook URL needs a host and no spaces")
        return value


async def create_job(request: web.Request) -> web.Response:
    body = await read_json(request)
    req = parse_body(JobRequest, body)
    settings = request.app[SETTINGS]
    if len(req.requests) > settings.jobs.max_items:
        raise ApiError(
            ErrorCode.invalid_value,
            f"a job holds at most {settings.jobs.max_items} requests (`jobs.max_items`); "
            f"this one has {len(req.requests)}",
            param="requests",
        )
    # Thousands of items to validate: off the event loop, which other requests share.
    items, models = await asyncio.to_thread(
        _validate,
        req.requests,
        settings.model.max_tokens_limit,
        request.app[NAMES],
        strict=settings.server.strict_parameters,
    )
    job = await request.app[JOBS].create(
        api_key(request),
        items,
        models=models,
        metadata=req.metadata or {},
        webhook_url=req.webhook_url,
    )
    return web.json_response(
        job_object(job), status=202, headers={"Location": f"/v1/jobs/{job.id}"}
    )


async def get_job(request: web.Request) -> web.Response:
    job = await request.app[JOBS].get(api_key(request), request.match_info["id"])
    return web.json_response(job_object(job))


async def list_jobs(request: web.Request) -> web.Response:
    """The caller's account's jobs, newest first (an admin key: every account's), paged by
    `limit` and `after` (a job id) like the results."""
    limit = _limit(request.query.get("limit"), JOBS_PAGE)
    jobs, more = await request.app[JOBS].list_jobs(
        api_key(request), after=request.query.get("after"), limit=limit
    )
    data = [job_object(j) for j in jobs]
    return web.json_response(
        {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": more,
        }
    )


async def job_results(request: web.Request) -> web.Response:
    limit = _limit(request.query.get("limit"))
    after = request.query.get("after")
    results, more = await request.app[JOBS].results(
        api_key(request), request.match_info["id"], after=after, limit=limit
    )
    data = [result_object(r) for r in results]
    return web.json_response(
        {
            "object": "list",
            "data": data,
            "first_id": data[0]["custom_id"] if data else None,
            "last_id": data[-1]["custom_id"] if data else None,
            "has_more": more,
        }
    )


async def cancel_job(request: web.Request) -> web.Response:
    job = await request.app[JOBS].cancel(api_key(request), request.match_info["id"])
    return web.json_response(job_object(job))


def _limit(raw: str | None, default: int = RESULTS_PAGE) -> int:
    if raw is None:
        return default
    if not raw.isascii() or not raw.isdigit() or not 1 <= int(raw) <= RESULTS_PAGE_MAX:
        raise ApiError(
            ErrorCode.invalid_value,
            f"`limit` must be a whole number from 1 to {RESULTS_PAGE_MAX}",
            param="limit",
        )
    return int(raw)


def _validate(
    requests: list[JobRequestItem], max_tokens_limit: int, names: ModelNames, *, strict: bool
) -> tuple[list[NewItem], dict[str, str]]:
    """The items as their routes would accept them, and each model named (with the `param`
    of its first use); raises the first item's error, its `param` naming the item."""
    items: list[NewItem] = []
    models: dict[str, str] = {}
    first_use: dict[str, int] = {}
    schemas: set[str] = set()  # JSON Schemas already checked (a batch often repeats one)
    for index, item in enumerate(requests):
        where = f"requests[{index}]"
        if item.custom_id in first_use:
            raise ApiError(
                ErrorCode.invalid_value,
                f"`custom_id` {item.custom_id!r} is also that of requests"
                f"[{first_use[item.custom_id]}]; each item needs its own",
                param=f"{where}.custom_id",
            )
        first_use[item.custom_id] = index
        try:
            req = completion_request(item.body, chat=item.url == CHAT_URL, strict=strict)
        except DomainError as err:
            raise ApiError(
                err.code,
                f"{where}.body: {err.message}",
                param=f"{where}.body.{err.param}" if err.param else f"{where}.body",
            ) from err
        _check(req, f"{where}.body", max_tokens_limit, schemas)
        models.setdefault(
            names.generation(req.model, chat=item.url == CHAT_URL), f"{where}.body.model"
        )
        items.append(NewItem(item.custom_id, item.url, item.body))
    return items, models


def _check(
    req: ChatCompletionRequest | CompletionRequest,
    where: str,
    max_tokens_limit: int,
    schemas: set[str],
) -> None:
    """What the route checks beyond the body's schema, short of tokenizing the prompt."""
    if req.stream:
        raise ApiError(
            ErrorCode.unsupported_parameter,
            f"{where}: `stream` is not allowed in a job; results are kept whole",
            param=f"{where}.stream",
        )
    limits = {"max_tokens": req.max_tokens}
    if isinstance(req, ChatCompletionRequest):
        limits["max_completion_tokens"] = req.max_completion_tokens
    for name, value in limits.items():
        if value is not None and value > max_tokens_limit:
            raise ApiError(
                ErrorCode.invalid_value,
                f"{where}: `{name}` is {value}; this appliance allows at most {max_tokens_limit}",
                param=f"{where}.{name}",
            )
    if isinstance(req, ChatCompletionRequest) and isinstance(
        req.response_format, ResponseFormatJsonSchema
    ):
        spec = req.response_format.json_schema
        text = json.dumps(spec.schema_, sort_keys=True)
        if text in schemas:
            return
        try:
            json_schema_output(spec.schema_, spec.name)
        except SchemaUnusableError as err:
            raise ApiError(
                ErrorCode.invalid_schema,
                f"{where}: {err}",
                param=f"{where}.response_format.json_schema.schema",
            ) from err
        schemas.add(text)
