"""The gRPC API's messages and the REST API's bodies: a request becomes the OpenAI body
its REST route takes, parsed by the same schema (the same bounds, the same errors and
the same `param` names), and a result becomes its reply."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from appliance.grpc.proto.kovenlab.edge.v1 import inference_pb2 as pb
from appliance.inference.bodies import finish_reason, usage
from shared import jsonlimits
from shared.errors import InvalidSchema

if TYPE_CHECKING:
    from appliance.inference.embeddings import Embedded, LoadedModel
    from appliance.serving.engine import Finished
    from appliance.serving.supervisor import Replica

_SAMPLING = ("max_tokens", "temperature", "top_p", "seed", "presence_penalty", "frequency_penalty")


def _sampling(request: pb.GenerateRequest | pb.ChatRequest) -> dict[str, Any]:
    body: dict[str, Any] = {
        name: getattr(request, name) for name in _SAMPLING if request.HasField(name)
    }
    if request.stop:
        body["stop"] = list(request.stop)
    return body


def generate_body(request: pb.GenerateRequest) -> dict[str, Any]:
    """`POST /v1/completions`'s body."""
    return {"model": request.model, "prompt": request.prompt, **_sampling(request)}


def chat_body(request: pb.ChatRequest) -> dict[str, Any]:
    """`POST /v1/chat/completions`'s body."""
    messages = []
    for message in request.messages:
        item: dict[str, Any] = {"role": message.role, "content": message.content}
        if message.HasField("name"):
            item["name"] = message.name
        messages.append(item)
    body: dict[str, Any] = {"model": request.model, "messages": messages, **_sampling(request)}
    if request.HasField("response_format"):
        body["response_format"] = _response_format(request.response_format)
    return body


def _response_format(rf: pb.ResponseFormat) -> dict[str, Any]:
    out: dict[str, Any] = {"type": rf.type or "text"}
    if rf.json_schema or rf.json_schema_name:
        try:
            schema = jsonlimits.loads(rf.json_schema)  # bounded nesting, as every body
        except ValueError as err:
            raise InvalidSchema(
                f"`response_format.json_schema` is not JSON: {err}",
                param="response_format.json_schema",
            ) from err
        out["json_schema"] = {"name": rf.json_schema_name, "schema": schema}
    return out


def embed_body(request: pb.EmbedRequest) -> dict[str, Any]:
    """`POST /v1/embeddings`'s body."""
    body: dict[str, Any] = {"model": request.model, "input": list(request.input)}
    if request.HasField("dimensions"):
        body["dimensions"] = request.dimensions
    return body


def last_reply(finished: Finished) -> pb.GenerateReply:
    """The reply that ends a generation: why it stopped, and what it cost."""
    counts = usage(finished)
    return pb.GenerateReply(
        finish_reason=finish_reason(finished),
        usage=pb.Usage(
            prompt_tokens=counts["prompt_tokens"],
            completion_tokens=counts["completion_tokens"],
            total_tokens=counts["total_tokens"],
            cached_tokens=finished.cached_tokens,
        ),
    )


def embed_reply(embedded: Embedded) -> pb.EmbedReply:
    """The vectors (thousands of floats for a large request: build it off the event loop)."""
    result = embedded.result
    tokens = result.prompt_tokens
    return pb.EmbedReply(
        data=[pb.Embedding(values=row) for row in result.to_lists()],
        model=embedded.model.ref,
        usage=pb.Usage(prompt_tokens=tokens, total_tokens=tokens),
        truncated_inputs=result.truncated,
    )


def completion_model(replica: Replica) -> pb.Model:
    record, layout = replica.record, replica.layout
    return pb.Model(
        id=record.name,
        version=record.version,
        ref=record.ref,
        format=record.format,
        quantization=record.quantization or "",
        sha256=record.sha256,
        context_length=replica.options.n_ctx,
        slots=replica.options.n_slots,
        device=layout.device if layout is not None else "unknown",
    )


def embedding_model(model: LoadedModel) -> pb.Model:
    return pb.Model(
        id=model.name,
        version=model.version,
        ref=model.ref,
        format="onnx",
        quantization="int8",
        sha256=model.sha256,
        provider=model.provider,
        dimension=model.dimension,
    )
