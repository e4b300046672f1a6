#!/usr/bin/env bash
# Check that the `gpu` extra resolves beside the current vLLM and its own torch, as on a GPU
# cluster (`pip install '.[gpu]'`): a dry run that asks for vllm>=0.33 (which pins torch 2.14).
# It only resolves (wheel metadata from the index); nothing is installed. Used by .ci/run.
#   scripts/check_gpu_install.sh [PYTHON]     (default .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:-.venv/bin/python}"
report="$(mktemp)"
trap 'rm -f "$report"' EXIT
"$PY" -m pip install --dry-run --ignore-installed --quiet --report "$report" '.[gpu]' 'vllm>=0.33' 2>&1 \
    | grep -v "is ignored: it is neither a file nor a directory" || true
"$PY" - "$report" <<'PY'
import json, sys
chosen = {i["metadata"]["name"]: i["metadata"]["version"] for i in json.load(open(sys.argv[1]))["install"]}
missing = [n for n in ("nereus", "vllm", "torch", "deepspeed", "megatron-core") if n not in chosen]
if missing:
    sys.exit(f"gpu extra: the dry run did not resolve {missing}")
print("gpu extra resolves:", ", ".join(f"{n} {chosen[n]}" for n in ("vllm", "torch", "deepspeed", "megatron-core")))
PY
