#!/usr/bin/env bash
# The TPU lane: the tests marked `tpu` (tests/test_tpu.py: splash attention, the MoE grouped
# matmuls, the chunked linear mixers, the sampler, a resumed run, a converted model's logits),
# run on a TPU host in one pytest process (one program at a time can hold a chip). Elsewhere
# they skip, so CI stays CPU-only. Each test prints what it measured; the log goes to
# $TPU_LANE_LOG too where that is set.
#
#   bench/tpu_lane.sh                 # every tpu-marked test
#   bench/tpu_lane.sh -k splash       # pytest's own selection
#
# Needs the engine's dependencies and the parity references (torch, transformers: the
# `test-core` extra). docs/development.md says what it last showed.
set -euo pipefail
cd "$(dirname "$0")/.."
# tests/conftest.py pins JAX to the CPU unless JAX_PLATFORMS is set: here the TPU comes first,
# and the host CPU stays available for the references.
export JAX_PLATFORMS="${JAX_PLATFORMS:-tpu,cpu}"
python3 -m pytest -q -s -m tpu -p no:cacheprovider --durations=10 tests/test_tpu.py "$@" 2>&1 | tee "${TPU_LANE_LOG:-/dev/null}"
