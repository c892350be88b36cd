"""``llama_cpp`` without llama-cpp-python's high-level half until something asks for it.

The package's ``__init__`` imports both halves: the C API (``llama_cpp.llama_cpp``, ctypes
bindings, all the appliance calls) and ``Llama`` with its chat formats, caches and grammar
helpers (``llama_cpp.llama``), which bring numpy, jinja2, diskcache with sqlite3 and
multiprocessing: about 10 MiB in a model worker (which needs numpy anyway) and 20 in the
gateway, for nothing they call. :func:`install` puts a package module in ``sys.modules``
whose names come from the C API, as the real one's do, or, for a name the C API lacks
(``llama_cpp.Llama``, ``LlamaGrammar``), from ``llama_cpp.llama``, imported then; both on
first use, so ``import llama_cpp`` stays free until it is used.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import importlib.util
import sys
import types
from typing import Any

# The C++ runtime's soname on every glibc Linux (found by the dynamic loader's own search).
CXX_RUNTIME = "libstdc++.so.6"


def cxx_runtime() -> None:
    """Load the system's C++ runtime into the process's global symbol scope, before any
    llama.cpp library. Python links no C++ runtime, so the first library loaded that
    brings `std::` symbols decides where every later one's resolve; a CUDA build's
    libggml-cuda.so exports some of its own, and llama.cpp's tokenizer (std::regex, at the
    first vocabulary load) then crashed the gateway with SIGSEGV. Loaded first, the
    runtime's own definitions win, for every library after it. Nothing on a platform
    without it (the import of llama.cpp fails or works there as before)."""
    if sys.platform != "linux":
        return
    with contextlib.suppress(OSError):
        ctypes.CDLL(CXX_RUNTIME, mode=ctypes.RTLD_GLOBAL)


class _Package(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name == "__version__":
            from importlib.metadata import version  # noqa: PLC0415

            return version("llama_cpp_python")
        if name.startswith("__"):
            raise AttributeError(name)
        # `from .llama_cpp import *` then `from .llama import *`, as the package's own
        # __init__ does, each name as it is first asked for.
        low = importlib.import_module("llama_cpp.llama_cpp")
        if not name.startswith("_") and name in vars(low):
            value = vars(low)[name]
        else:
            high = importlib.import_module("llama_cpp.llama")
            if name in vars(self):  # a submodule, set here as it was imported
                return vars(self)[name]
            try:
                value = getattr(high, name)
            except AttributeError:
                raise AttributeError(f"module 'llama_cpp' has no attribute {name!r}") from None
        setattr(self, name, value)
        return value


def install() -> None:
    """The light ``llama_cpp`` package, unless the package is imported already; and the C++
    runtime in the process's global scope first (:func:`cxx_runtime`)."""
    cxx_runtime()
    if "llama_cpp" in sys.modules:
        return
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.submodule_search_locations is None:
        return  # not installed: `import llama_cpp` fails where it is used, as before
    package = _Package("llama_cpp")
    package.__spec__ = spec
    package.__file__ = spec.origin
    package.__path__ = list(spec.submodule_search_locations)
    package.__package__ = "llama_cpp"
    sys.modules["llama_cpp"] = package
