# Kovenlab Edge recipes. `just --list` shows them; the README shows the two that matter.

set shell := ["bash", "-euo", "pipefail", "-c"]

venv := justfile_directory() / ".venv"
py := venv / "bin" / "python"
export PATH := venv / "bin" + ":" + env_var("PATH")
# Python keeps its compiled bytecode (in the ignored __pycache__ folders) even where the
# environment says not to: a test run starts hundreds of Python processes (appliances, hubs,
# model workers, `kvl` commands) and four pytest workers, and without the cache each compiled
# the project again (a worker's collection: 12 s of CPU instead of 5).
export PYTHONDONTWRITEBYTECODE := ""

# Show the recipes
default:
    @just --list

# Install the Debian packages the project runs: wireguard-go (tunnels where the kernel has no
# WireGuard), iproute2, espeak-ng (narration), nginx (HTTP/2 in front of the LAN API, and the
# peer of the package benchmark), nghttp2-client (h2load: the load of the http2 and package
# benchmarks, and the overload benchmark's refusals),
# chromium (the browser tests of the hub's console), postgresql (the hub's store for
# several replicas; the tests and benchmarks start throwaway clusters of their own) and
# prometheus (its `promtool` lints the hub's and the appliance's /metrics and the rules file;
# a test scrapes a hub with it), rauc (the image updater the appliance calls; a test makes
# a bundle, with squashfs-tools, and installs it into file-backed slots), curl and openssl
# (the models benchmark's peers: a pull against curl, and curl with its sha256), age (a
# test opens a sealed backup with the age tool itself, as an operator would without kvl),
# tinyproxy (a site's HTTPS proxy, which a test puts between a node and its hub)
setup-system:
    #!/usr/bin/env bash
    set -euo pipefail
    missing=()
    for package in wireguard-go iproute2 espeak-ng nginx nghttp2-client chromium postgresql prometheus rauc squashfs-tools curl openssl age tinyproxy; do
        dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q 'install ok installed' || missing+=("$package")
    done
    if [ ${#missing[@]} -eq 0 ]; then exit 0; fi
    if ! command -v apt-get > /dev/null; then
        echo "setup-system: not a Debian system; install ${missing[*]} with its package manager (the netns, browser and postgres tests skip until then)" >&2
        exit 0
    fi
    if [ "$(id -u)" -ne 0 ]; then
        echo "setup-system: skipped, not root; run \`sudo .venv/bin/just setup-system\` to install ${missing[*]} (the netns, browser and postgres tests skip until then)" >&2
        exit 0
    fi
    echo "installing ${missing[*]} from Debian" >&2
    log=$(mktemp)
    policy=""
    # nginx, PostgreSQL, Prometheus and tinyproxy are started by the appliance, the benchmarks and the
    # tests (or not at all), not services of this machine: no daemon starts while we install (policy-rc.d), and none
    # is enabled for the next boot.
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        policy=/usr/sbin/policy-rc.d
        printf '#!/bin/sh\nexit 101\n' > "$policy"
        chmod 755 "$policy"
    fi
    trap 'rm -f "$log" ${policy:+"$policy"}' EXIT
    install() { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"; }
    # Refresh the package lists only when the install needs it (a fresh image has none).
    if ! { install || { apt-get update -qq && install; }; } > "$log" 2>&1; then
        cat "$log" >&2
        echo "setup-system failed; apt-get's output is above" >&2
        exit 1
    fi
    if command -v systemctl > /dev/null && [ -d /run/systemd/system ]; then
        for unit in nginx postgresql prometheus tinyproxy; do systemctl disable --now "$unit" > /dev/null 2>&1 || true; done
    fi

# Create .venv and install the project with its dev tools (llama-cpp-python compiles once per CPU and flags, then its wheel is kept)
setup: setup-system
    #!/usr/bin/env bash
    set -euo pipefail
    test -x {{ py }} || python3 -m venv {{ venv }}
    # llama-cpp-python is compiled for this machine's CPU (llama.cpp's GGML_NATIVE), except
    # Intel AMX: with AMX, llama.cpp 0.3.36 dies in its first matrix product on a Sapphire
    # Rapids server (SIGSEGV in ggml_backend_amx_mul_mat), while AVX-512 serves the same
    # model. GCC lets an explicit -mno-… win over the -march=native llama.cpp adds after it.
    no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    cmake_args="${CMAKE_ARGS:--DLLAVA_BUILD=off '-DCMAKE_C_FLAGS=$no_amx' '-DCMAKE_CXX_FLAGS=$no_amx'}"
    llama=$(grep -o '"llama-cpp-python==[^"]*"' pyproject.toml | tr -d '"')
    # pip's wheel cache knows neither CMAKE_ARGS nor the CPU, so a wheel built with other
    # flags, or on another CPU, would be taken as it is: ours is kept by all three.
    key=$(printf '%s\n' "$llama" "$cmake_args" "$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null)" | sha256sum | cut -c1-16)
    wheels="${XDG_CACHE_HOME:-$HOME/.cache}/kovenlab-edge/llama-wheels/$key"
    # Skip pip when pyproject.toml and the wheel's key have not changed since the last
    # successful set-up.
    stamp={{ venv }}/.kvl-setup
    want="$(sha256sum pyproject.toml | cut -d' ' -f1) $key"
    if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then exit 0; fi
    log=$(mktemp)
    pins=$(mktemp)
    trap 'rm -f "$log" "$pins"' EXIT
    if ! ls "$wheels"/llama_cpp_python-*.whl > /dev/null 2>&1; then
        echo "compiling $llama for this CPU (about 13 minutes on 2 cores; once per CPU and flags)" >&2
        rm -rf "$wheels.partial"
        if ! CMAKE_ARGS="$cmake_args" {{ py }} -m pip wheel --quiet --no-deps --no-cache-dir \
                --wheel-dir "$wheels.partial" "$llama" > "$log" 2>&1; then
            cat "$log" >&2
            echo "compiling $llama failed; pip's output is above" >&2
            exit 1
        fi
        mv "$wheels.partial" "$wheels"
    fi
    echo "installing kovenlab-edge and its tools into .venv" >&2
    # Packages installed without their dependencies, each pinned by its wheel's sha256
    # (pyproject.toml's [tool.kovenlab] no-deps says which and why).
    {{ py }} -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["tool"]["kovenlab"]["no-deps"]))' > "$pins"
    # pip's output is shown only if it fails (setuptools' editable-install notices are noise).
    # The wheel of llama-cpp-python is installed again even at the same version: the one
    # there may have been built with other flags.
    if ! { {{ py }} -m pip install --quiet --upgrade pip &&
           {{ py }} -m pip install --quiet --no-deps --force-reinstall "$wheels"/llama_cpp_python-*.whl &&
           {{ py }} -m pip install --quiet --find-links "$wheels" -e '.[dev]' &&
           {{ py }} -m pip install --quiet --no-deps --require-hashes -r "$pins"; } > "$log" 2>&1; then
        cat "$log" >&2
        echo "set-up failed; pip's output is above" >&2
        exit 1
    fi
    echo "$want" > "$stamp"

# Same as setup for nodes with an NVIDIA GPU: onnxruntime-gpu in place of onnxruntime, llama.cpp rebuilt with CUDA
setup-gpu: setup
    {{ py }} -m pip install --quiet -e '.[dev,gpu]'
    {{ py }} -m pip uninstall --yes onnxruntime
    {{ py }} -m pip install --quiet --force-reinstall --no-deps onnxruntime-gpu
    # Only the GPU's own architecture (CMake's `native`): all of them take four times as long.
    CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=native -DLLAVA_BUILD=off ${CMAKE_ARGS:-}" {{ py }} -m pip install --quiet --force-reinstall --no-deps --no-cache-dir llama-cpp-python==0.3.36

# Set up, then start a hub (in a network namespace) and an appliance enrolled with it over
# WireGuard, on the embedded defaults; prints an API key and a curl line (Ctrl-C stops both)
demo port="8080" data=".kvl/demo": setup
    kvl demo --port {{ port }} --data-dir {{ data }}

# ruff (format and lint) and mypy --strict over the whole tree
lint: setup
    ruff format --check .
    ruff check .
    mypy

# Set up and run every test tier this machine can run (unit, model, netns, browser, postgres,
# image) in one run. Four workers, a test module each at a time (its module-scoped servers
# stay in one worker), the slowest modules first (tests/scheduling.py): most of a test's time
# is waiting on processes, servers and tunnels, so they overlap on two cores. The image's
# three QEMU sessions (an update, a rollback, a hub-less site) start first, each on a worker of
# its own, and the rest of the suite runs beside them.
test *args: setup setup-image setup-players lint
    KVL_TESTS=full pytest -n 4 --dist loadfile {{ args }}

# The QTI 3.0 player the export tests render and score the items in: @citolab/qti-components
# from npm (GPL-3.0; a test tool, run in the browser of the tests, never shipped), its
# tarball checked against the sha256 pinned here and unpacked under the cache
setup-players:
    #!/usr/bin/env bash
    set -euo pipefail
    dir="${XDG_CACHE_HOME:-$HOME/.cache}/kovenlab-edge/npm/qti-components-7.27.4"
    if [ -f "$dir/package/cdn/index.global.js" ]; then exit 0; fi
    tarball=$(mktemp)
    trap 'rm -f "$tarball"' EXIT
    curl -fsSL --retry 3 -o "$tarball" https://registry.npmjs.org/@citolab/qti-components/-/qti-components-7.27.4.tgz
    echo "987050c94aa5bebb9509a49b4fb4122103390b51934ace26102e4619ccb482ac  $tarball" | sha256sum -c --quiet
    rm -rf "$dir.partial" && mkdir -p "$dir.partial"
    tar -xzf "$tarball" -C "$dir.partial" package/cdn/index.global.js package/LICENSE.md package/package.json
    rm -rf "$dir" && mv "$dir.partial" "$dir"

# The edit loop's tier: lint, then every test that needs neither the real model (a test that
# takes the model's fixtures is a `model` test whatever its module says), namespaces, the
# browser, PostgreSQL nor the image, on four workers as `just test` runs them; the randomised
# tests try a quarter of their cases (tests/budget.py)
test-fast *args: setup lint
    KVL_TESTS=quick pytest -n 4 --dist loadfile -m "not model and not netns and not browser and not postgres and not image" {{ args }}

# Benchmarks against peers measured in the same run (writes tests/benchmarks/results/*.json):
# serving (one stream vs llama-server), concurrency (1-16 streams and a shared prefix vs
# llama-server -np N), memory (peak RSS of gateway and worker vs llama-server), embeddings
# (batched vs one at a time), overload, sync, fleet,
# placement (the planner at 10,000 nodes), offload (vs a direct call), packages (vs nginx),
# quality (the keys of the packages each embedded model ships, checked by a script),
# chat_quality (the embedded models on twelve instructions), http2 (nginx in front vs
# HTTP/1.1 served by the app), structured (the JSON Schema converter vs llama-cpp-python's
# bundled one and llguidance), image (boot-to-ready time and size of the appliance image;
# root), api (tool calls, n and logprobs vs llama-server; HTTP/2 and gRPC vs HTTP/1.1),
# models (a model's pull vs curl, pull to first token on a node, the memory estimate vs
# resident memory), or all of them
bench suite="all" *args: setup
    #!/usr/bin/env bash
    set -euo pipefail
    case "{{ suite }}" in
        all) suites="serving concurrency memory embeddings overload sync fleet placement offload packages quality chat_quality http2 structured image api models" ;;
        serving|concurrency|memory|embeddings|overload|sync|fleet|placement|offload|packages|quality|chat_quality|http2|structured|image|api|models) suites="{{ suite }}" ;;
        *) echo "just bench: unknown suite '{{ suite }}' (serving, concurrency, memory, embeddings, overload, sync, fleet, placement, offload, packages, quality, chat_quality, http2, structured, image, api, models, all)" >&2; exit 2 ;;
    esac
    for s in $suites; do {{ py }} -m "tests.benchmarks.$s" {{ args }}; done
    {{ py }} -m tests.benchmarks.tables  # the docs' results tables, rewritten from the new results

# On a machine with an NVIDIA GPU: llama.cpp rebuilt with CUDA (setup-gpu), then the serving
# benchmark, and the concurrency one at 1, 8 and 64 streams, against llama-server built with
# CUDA, every layer on the GPU (results in tests/benchmarks/results/gpu-*.json)
bench-gpu: setup-gpu
    KVL_BENCH_GPU=1 {{ py }} -m tests.benchmarks.serving --out tests/benchmarks/results/gpu-serving.json
    KVL_BENCH_GPU=1 {{ py }} -m tests.benchmarks.concurrency --streams 1,8,64 --workloads streams --out tests/benchmarks/results/gpu-concurrency.json

# Install the Debian packages that build and boot the appliance image: mmdebstrap, e2fsprogs,
# dosfstools, mtools and fdisk (the build; mtools also for `kvl image configure`), zstd (the
# compressed download), rauc with squashfs-tools (the signed update bundles), and
# qemu-system-x86 with ovmf (the `image` tests and `just bench image`); needs root
setup-image:
    #!/usr/bin/env bash
    set -euo pipefail
    missing=()
    for package in mmdebstrap e2fsprogs dosfstools mtools fdisk zstd rauc squashfs-tools qemu-system-x86 ovmf; do
        dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q 'install ok installed' || missing+=("$package")
    done
    if [ ${#missing[@]} -eq 0 ]; then exit 0; fi
    if [ "$(id -u)" -ne 0 ] || ! command -v apt-get > /dev/null; then
        # Not fatal: `just test` runs this too, and the image tests skip, saying why.
        echo "setup-image: skipped; install the Debian packages ${missing[*]} as root: \`sudo .venv/bin/just setup-image\` (the image tests skip until then)" >&2
        exit 0
    fi
    echo "installing ${missing[*]} from Debian" >&2
    log=$(mktemp)
    trap 'rm -f "$log"' EXIT
    install() { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"; }
    if ! { install || { apt-get update -qq && install; }; } > "$log" 2>&1; then
        cat "$log" >&2
        echo "setup-image failed; apt-get's output is above" >&2
        exit 1
    fi

# Build the appliance image, image/build/kovenlab-edge.img (raw GPT disk, UEFI, x86-64), its
# download (kovenlab-edge.img.zst and .sha256) and its signed update bundle
# (kovenlab-edge-VERSION.raucb), as root; each step is cached, and a build whose inputs have not
# changed is skipped (--force builds anyway; --signing-cert/--signing-key/--keyring sign with
# an operator's key instead of the build's development CA)
image *args: setup setup-image
    {{ py }} -m image.build {{ args }}

# Generate the gRPC API's code from appliance/grpc/proto/kovenlab/edge/v1/inference.proto (committed;
# tests/appliance/test_grpc_proto.py fails while it differs from what the proto generates)
proto: setup
    {{ py }} -m appliance.grpc.codegen
