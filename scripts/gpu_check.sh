#!/usr/bin/env bash
# One command that proves the CUDA paths where a GPU is lent, and measures us against the peers there.
#
#   bash scripts/gpu_check.sh --budget 480            # a GPU machine: the sections in order of what matters, fitted to 480 s
#   bash scripts/gpu_check.sh --device cpu --quick    # anywhere: the same code on tiny shapes
#
# Results: results.json, results.md, log.txt and tests-tail.txt in --out DIR (default $OUT, else ./gpu-check-out).
# $PYTHON picks the interpreter (default python3: on the GPU machine, the one that holds CUDA torch).
# What each section measures and what its numbers mean: docs/reference/gpu.md.
set -u
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
cd "$here/.." && exec "${PYTHON:-python3}" scripts/gpu_check.py "$@"
