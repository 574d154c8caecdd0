#!/usr/bin/env bash
# The GPU check (docs/gpu-check.md), one command: bash scripts/gpu_check.sh [flags of benchmarks/gpu.py]
exec "${PYTHON:-python}" "$(cd "$(dirname "$0")/.." && pwd)/benchmarks/gpu.py" "$@"
