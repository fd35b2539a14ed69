#!/usr/bin/env bash
# One call on a GPU machine (the device tool lends one only to some tasks): the CUDA tests, the
# compile-overhead figures on the device (default mode and CUDA graphs), and the version tests
# under that machine's own torch. Everything it prints is also written to $OUT (default /tmp/gpu).
# Usage: benchmarks/gpu_check.sh [python [--full]]   (python: an interpreter whose torch has CUDA;
# --full: the main suite too, under that torch)
set -u
PY=${1:-python3}
OUT=${OUT:-/tmp/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCHDI_CACHE_DIR="" PYTHONPATH=$PWD
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
  nproc
} 2>&1 | tee "$OUT/env.txt"
start=$SECONDS
if command -v make >/dev/null; then
  timeout 240 make --no-print-directory test-gpu GPU_PYTHON="$PY" 2>&1 | tee "$OUT/test-gpu.log"
else  # the same command as the Makefile's test-gpu
  timeout 240 "$PY" -m pytest -q -rs -p no:cacheprovider tests -m cuda 2>&1 | tee "$OUT/test-gpu.log"
fi
echo "test-gpu: exit ${PIPESTATUS[0]}, $((SECONDS - start)) s"
for mode in default reduce-overhead; do
  start=$SECONDS
  flag=(); [ "$mode" = default ] || flag=(--mode "$mode")
  timeout 90 "$PY" benchmarks/compile_overhead.py --device cuda --repeats 7 --markdown "$OUT/compile-overhead-$mode.md" "${flag[@]}" 2>&1 | tee "$OUT/compile-overhead-$mode.log"
  echo "compile_overhead $mode: exit ${PIPESTATUS[0]}, $((SECONDS - start)) s"
done
# The version tests of the Makefile (test-next's selection) under this machine's torch, on 8 workers.
start=$SECONDS
tests=$("$PY" - <<'PYTHON'
import re
text = open("Makefile").read().replace("\\\n", " ")
value = {name: " ".join(re.search(rf"^{name} :=(.*)$", text, re.M).group(1).split()) for name in ("VERSION_TESTS", "VERSION_MARKS", "VERSION_SELECT")}
print("|".join(value[name] for name in ("VERSION_TESTS", "VERSION_MARKS", "VERSION_SELECT")))
PYTHON
)
IFS='|' read -r files marks select <<<"$tests"
# shellcheck disable=SC2086
timeout 90 "$PY" -m pytest -q -n 8 -p no:cacheprovider $files -m "$marks" -k "$select" 2>&1 | tail -n 15 | tee "$OUT/version-tests.log"
echo "version tests: exit ${PIPESTATUS[0]}, $((SECONDS - start)) s"
# --full: the main suite too (what make test-main-rest runs), under this machine's torch, on 12 workers.
if [ "${2:-}" = "--full" ]; then
  start=$SECONDS
  timeout 300 "$PY" -m pytest -q -n 12 --dist loadfile -p no:cacheprovider tests torchdi --doctest-modules --ignore=tests/xla \
    -m "not scenarios" 2>&1 | tail -n 40 | tee "$OUT/main-suite.log"
  echo "main suite: exit ${PIPESTATUS[0]}, $((SECONDS - start)) s"
fi
