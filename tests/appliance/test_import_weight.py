"""What the gateway and the model worker import: only what their configuration uses.

Each check runs in a fresh interpreter (this one has imported everything), from this
checkout, and reads its ``sys.modules``. The packages named here cost megabytes of resident
memory each (tests/benchmarks/memory.py measures them): gRPC with protobuf about 20,
numpy 18, zeroconf 14, cryptography 14, wireguard_tools with segno 13, the OpenTelemetry
SDK with its exporter 13, jsonschema 9; llama-cpp-python's high-level half (``Llama``)
brings numpy, jinja2 and diskcache.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from appliance.state.records import ModelRecord

ROOT = Path(__file__).resolve().parents[2]

# As `kvl appliance serve` builds its app (appliance/cli.py), without serving it.
_GATEWAY = """
from pathlib import Path
from appliance.settings import ApplianceSettings
from shared.cli import settings_from
from appliance.app import create_app
from appliance.gateway import server
create_app(settings_from(ApplianceSettings, None, Path({data_dir!r})))
"""
_PRINT = "\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))\n"

# Never in the gateway of the default configuration (discovery off).
GATEWAY_NEVER = (
    "grpc",
    "google.protobuf",
    "appliance.grpc.server",
    "numpy",
    "onnxruntime",
    "zeroconf",
    "opentelemetry.sdk",
    "opentelemetry.exporter",
    "cryptography",
    "pyrage",
    "wireguard_tools",
    "segno",
    "apscheduler",
    "jsonschema",
    "llama_cpp.llama",
)
# Never in the model worker: it speaks JSON lines on its pipes and calls llama.cpp's C API.
WORKER_NEVER = (
    "pydantic",
    "sqlite3",
    "sqlite_utils",
    "aiohttp",
    "asyncio",
    "jinja2",
    "diskcache",
    "psutil",
    "llama_cpp.llama",
)


def _modules(code: str, **env: str) -> set[str]:
    loaded: list[str] = _printed(code + _PRINT, **env)
    return set(loaded)


def _printed(code: str, **env: str) -> Any:
    """The JSON `code` prints last, run in a fresh interpreter from this checkout."""
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,  # `python -c` imports from the current folder first: this checkout
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def _present(modules: set[str], names: tuple[str, ...]) -> list[str]:
    return [n for n in names if any(m == n or m.startswith(n + ".") for m in modules)]


def test_the_default_gateway_imports_none_of_the_optional_features(tmp_path: Path) -> None:
    modules = _modules(
        _GATEWAY.format(data_dir=str(tmp_path)),
        KVL_DISCOVERY__ENABLED="false",
    )
    assert _present(modules, GATEWAY_NEVER) == []
    assert "appliance.app" in modules  # the app was built


def test_the_model_worker_imports_neither_the_gateways_stack_nor_llama_cpps_high_level_half() -> (
    None
):
    # What the worker of a GGUF model imports: itself and its engine (engine_for's choice).
    modules = _modules("import appliance.serving.worker, appliance.serving.batching")
    assert _present(modules, WORKER_NEVER) == []
    assert "numpy" in modules  # its sampler's, and all of what it needs is there


def test_a_scripted_models_worker_never_imports_llama_cpp() -> None:
    modules = _modules("import appliance.serving.worker, appliance.serving.scripted")
    # (`llama_cpp` itself is the light package of appliance/serving/llama_package.py.)
    assert _present(modules, (*WORKER_NEVER, "llama_cpp.llama_cpp", "numpy")) == []


def test_the_gateways_vocabulary_comes_without_llama_cpps_high_level_half(
    default_model: ModelRecord,
) -> None:
    code = (
        "from appliance.serving.engine import LlamaVocabulary\n"
        "from appliance.state.records import ModelRecord\n"
        f"vocab = LlamaVocabulary.load(ModelRecord(**{dataclasses.asdict(default_model)!r}))\n"
        "assert vocab.tokenize('Hello', chat=False)\n"
        "vocab.close()\n"
        "vocab.close()  # twice is harmless\n"
    )
    modules = _modules(code)
    assert _present(modules, ("llama_cpp.llama", "numpy", "diskcache")) == []


@pytest.mark.parametrize(
    "expression",
    [
        "llama_cpp.llama_backend_init",  # the C API's names, as the package has them
        "llama_cpp.LLAMA_TOKEN_NULL",
        "llama_cpp.Llama",  # the high-level half's, imported on first use
        "llama_cpp.LlamaGrammar",
        "llama_cpp.llama",  # a submodule
        "llama_cpp.__version__",
    ],
)
def test_llama_cpp_answers_every_name_as_its_own_package_does(expression: str) -> None:
    code = (
        "import appliance.serving\n"
        "import llama_cpp\n"
        f"light = {expression}\n"
        "assert light is not None\n"
    )
    _modules(code)


def test_llama_cpp_loads_nothing_until_a_name_is_asked_for() -> None:
    modules = _modules("import appliance.serving.engine, llama_cpp")
    assert _present(modules, ("llama_cpp.llama_cpp", "llama_cpp.llama")) == []


# The shared objects of the process in the order they were loaded (the dynamic loader's
# link map, as dl_iterate_phdr walks it), after llama.cpp's C API is imported.
_LOAD_ORDER = """
import ctypes
import appliance.serving
import llama_cpp.llama_cpp

class _Info(ctypes.Structure):
    _fields_ = [("addr", ctypes.c_void_p), ("name", ctypes.c_char_p)]

_Visit = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(_Info), ctypes.c_size_t, ctypes.c_void_p)
order = []

def _visit(info, size, data):
    order.append((info.contents.name or b"").decode().rsplit("/", 1)[-1])
    return 0

ctypes.CDLL(None).dl_iterate_phdr(_Visit(_visit), None)
print(json.dumps(order))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="the link map of glibc's dynamic loader")
def test_the_cxx_runtime_is_loaded_before_any_llama_cpp_library() -> None:
    """A CUDA build's libggml-cuda.so exports `std::` symbols of its own; had it come before
    the C++ runtime in the process's lookup order, llama.cpp's tokenizer would run them and
    the gateway crashed at its first vocabulary load. The runtime comes first, whichever
    libraries llama.cpp brings."""
    order: list[str] = _printed("import json\n" + _LOAD_ORDER)
    runtime = [i for i, name in enumerate(order) if name.startswith("libstdc++.so")]
    llama = [i for i, name in enumerate(order) if name.startswith(("libllama", "libggml"))]
    assert runtime, order
    assert llama, order  # the C API loaded its libraries
    assert runtime[0] < min(llama), order
