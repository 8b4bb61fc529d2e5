#!/usr/bin/env bash
# A wheelhouse for installing zoo on a GPU node without internet (benchmarks/README.md, "Offline install").
# Run it where there is internet, with a Python of the node's minor version (or set WHEEL_PYTHON):
#
#     benchmarks/wheelhouse.sh [DIR]          # default DIR: wheelhouse
#     WHEEL_PYTHON=3.12 WHEEL_PLATFORMS="manylinux_2_28_aarch64 manylinux2014_aarch64" benchmarks/wheelhouse.sh
#
# It holds zoo's dependencies (with the `demo` extra: the MiniLM weights of the finetuning check) as wheels for
# the node's Python and platform, without torch and the CUDA wheels torch pulls in: the node keeps the CUDA build
# of torch its image has. DeepSpeed and zoo are built here as pure-Python wheels (DeepSpeed JIT-compiles its ops
# on the node). On the node, in a venv that sees the image's torch:
#
#     python -m venv --system-site-packages .venv
#     .venv/bin/pip install --no-index --find-links wheelhouse -e ".[demo]"      # or: make setup WHEELHOUSE=wheelhouse
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=$(realpath -m "${1:-wheelhouse}")
PY=${PYTHON:-python3}
WHEEL_PYTHON=${WHEEL_PYTHON:-$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')}
WHEEL_PLATFORMS=${WHEEL_PLATFORMS:-manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64}
DEEPSPEED=${DEEPSPEED:-deepspeed==0.19.8}
mkdir -p "$DIR"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
TARGET=(--only-binary=:all: --python-version "$WHEEL_PYTHON")
for platform in $WHEEL_PLATFORMS; do TARGET+=(--platform "$platform"); done

# 1. What PyPI has only as source: DeepSpeed (no ops prebuilt) and zoo itself, as wheels.
DS_BUILD_OPS=0 "$PY" -m pip wheel --quiet --no-deps --wheel-dir "$DIR" "$DEEPSPEED" .
# 2. Everything they need, resolved for the node (metadata only), less torch and what only torch needs.
"$PY" -m pip install --quiet --dry-run --ignore-installed --report "$TMP/resolved.json" --target "$TMP/target" \
    --find-links "$DIR" "${TARGET[@]}" "zoo[demo]" "$DEEPSPEED"
"$PY" - "$TMP/resolved.json" "$TMP/requirements.txt" <<'PY'
import json, re, sys
report = json.load(open(sys.argv[1]))
skip = re.compile(r"^(torch|triton|nvidia-.*|zoo|deepspeed)$")    # the node's own torch; built in step 1
pins = [f"{item['metadata']['name']}=={item['metadata']['version']}" for item in report["install"]
        if not skip.match(item["metadata"]["name"].lower().replace("_", "-"))]
open(sys.argv[2], "w").write("\n".join(pins + ["setuptools>=64", "wheel"]) + "\n")   # + what `pip install -e` builds with
print(f"{len(pins)} dependencies resolved for the node (torch left out)")
PY
"$PY" -m pip download --quiet --no-deps --dest "$DIR" "${TARGET[@]}" -r "$TMP/requirements.txt"
echo "wheelhouse: $DIR ($(ls "$DIR" | wc -l) wheels, $(du -sh "$DIR" | cut -f1)); install on the node with:"
echo "    pip install --no-index --find-links $(basename "$DIR") -e \".[demo]\""
