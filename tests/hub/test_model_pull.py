"""`kvl hub models pull`: a reference resolved against a local stand-in for the Hugging
Face Hub (tests/hfhub.py; these machines cannot reach the public one), the file fetched,
resumed after a cut, checked against the repository's sha256, and registered with where it
came from; and each way a pull is refused, with nothing half-registered."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import os
import signal
import subprocess
import sys
from typing import TYPE_CHECKING, Any

import aiohttp
import pytest

from appliance.serving.catalog import CHAT_MODEL_NAME, EMBEDDED
from hub.app import create_app
from hub.identity import ssl_context
from hub.models import huggingface
from hub.models.errors import PullError
from hub.models.inspect import deployment_mib, inspect
from hub.models.pull import Naming, pull
from hub.models.reference import BadReferenceError, HubReference, UrlReference, parse_reference
from hub.reconciler import deployment_of
from hub.state.deployments import DeploymentRecord
from hub.state.store import open_store
from shared.gguf import REPLICA_OVERHEAD_MIB
from tests.conftest import REPO, kvl
from tests.hfhub import Repo, StandIn, split_gguf, tiny_gguf
from tests.hubs import settings_for
from tests.waiting import until

if TYPE_CHECKING:
    from pathlib import Path

    from pytest_aiohttp import AiohttpServer

    from hub.settings import HubSettings

SMOL = "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF"
FILES = {
    "smollm2-135m-instruct-q4_k_m.gguf": tiny_gguf("q4km"),
    "smollm2-135m-instruct-q8_0.gguf": tiny_gguf("q80"),
    "mmproj-smollm2-q4_k_m.gguf": tiny_gguf("mmproj", 1000),
}


# -- references -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        (f"hf://{SMOL}:Q4_K_M", HubReference(SMOL, None, quant="Q4_K_M")),
        (f"hf://{SMOL}:q8_0", HubReference(SMOL, None, quant="Q8_0")),
        (f"hf://{SMOL}@v1.0:IQ4_XS", HubReference(SMOL, "v1.0", quant="IQ4_XS")),
        (f"hf://{SMOL}@refs/pr/3/a/b.gguf", HubReference(SMOL, "refs", path="pr/3/a/b.gguf")),
        (f"hf://{SMOL}/sub/x-Q4_0.gguf", HubReference(SMOL, None, path="sub/x-Q4_0.gguf")),
        ("https://example.com/m.gguf", UrlReference("https://example.com/m.gguf")),
    ],
)
def test_references_are_parsed(text: str, parsed: object) -> None:
    assert parse_reference(text) == parsed
    if isinstance(parsed, HubReference) and parsed.quant:
        assert parse_reference(str(parsed)) == parsed


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "1 to"),
        ("http://example.com/m.gguf", "never plain http"),
        ("ollama://x", "name a model as"),
        ("hf://owner", "not a repository id"),
        ("hf://-owner/repo:Q4_K_M", "not a repository id"),
        ("hf://owner/re..po:Q4_K_M", "not a repository id"),
        (f"hf://{SMOL}", "say which file"),
        (f"hf://{SMOL}:Q4_K_MM", "not a quantisation"),
        (f"hf://{SMOL}:latest", "not a quantisation"),
        (f"hf://{SMOL}/../x.gguf", "not a file of"),
        (f"hf://{SMOL}/model.safetensors", "GGUF files"),
        (f"hf://{SMOL}@:Q4_0", "not a revision"),
        ("hf://" + "a" * 2000, "1 to"),
    ],
)
def test_bad_references_say_why(text: str, why: str) -> None:
    with pytest.raises(BadReferenceError, match=why):
        parse_reference(text)


def _listed(*paths: str) -> list[huggingface._Listed]:
    return [huggingface._Listed(p, 10, "a" * 64) for p in paths]


def test_a_quantisation_names_one_file_as_ollama_and_llama_server_choose_it() -> None:
    files = _listed(
        "Model-Q4_K_S.gguf", "Model-Q4_K_M.gguf", "model.Q8_0.gguf", "mmproj-Model-Q4_K_M.gguf",
        "README.md", "Model-Q4_K.gguf", "big/Model-Q6_K-00001-of-00002.gguf",
        "big/Model-Q6_K-00002-of-00002.gguf",
    )  # fmt: skip

    def pick(quant: str) -> str:
        return " ".join(
            f.path for f in huggingface.pick(HubReference("o/r", None, quant=quant), files)
        )

    assert pick("Q4_K_M") == "Model-Q4_K_M.gguf"  # not the vision projector
    assert pick("Q4_K") == "Model-Q4_K.gguf"  # not Q4_K_M nor Q4_K_S
    assert pick("Q8_0") == "model.Q8_0.gguf"
    with pytest.raises(PullError, match=r"no GGUF file of Q5_K_M \(quantisations there: "
                       r"Q4_K, Q4_K_M, Q4_K_S, Q6_K, Q8_0\)") as refused:  # fmt: skip
        pick("Q5_K_M")
    assert refused.value.kind == "no_quantisation"
    # A split file: all its parts, in order, whichever part a path names.
    assert pick("Q6_K") == "big/Model-Q6_K-00001-of-00002.gguf big/Model-Q6_K-00002-of-00002.gguf"
    second = HubReference("o/r", None, path="big/Model-Q6_K-00002-of-00002.gguf")
    assert [f.path for f in huggingface.pick(second, files)] == pick("Q6_K").split()
    with pytest.raises(PullError, match=r"Model-Q6_K-00002-of-00002.gguf, part 2 of") as gone:
        huggingface.pick(HubReference("o/r", None, quant="Q6_K"), files[:-1])
    assert gone.value.kind == "not_found"
    twice = [*files, *_listed("other/Model-Q8_0.gguf")]
    with pytest.raises(PullError, match="several files of Q8_0"):
        huggingface.pick(HubReference("o/r", None, quant="Q8_0"), twice)


# -- pulls ------------------------------------------------------------------------------------


async def _stand_in(aiohttp_server: AiohttpServer, tmp_path: Path, **repo: Any) -> StandIn:
    stand_in = StandIn({SMOL: Repo(dict(FILES), **repo)}, tmp_path / "stand-in")
    return await stand_in.start(aiohttp_server)


def _hub(tmp_path: Path, stand_in: StandIn, **models: object) -> HubSettings:
    return settings_for(tmp_path, models={"hf_endpoint": stand_in.hub_url, **models})


def _registered(settings: HubSettings) -> list[str]:
    store = open_store(settings)
    try:
        return [m.ref for m in store.deployments.models()]
    finally:
        store.close()


def _leftovers(settings: HubSettings) -> list[str]:
    folder = settings.artifacts_dir
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


async def test_a_pull_pins_the_commit_checks_the_digest_and_says_where_it_came_from(
    aiohttp_server: AiohttpServer, tmp_path: Path
) -> None:
    stand_in = await _stand_in(aiohttp_server, tmp_path)
    settings = _hub(tmp_path, stand_in)
    seen: list[tuple[int, int | None]] = []
    model = await pull(
        f"hf://{SMOL}:Q4_K_M", settings, progress=lambda done, total: seen.append((done, total))
    )
    data = FILES["smollm2-135m-instruct-q4_k_m.gguf"]
    assert (model.name, model.version) == ("smollm2-135m-instruct", "q4_k_m")
    assert model.sha256 == hashlib.sha256(data).hexdigest()
    assert model.size_bytes == len(data)
    assert model.source == (f"hf://{SMOL}@{Repo({}).commit}/smollm2-135m-instruct-q4_k_m.gguf")
    assert model.license == "apache-2.0"
    assert (settings.artifacts_dir / model.sha256).read_bytes() == data
    assert _leftovers(settings) == [model.sha256]  # no part, no sidecar
    assert seen[0] == (0, len(data))
    assert seen[-1] == (len(data), len(data))
    # Named by the operator; by path; an https:// URL (no listing to check it against).
    named = await pull(
        f"hf://{SMOL}/smollm2-135m-instruct-q8_0.gguf", settings, Naming("smol", "8")
    )
    assert (named.ref, named.version) == ("smol@8", "8")
    url = f"{stand_in.storage_url}/blobs/{named.sha256}".replace("http://", "https://")
    with pytest.raises(PullError, match=r"TLS .* failed"):  # no TLS there
        await pull(url, settings)


async def test_the_token_goes_to_the_hub_only_and_a_gated_repo_without_it_is_refused(
    aiohttp_server: AiohttpServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stand_in = await _stand_in(aiohttp_server, tmp_path, gated_token="hf_right")
    settings = _hub(tmp_path, stand_in)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with pytest.raises(PullError, match="is gated: accept its conditions") as refused:
        await pull(f"hf://{SMOL}:Q4_K_M", settings)
    assert refused.value.kind == "gated"
    wrong = _hub(tmp_path, stand_in, hf_token="hf_wrong")
    with pytest.raises(PullError, match="the token has no access"):
        await pull(f"hf://{SMOL}:Q4_K_M", wrong)
    monkeypatch.setenv("HF_TOKEN", "hf_right")  # as huggingface_hub reads it
    model = await pull(f"hf://{SMOL}:Q4_K_M", settings)
    assert model.sha256 == hashlib.sha256(FILES["smollm2-135m-instruct-q4_k_m.gguf"]).hexdigest()
    assert stand_in.seen.listing_auth[-1] == "Bearer hf_right"
    assert stand_in.seen.storage_auth == [None]  # the redirect's host never saw it
    assert _registered(settings) == []  # pull() fetches; the command registers


async def test_a_cut_download_resumes_where_it_stopped(
    aiohttp_server: AiohttpServer, tmp_path: Path
) -> None:
    stand_in = await _stand_in(aiohttp_server, tmp_path)
    stand_in.faults.cut_after, stand_in.faults.cuts = 1 << 20, 2
    settings = _hub(tmp_path, stand_in)
    model = await pull(f"hf://{SMOL}:Q4_K_M", settings)
    assert model.sha256 == hashlib.sha256(FILES["smollm2-135m-instruct-q4_k_m.gguf"]).hexdigest()
    # Each try asks for the rest from what arrived (what of a cut answer arrives is the
    # kernel's business).
    first, *resumed = stand_in.seen.ranges
    offsets = [int(r.removeprefix("bytes=").removesuffix("-")) for r in resumed if r]
    assert (first, len(resumed)) == (None, 2)
    assert 0 < offsets[0] < offsets[1] < len(FILES["smollm2-135m-instruct-q4_k_m.gguf"])


async def test_a_pull_killed_mid_file_goes_on_from_there_when_run_again(
    aiohttp_server: AiohttpServer, tmp_path: Path
) -> None:
    stand_in = await _stand_in(aiohttp_server, tmp_path)
    stand_in.faults.stall_after = 1 << 20
    settings = _hub(tmp_path, stand_in)
    data_dir = ["--data-dir", str(settings.data_dir)]
    env = {**os.environ, "HF_ENDPOINT": stand_in.hub_url}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "shared.cli", "hub", "models", "pull", f"hf://{SMOL}:Q4_K_M",
        *data_dir, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        await until(lambda: stand_in.seen.sent == 1 << 20, "the first MiB to go out")
        await until(lambda: _leftovers(settings) and (settings.pulls_dir).exists() and any(
            p.stat().st_size == 1 << 20 for p in settings.pulls_dir.glob("*.part")),
            "the first MiB on disk")  # fmt: skip
    finally:
        process.send_signal(signal.SIGKILL)
        await process.wait()
    assert _registered(settings) == []
    stand_in.faults.stall_after = None
    done = await asyncio.to_thread(
        kvl, "hub", "models", "pull", f"hf://{SMOL}:Q4_K_M", *data_dir,
        env={"HF_ENDPOINT": stand_in.hub_url},
    )  # fmt: skip
    assert "model smollm2-135m-instruct@q4_k_m: hf://" in done.stdout
    assert stand_in.seen.ranges[-1] == "bytes=1048576-"
    listed = await asyncio.to_thread(kvl, "hub", "models", "list", *data_dir)
    assert f"@{Repo({}).commit}/smollm2-135m-instruct-q4_k_m.gguf  (apache-2.0)" in listed.stdout
    again = await asyncio.to_thread(
        kvl, "hub", "models", "pull", f"hf://{SMOL}:Q4_K_M", *data_dir,
        env={"HF_ENDPOINT": stand_in.hub_url},
    )  # fmt: skip
    assert "is there already" in again.stdout


async def test_a_file_whose_bytes_are_not_the_listed_ones_is_deleted_and_not_kept(
    aiohttp_server: AiohttpServer, tmp_path: Path
) -> None:
    stand_in = await _stand_in(
        aiohttp_server, tmp_path, listed_sha256={"smollm2-135m-instruct-q4_k_m.gguf": "0" * 64}
    )
    settings = _hub(tmp_path, stand_in)
    with pytest.raises(PullError, match="deleted, not kept: its sha256 is") as refused:
        await pull(f"hf://{SMOL}:Q4_K_M", settings)
    assert refused.value.kind == "checksum_mismatch"
    assert _leftovers(settings) == []


@pytest.mark.parametrize(
    ("reference", "kind", "message"),
    [
        ("hf://nobody/nothing:Q4_K_M", "not_found", "no such repository"),
        (f"hf://{SMOL}@v9:Q4_K_M", "not_found", "no such revision"),
        (f"hf://{SMOL}/absent.gguf", "not_found", "not a file of the repository"),
        (f"hf://{SMOL}:Q5_K_M", "no_quantisation", "quantisations there: Q4_K_M, Q8_0"),
    ],
)
async def test_what_is_not_there_gets_a_clear_error(
    aiohttp_server: AiohttpServer, tmp_path: Path, reference: str, kind: str, message: str
) -> None:
    stand_in = await _stand_in(aiohttp_server, tmp_path)
    settings = _hub(tmp_path, stand_in)
    with pytest.raises(PullError, match=message) as refused:
        await pull(reference, settings)
    assert refused.value.kind == kind
    assert stand_in.seen.storage_auth == []  # nothing fetched


async def test_bounds_refuse_before_the_download_and_a_rate_limit_says_when(
    aiohttp_server: AiohttpServer, tmp_path: Path
) -> None:
    stand_in = await _stand_in(aiohttp_server, tmp_path)
    small = _hub(tmp_path, stand_in, max_pull_bytes=1 << 20)
    with pytest.raises(PullError, match="over the hub's bound of 1 MiB") as refused:
        await pull(f"hf://{SMOL}:Q4_K_M", small)
    assert refused.value.kind == "too_large"
    full = _hub(tmp_path, stand_in, keep_free_bytes=1 << 60)
    with pytest.raises(PullError, match="free in the hub's data directory") as no_room:
        await pull(f"hf://{SMOL}:Q4_K_M", full)
    assert no_room.value.kind == "disk_full"
    stand_in.faults.rate_limited = 1
    with pytest.raises(PullError, match="rate limiting the hub; try again in 7 s") as limited:
        await pull(f"hf://{SMOL}:Q4_K_M", _hub(tmp_path, stand_in))
    assert limited.value.retry_after_s == 7
    assert _leftovers(full) == []


# -- inspection -------------------------------------------------------------------------------


async def test_a_real_gguf_is_inspected_and_a_replica_estimated_from_it(
    aiohttp_server: AiohttpServer, tmp_path: Path
) -> None:
    smol = EMBEDDED[CHAT_MODEL_NAME].sources()[0].read_bytes()
    stand_in = StandIn(
        {SMOL: Repo({"SmolLM2-135M-Instruct-Q4_1.gguf": smol})}, tmp_path / "stand-in"
    )
    await stand_in.start(aiohttp_server)
    settings = _hub(tmp_path, stand_in)
    model = await pull(f"hf://{SMOL}:Q4_1", settings)
    assert model.inspection == {
        "architecture": "llama",
        "parameters": 134_515_008,
        "quantisation": "Q4_1",
        "context_length": 8192,
        "tokenizer": "gpt2",
        "chat_template": "gguf",  # its own, which renders the test conversation
        "template_error": None,
        # 30 layers, 3 KV heads of 64 for K and for V, none sliding
        "kv_per_token": 30 * 3 * (64 + 64),
        "kv_per_token_sliding": 0,
        "sliding_window": 0,
    }
    # Weights, an f16 KV cache for 4 slots of 4096 tokens and the prefix store, overhead.
    kv = (4 * 4096 + 4095) * 11_520 * 2
    assert model.memory_mib == round((len(smol) + kv) / 2**20 + REPLICA_OVERHEAD_MIB)
    store = open_store(settings)
    try:
        store.deployments.add_model(model)
    finally:
        store.close()
    listed = await asyncio.to_thread(
        kvl, "hub", "models", "list", "--data-dir", str(settings.data_dir)
    )
    assert f"{model.memory_mib} MiB/replica  llama 135M Q4_1  hf://{SMOL}@" in listed.stdout

    # A deployment whose preset loads it otherwise needs what that preset makes of it: here
    # 2 slots of 1024 tokens (and the store) at q8_0, 34 bytes for 32 elements.
    preset = {"n_ctx": 1024, "n_slots": 2, "kv_type": "q8_0", "aliases": ["chat"]}
    kv_q8 = (2 * 1024 + 1023) * 11_520 * 34 / 32
    record = DeploymentRecord("d", model.ref, 1, "S1", "I1", {}, preset)
    planned = deployment_of(record, {model.ref: model})
    assert planned.memory_mib == round((len(smol) + kv_q8) / 2**20 + REPLICA_OVERHEAD_MIB)
    assert planned.memory_mib < model.memory_mib
    assert planned.gpu_memory_mib == 0  # not a GPU deployment
    # On a GPU it needs that much of the GPU's memory, unless the operator said otherwise.
    on_gpu = DeploymentRecord("g", model.ref, 1, "S1", "I1", {"gpu": True}, preset)
    assert deployment_of(on_gpu, {model.ref: model}).gpu_memory_mib == planned.memory_mib
    told = DeploymentRecord("t", model.ref, 1, "S1", "I1", {"gpu": True, "gpu_memory_mib": 900})
    assert deployment_of(told, {model.ref: model}).gpu_memory_mib == 900
    # A preset that changes nothing of the load: the model's own figure.
    assert deployment_mib(model, {"aliases": ["chat"]}) == model.memory_mib


async def test_a_split_file_is_fetched_part_by_part_and_kept_as_one(
    aiohttp_server: AiohttpServer, tmp_path: Path
) -> None:
    """A split GGUF file (three parts, each with its own LFS sha256) pulled by its
    quantisation: each part fetched and checked, a cut one resumed, the parts joined into
    the very bytes of the whole file, and only that kept; a part whose bytes are not the
    listed ones fails the pull, and nothing is kept."""
    smol = EMBEDDED[CHAT_MODEL_NAME].sources()[0].read_bytes()
    parts = split_gguf(smol, 3)
    names = [f"SmolLM2-135M-Instruct-Q4_1-{n:05d}-of-00003.gguf" for n in (1, 2, 3)]
    repo = Repo(dict(zip(names, parts, strict=True)))
    stand_in = await StandIn({SMOL: repo}, tmp_path / "stand-in").start(aiohttp_server)
    stand_in.faults.cut_after, stand_in.faults.cuts = 1 << 20, 1
    settings = _hub(tmp_path / "hub", stand_in)
    seen: list[tuple[int, int | None]] = []
    model = await pull(
        f"hf://{SMOL}:Q4_1", settings, progress=lambda done, total: seen.append((done, total))
    )
    assert (model.name, model.version) == ("smollm2-135m-instruct", "q4_1")
    assert (model.sha256, model.size_bytes) == (hashlib.sha256(smol).hexdigest(), len(smol))
    assert model.source == f"hf://{SMOL}@{repo.commit}/{names[0]}"
    assert model.inspection is not None
    assert model.inspection["parameters"] == 134_515_008
    assert _leftovers(settings) == [model.sha256]  # the parts gone, the joined file kept
    total = sum(len(p) for p in parts)
    assert seen[-1] == (total, total)
    assert all(a[0] <= b[0] for a, b in itertools.pairwise(seen))
    assert any(r is not None and r.startswith("bytes=") for r in stand_in.seen.ranges)

    repo.listed_sha256[names[1]] = "0" * 64
    again = _hub(tmp_path / "again", stand_in)
    with pytest.raises(PullError, match="deleted, not kept") as refused:
        await pull(f"hf://{SMOL}:Q4_1", again)
    assert refused.value.kind == "checksum_mismatch"
    assert _leftovers(again) == [f"pulls/{hashlib.sha256(parts[0]).hexdigest()}.part"]


def test_a_template_that_does_not_render_is_said_and_a_bad_header_refused(
    tmp_path: Path,
) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(
        tiny_gguf("t", 4096, {"tokenizer.chat_template": "{{ raise_exception('no system') }}"})
    )
    seen = inspect(broken)
    assert (seen.chat_template, seen.template_error) == ("gguf", "no system")
    settings = settings_for(tmp_path)
    added = kvl(
        "hub", "models", "add", str(broken), "--name", "b", "--version", "1",
        "--data-dir", str(settings.data_dir),
    )  # fmt: skip
    assert "its own chat template (does not render: no system)" in added.stdout
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + b"\xff" * 64)
    refused = kvl(
        "hub", "models", "add", str(corrupt), "--name", "c", "--version", "1",
        "--data-dir", str(settings.data_dir), check=False,
    )  # fmt: skip
    assert refused.returncode == 2
    assert "not a GGUF model the hub can read" in refused.stderr
    assert _registered(settings) == ["b@1"]


# -- the operator API: pulls as durable jobs --------------------------------------------------


async def test_the_operator_api_pulls_as_a_job_with_progress_and_cancel(
    aiohttp_server: AiohttpServer, tmp_path: Path
) -> None:
    stand_in = await _stand_in(aiohttp_server, tmp_path)
    settings = _hub(tmp_path, stand_in)
    store = open_store(settings)
    try:
        operator = store.operators.create("ops").plaintext
    finally:
        store.close()
    hub = await aiohttp_server(create_app(settings), ssl=ssl_context(settings))
    auth = {"Authorization": f"Bearer {operator}"}
    async with aiohttp.ClientSession(headers=auth) as session:

        async def call(method: str, path: str, **kw: Any) -> tuple[int, dict[str, Any]]:
            async with session.request(method, hub.make_url(path), ssl=False, **kw) as answer:
                return answer.status, await answer.json()

        async def finished(pull_id: str) -> dict[str, Any]:
            async def state() -> dict[str, Any] | None:
                _, pull = await call("GET", f"/v1/admin/models/pulls/{pull_id}")
                return pull if pull["state"] in {"done", "failed", "cancelled"} else None

            found: dict[str, Any] = await until(state, f"pull {pull_id} to finish")
            return found

        status, bad = await call("POST", "/v1/admin/models", json={"reference": "ollama://x"})
        assert (status, bad["error"]["code"], bad["error"]["param"]) == (
            400, "invalid_value", "reference",
        )  # fmt: skip
        status, queued = await call(
            "POST", "/v1/admin/models", json={"reference": f"hf://{SMOL}:Q4_K_M", "name": "smol"}
        )
        assert (status, queued["created_by"]) == (202, "ops")
        done = await finished(queued["id"])
        data = FILES["smollm2-135m-instruct-q4_k_m.gguf"]
        assert (done["state"], done["model"]) == ("done", "smol@q4_k_m")
        assert done["done_bytes"] == done["total_bytes"] == len(data)
        assert _registered(settings) == ["smol@q4_k_m"]
        status, late = await call("DELETE", f"/v1/admin/models/pulls/{queued['id']}")
        assert (status, late["error"]["code"]) == (409, "job_finished")
        # A gated repository without a token: the job fails, saying why; nothing registered.
        status, gated = await call(
            "POST", "/v1/admin/models", json={"reference": "hf://nobody/nothing:Q4_K_M"}
        )
        failed = await finished(gated["id"])
        assert (failed["state"], failed["error_kind"]) == ("failed", "not_found")
        # Cancelled mid-file: stopped, nothing registered.
        stand_in.faults.stall_after = 1 << 20
        status, stalled = await call(
            "POST", "/v1/admin/models", json={"reference": f"hf://{SMOL}:Q8_0"}
        )
        await until(lambda: stand_in.seen.sent >= 1 << 20, "the first MiB to go out")
        status, cancelled = await call("DELETE", f"/v1/admin/models/pulls/{stalled['id']}")
        assert (status, cancelled["state"]) == (200, "cancelled")
        assert (await finished(stalled["id"]))["state"] == "cancelled"
        assert _registered(settings) == ["smol@q4_k_m"]
        status, listed = await call("GET", "/v1/admin/models/pulls")
        assert [p["state"] for p in listed["data"]] == ["cancelled", "failed", "done"]
        status, missing = await call("GET", "/v1/admin/models/pulls/pull_nothing")
        assert (status, missing["error"]["code"]) == (404, "not_found")
    await hub.close()


async def test_a_pull_the_hub_was_running_when_it_stopped_goes_on_at_its_next_start(
    aiohttp_server: AiohttpServer, tmp_path: Path
) -> None:
    stand_in = await _stand_in(aiohttp_server, tmp_path)
    settings = _hub(tmp_path, stand_in)
    store = open_store(settings)
    try:
        created = store.pulls.create(f"hf://{SMOL}:Q4_K_M", None, None, None, "ops")
        claimed = store.pulls.claim()  # the hub stopped while running it
        assert claimed is not None
        assert claimed.state == "running"
    finally:
        store.close()
    await aiohttp_server(create_app(settings), ssl=ssl_context(settings))

    def state() -> str:
        store = open_store(settings)
        try:
            return store.pulls.get(created.id).state
        finally:
            store.close()

    await until(lambda: state() == "done", "the pull to go on and finish")
    assert _registered(settings) == ["smollm2-135m-instruct@q4_k_m"]
