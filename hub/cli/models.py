"""`kvl hub models …`, `kvl hub deploy`, `kvl hub undeploy` and `kvl hub deployments`: the
model files the hub places, and the deployments of them across the fleet."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import click

from hub.cli.common import hub_settings, opened_store
from shared.cli import common_options, config_errors_exit
from shared.modelfiles import model_format

if TYPE_CHECKING:
    from typing import Any

    from hub.state.deployments import ModelArtifact


# What one replica needs, when the operator knows better than the file's estimate.
_memory_mib = click.option(
    "--memory-mib",
    type=click.IntRange(1),
    default=None,
    help="What one replica needs on a node (default: estimated from the file).",
)


@click.group("models")
def models() -> None:
    """Model files the hub places on nodes (stored by sha256, fetched through the tunnel)."""


@models.command("add")
@common_options
@click.argument("file", type=click.Path(path_type=Path, dir_okay=False, exists=True))
@click.option("--name", required=True, help="Model name (as clients ask for it).")
@click.option("--version", required=True, help="Its version: deployments name `name@version`.")
@_memory_mib
@config_errors_exit
def models_add(
    config_file: Path | None,
    data_dir: Path | None,
    file: Path,
    *,
    name: str,
    version: str,
    memory_mib: int | None,
) -> None:
    """Register a model file (GGUF, or a model script): inspected (a GGUF that cannot be
    read is refused), copied into the hub's data directory under its sha256."""
    import hashlib  # noqa: PLC0415
    import shutil  # noqa: PLC0415

    from hub.state.deployments import ModelArtifact  # noqa: PLC0415

    kind = model_format(file)
    if kind is None:
        raise click.BadParameter(
            f"{file} is neither a GGUF file nor a model script", param_hint="FILE"
        )
    inspection = None
    if kind == "gguf":
        from hub.models.errors import PullError  # noqa: PLC0415
        from hub.models.inspect import inspect  # noqa: PLC0415

        try:
            inspection = inspect(file)
        except PullError as err:
            raise click.BadParameter(str(err), param_hint="FILE") from err
    settings = hub_settings(config_file, data_dir)
    digest = hashlib.sha256()
    with file.open("rb") as source:
        while chunk := source.read(1 << 20):
            digest.update(chunk)
    sha256 = digest.hexdigest()
    size = file.stat().st_size
    settings.artifacts_dir.mkdir(parents=True, exist_ok=True)
    target = settings.artifacts_dir / sha256
    if not target.exists():
        partial = target.with_suffix(".part")
        shutil.copyfile(file, partial)
        partial.replace(target)
    estimate = inspection.replica_mib(size) if inspection else (size >> 20) + 512
    model = ModelArtifact(
        name, version, sha256, size, kind, memory_mib or estimate,
        inspection=None if inspection is None else inspection.as_json(),
    )  # fmt: skip
    with opened_store(settings) as store:
        store.deployments.add_model(model)
    click.echo(f"model {model.ref}: sha256 {sha256}, {size >> 20} MiB{_described(model)}")


def _described(model: ModelArtifact) -> str:
    """`, llama 135M Q4_1, trained for 8192 tokens, its own chat template, 944 MiB a
    replica` (what the inspection found, and the estimate)."""
    seen = model.inspection or {}
    parts = []
    what = " ".join(
        x for x in (seen.get("architecture"), _count(seen.get("parameters")),
                    seen.get("quantisation")) if x
    )  # fmt: skip
    if what:
        parts.append(what)
    if seen.get("context_length"):
        parts.append(f"trained for {seen['context_length']} tokens")
    if seen:
        template = seen.get("chat_template", "")
        whose = "its own chat template" if template == "gguf" else f"chat template {template}"
        parts.append(
            whose
            + (
                f" (does not render: {seen['template_error']})"
                if seen.get("template_error")
                else ""
            )
        )
    parts.append(f"{model.memory_mib} MiB a replica")
    return "".join(f", {p}" for p in parts)


def _count(parameters: object) -> str | None:
    if not isinstance(parameters, int):
        return None
    for unit, size in (("B", 10**9), ("M", 10**6)):
        if parameters >= size:
            return f"{parameters / size:.3g}{unit}"
    return str(parameters)


@models.command("pull")
@common_options
@click.argument("reference")
@click.option("--name", default=None, help="Model name (default: the repository's, or the file's).")
@click.option(
    "--version", default=None, help="Its version (default: the quantisation, e.g. q4_k_m)."
)
@_memory_mib
@config_errors_exit
def models_pull(
    config_file: Path | None,
    data_dir: Path | None,
    reference: str,
    *,
    name: str | None,
    version: str | None,
    memory_mib: int | None,
) -> None:
    """Pull a GGUF model into the hub and register it: hf://OWNER/REPO[@REVISION]:QUANT (the
    repository's file of that quantisation), hf://OWNER/REPO[@REVISION]/FILE.gguf, or an
    https:// URL. The revision is pinned to the commit it names now and the file checked
    against the sha256 the repository lists; a pull cut off goes on from where it stopped
    when run again. `models.hf_endpoint` (or HF_ENDPOINT) names a mirror of the Hugging Face
    Hub, `models.hf_token` (or HF_TOKEN) a token for gated repositories."""
    import asyncio  # noqa: PLC0415

    from hub.models.errors import PullError  # noqa: PLC0415
    from hub.models.pull import Naming, pull  # noqa: PLC0415
    from shared.progress import ProgressBar  # noqa: PLC0415

    settings = hub_settings(config_file, data_dir)
    bar: ProgressBar | None = None

    def progress(done: int, total: int | None) -> None:
        nonlocal bar
        if bar is None and total:
            bar = ProgressBar(reference, total)
        if bar is not None:
            bar.update(done)

    try:
        model = asyncio.run(
            pull(reference, settings, Naming(name, version, memory_mib), progress=progress)
        )
    except PullError as err:
        raise click.ClickException(str(err)) from err
    except KeyboardInterrupt:
        raise click.ClickException("interrupted: the same pull goes on from here") from None
    if bar is not None:
        bar.finish()
    with opened_store(settings) as store:
        known = {m.ref: m for m in store.deployments.models()}.get(model.ref)
        if known is not None and known.sha256 == model.sha256:
            click.echo(f"model {model.ref} is there already: sha256 {model.sha256}")
            return
        store.deployments.add_model(model)
    click.echo(
        f"model {model.ref}: {model.source}, sha256 {model.sha256}, "
        f"{model.size_bytes >> 20} MiB" + (f", licence {model.license}" if model.license else "")
        + _described(model)
    )  # fmt: skip


@models.command("list")
@common_options
@config_errors_exit
def models_list(config_file: Path | None, data_dir: Path | None) -> None:
    """List the models: ref, sha256, size, memory a replica, where each was pulled from
    and its licence."""
    with opened_store(hub_settings(config_file, data_dir)) as store:
        rows = store.deployments.models()
    for m in rows:
        seen = m.inspection or {}
        what = " ".join(
            str(x) for x in (seen.get("architecture"), _count(seen.get("parameters")),
                             seen.get("quantisation")) if x
        )  # fmt: skip
        click.echo(
            f"{m.ref:<32} {m.sha256[:16]}  {m.size_bytes >> 20} MiB  {m.memory_mib} MiB/replica"
            + (f"  {what}" if what else "")
            + (f"  {m.source}" if m.source else "")
            + (f"  ({m.license})" if m.license else "")
        )


@click.command("deploy")
@common_options
@click.argument("model")
@click.option("--replicas", type=click.IntRange(0, 10_000), default=1, help="Across the fleet (1).")
@click.option(
    "--class", "service_class", type=click.Choice(["S0", "S1", "S2", "S3", "S4"]), default="S1"
)
@click.option("--site", "sites", multiple=True, help="Only these sites (repeat).")
@click.option("--region", "regions", multiple=True, help="Only these regions (repeat).")
@click.option("--label", "labels", multiple=True, help="KEY=VALUE a node must carry (repeat).")
@click.option("--gpu", is_flag=True, help="Needs a GPU.")
@click.option("--gpu-memory-mib", type=click.IntRange(0), default=0, help="GPU memory needed.")
@click.option("--tenant", default=None, help="S3: only nodes dedicated to this tenant.")
@click.option(
    "--isolation",
    type=click.Choice(["I1", "I2", "I3"]),
    default="I1",
    help="I1 its own process, I2 and a cgroup with limits, I3 I2 on its tenant's nodes (I1).",
)
@click.option("--context", "n_ctx", type=int, help="Context per slot, in tokens (the node's).")
@click.option("--slots", "n_slots", type=int, help="Sequences decoded together (the node's).")
@click.option("--kv-type", type=click.Choice(["f16", "q8_0", "q4_0"]), help="KV cache (f16).")
@click.option("--alias", "aliases", multiple=True, help="A name it answers to (repeat).")
@click.option("--system-prompt", help="Put first in a chat that has no system message.")
@click.option("--temperature", type=float, help="Default sampling: a request's own wins.")
@click.option("--top-p", type=float, help="Default nucleus sampling.")
@click.option("--top-k", type=int, help="Default top-k (0: off).")
@click.option("--min-p", type=float, help="Default min-p (0: off).")
@click.option("--repeat-penalty", type=float, help="Default repeat penalty (1: off).")
@click.option("--stop", "stops", multiple=True, help="A stop string for every request (repeat).")
@click.option(
    "--tool-format",
    type=click.Choice(["auto", "generic", "hermes"]),
    default="auto",
    help="Tool calls: the template's own (auto), generic JSON, or hermes <tool_call>.",
)
@config_errors_exit
def deploy(
    config_file: Path | None,
    data_dir: Path | None,
    model: str,
    *,
    replicas: int,
    service_class: str,
    sites: tuple[str, ...],
    regions: tuple[str, ...],
    labels: tuple[str, ...],
    gpu: bool,
    gpu_memory_mib: int,
    tenant: str | None,
    isolation: str,
    aliases: tuple[str, ...],
    stops: tuple[str, ...],
    **preset_options: Any,
) -> None:
    """Deploy MODEL (name@version) on the fleet; the placement reconciler picks the nodes.
    The preset options set how its nodes load and serve it. Prints the deployment's id
    (and on stderr the memory a replica needs)."""
    import uuid  # noqa: PLC0415

    from pydantic import ValidationError  # noqa: PLC0415

    from hub.models.inspect import deployment_mib  # noqa: PLC0415
    from hub.state.deployments import DeploymentRecord  # noqa: PLC0415
    from shared.protocol import ModelPreset  # noqa: PLC0415

    if service_class == "S3" and not tenant:
        raise click.BadParameter("an S3 (dedicated) deployment names its --tenant")
    if isolation == "I3" and not tenant:
        raise click.BadParameter("an I3 deployment names its --tenant")
    pairs = {}
    for label in labels:
        key, sep, value = label.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{label!r} is not KEY=VALUE", param_hint="--label")
        pairs[key] = value
    given = {k: v for k, v in preset_options.items() if v is not None and v != "auto"}
    if aliases:
        given["aliases"] = list(aliases)
    if stops:
        given["stop"] = list(stops)
    try:
        preset = ModelPreset.model_validate(given).model_dump(exclude_defaults=True)
    except ValidationError as err:
        problem = err.errors()[0]
        where = ".".join(str(p) for p in problem["loc"])
        raise click.BadParameter(f"{where}: {problem['msg']}") from None
    record = DeploymentRecord(
        id=uuid.uuid4().hex[:12],
        model=model,
        replicas=replicas,
        service_class=service_class,
        isolation=isolation,
        constraints={"sites": list(sites), "regions": list(regions), "labels": pairs,
                     "gpu": gpu, "gpu_memory_mib": gpu_memory_mib, "tenant": tenant},
        preset=preset or None,
    )  # fmt: skip
    with opened_store(hub_settings(config_file, data_dir)) as store:
        store.deployments.add(record)
        artifact = {m.ref: m for m in store.deployments.models()}[model]
    click.echo(record.id)
    click.echo(f"{deployment_mib(artifact, record.preset)} MiB a replica", err=True)


@click.command("undeploy")
@common_options
@click.argument("deployment")
@config_errors_exit
def undeploy(config_file: Path | None, data_dir: Path | None, deployment: str) -> None:
    """Remove a deployment: its replicas are unloaded from the nodes."""
    with opened_store(hub_settings(config_file, data_dir)) as store:
        serial = store.deployments.remove(deployment)
    click.echo(f"undeployed {deployment}; desired state serial {serial}")


@click.command("deployments")
@common_options
@click.option("--json", "as_json", is_flag=True, help="Print JSON lines.")
@config_errors_exit
def deployments(config_file: Path | None, data_dir: Path | None, as_json: bool) -> None:
    """List deployments: model, replicas wanted and where they run."""
    from hub.views import deployment_view  # noqa: PLC0415

    with opened_store(hub_settings(config_file, data_dir)) as store:
        rows = store.deployments.all()
        placed = store.deployments.placements()
        names = store.nodes.names()
    for d in rows:
        view = deployment_view(d, placed, names)
        nodes = view["nodes"]
        if as_json:
            click.echo(json.dumps(view))
        else:
            click.echo(
                f"{d.id:<14} {d.model:<28} {d.service_class} {len(nodes)}/{d.replicas}  "
                f"{', '.join(nodes) or '-'}"
            )
