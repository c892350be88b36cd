"""``llama_cpp`` without llama-cpp-python's high-level half until something asks for it.

The package's ``__init__`` imports both halves: the C API (``llama_cpp.llama_cpp``, ctypes
bindings, what the model worker uses) and ``Llama`` with its chat formats, caches and
grammar helpers (``llama_cpp.llama``), which bring jinja2, diskcache with sqlite3 and
multiprocessing: about 10 MiB in every model worker, for nothing it calls. :func:`install`
puts a package module in ``sys.modules`` that holds the C API's names, as the real one
does, and imports ``llama_cpp.llama`` on the first name it lacks (``llama_cpp.Llama``, which
the gateway's vocabulary uses), so ``import llama_cpp`` serves both as before.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from typing import Any


class _Package(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name == "__version__":
            from importlib.metadata import version  # noqa: PLC0415

            return version("llama_cpp_python")
        if name.startswith("__"):
            raise AttributeError(name)
        # The high-level names, as the package's own `from .llama import *` gives them.
        high = importlib.import_module("llama_cpp.llama")
        try:
            value = getattr(high, name)
        except AttributeError:
            raise AttributeError(f"module 'llama_cpp' has no attribute {name!r}") from None
        setattr(self, name, value)
        return value


def install() -> None:
    """The light ``llama_cpp`` package, unless the package is imported already."""
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
    try:
        low = importlib.import_module("llama_cpp.llama_cpp")
    except BaseException:
        del sys.modules["llama_cpp"]
        raise
    # `from .llama_cpp import *`: its public names on the package.
    for name, value in vars(low).items():
        if not name.startswith("_"):
            setattr(package, name, value)
