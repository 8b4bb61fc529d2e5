#!/usr/bin/env bash
# The GPU checks in one command, on a GPU node with zoo installed (`make setup`, or offline from a wheelhouse:
# benchmarks/README.md, "Offline install"); they print one report, also written to runs/gpu-checks/report.md:
#
#     benchmarks/gpu_checks.sh                 # on the GPU node (tens of minutes on one H100/H200)
#     benchmarks/gpu_checks.sh --rehearse      # the same plan on the CPU, tiny shapes (the suite runs it)
#
# What runs and what the report holds: benchmarks/gpu_checks.py (its flags: --help).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# gloo on the loopback interface for the CPU rehearsal (left to itself it probes interfaces, ~45 s here)
case " $* " in *" --rehearse "*) export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-lo}" ;; esac
exec "$PYTHON" benchmarks/gpu_checks.py "$@"
