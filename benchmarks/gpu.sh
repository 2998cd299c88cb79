#!/usr/bin/env bash
# One short benchmark and numerics run on a CUDA GPU, about 8 minutes in all.
#
#   bash benchmarks/gpu.sh
#
# Makes a virtualenv, installs '.[test,bench,peers]' and JAX's CUDA plugin (package
# registries are the only network it needs), records nvidia-smi and the devices,
# times the suite on the GPU up to B = 2**20 with the memory-bandwidth floor
# ($RESULTS/gpu.md, gpu-scaling.png, gpu.json), then runs the numerics tests on
# the GPU. Each stage has a time limit and a log under $OUT, which also gets
# copies of the report; a stage that fails or runs out of time (exit 124) is
# noted in $OUT/failed.txt and the script exits 1, but only a failed install or
# device check stops the later stages.
#
# Settings (environment variables):
#   OUT            logs and copies of the report (default benchmarks/results/gpu)
#   RESULTS        where the report goes (default benchmarks/results)
#   BANDWIDTH_TBS  the device's memory bandwidth in TB/s (default 4.8, the H200's)
#   JAX_CUDA       JAX's CUDA extra (default cuda12; cuda13 for a CUDA 13 driver)
#   BATCHES        batch sizes, e.g. 1,4096,1048576 (default: the suite's --large grid)
#   DEVICE         the platform to run on (default gpu)
#   PYTHON, VENV   the interpreter (default python3) and the venv (default .venv-gpu)
#   SKIP_INSTALL   1: use the active Python environment as it is (no venv, no install)
#   INSTALL_S, BENCH_S, TEST_S  the stages' limits in seconds (default 150, 210, 120)
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
export OUT=${OUT:-benchmarks/results/gpu}
export RESULTS=${RESULTS:-benchmarks/results}
export BANDWIDTH_TBS=${BANDWIDTH_TBS:-4.8}
export JAX_CUDA=${JAX_CUDA:-cuda12}
export BATCHES=${BATCHES:-}
export DEVICE=${DEVICE:-gpu}
export PYTHON=${PYTHON:-python3}
export VENV=${VENV:-.venv-gpu}
SKIP_INSTALL=${SKIP_INSTALL:-0}
INSTALL_S=${INSTALL_S:-150}
BENCH_S=${BENCH_S:-210}
TEST_S=${TEST_S:-120}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT" "$RESULTS"
rm -f "$OUT/failed.txt"
failed=()

# stage NAME SECONDS COMMAND...: runs COMMAND under a time limit, shows its
# output and logs it to $OUT/NAME.log, and notes a failure. SIGINT at the
# limit, so that pytest still prints its summary.
stage() {
    local name=$1 seconds=$2 rc
    shift 2
    echo "== $name (limit ${seconds}s)"
    set +e
    timeout --signal=INT --kill-after=15 "$seconds" "$@" 2>&1 | tee "$OUT/$name.log"
    rc=${PIPESTATUS[0]}
    set -e
    echo "== $name: exit $rc$([ "$rc" -eq 124 ] && echo ', out of time')" | tee -a "$OUT/$name.log"
    if [ "$rc" -ne 0 ]; then
        failed+=("$name (exit $rc)")
    fi
}

install() {
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
    "$VENV/bin/python" -m pip install -q '.[test,bench,peers]'
    # The plugin must match the jax that the project's requirements resolved to.
    local version
    version=$("$VENV/bin/python" -c 'import jax; print(jax.__version__)')
    "$VENV/bin/python" -m pip install -q "jax[$JAX_CUDA]==$version"
}

environment() {
    nvidia-smi || echo "nvidia-smi: not available"
    python -c 'import jax; print("jax.devices():", jax.devices()); print(jax.devices()[0].device_kind)'
    python -m pip list 2>/dev/null | grep -i -E '^(jax|flax|distrax|tfp|brax|numpy|nvidia)' || true
    python -c 'import jax, sys; jax.devices(sys.argv[1])' "$DEVICE" ||
        { echo "JAX has no $DEVICE device; see install.log"; return 1; }
}

benchmark() {
    local sizes=(--large)
    if [ -n "$BATCHES" ]; then
        sizes+=(--batches "$BATCHES")
    fi
    python -m benchmarks --device "$DEVICE" "${sizes[@]}" --bandwidth-tbs "$BANDWIDTH_TBS" \
        --out "$RESULTS" --name gpu
}

numerics() {
    # tests/heads/test_invariants.py fixes hypothesis' example counts in its own
    # settings (no profile or variable to lower them); a fixed seed makes the
    # run repeatable. JAX runs the tests on its default device, the GPU.
    python -m pytest tests/heads/test_squashed_normal.py tests/distributions/test_squashed_normal.py \
        tests/heads/test_invariants.py tests/distributions/test_squashed_normal_log_prob.py \
        -q -x -p no:cacheprovider --hypothesis-seed=0 --durations=10
}
export -f install environment benchmark numerics

if [ "$SKIP_INSTALL" != 1 ]; then
    stage install "$INSTALL_S" bash -c install
    if [ ${#failed[@]} -ne 0 ]; then
        echo "the install failed; see $OUT/install.log" >&2
        exit 1
    fi
    # shellcheck disable=SC1091
    . "$VENV/bin/activate"
fi
stage env 60 bash -c environment
if [ ${#failed[@]} -ne 0 ]; then
    printf 'failed: %s\n' "${failed[@]}" | tee "$OUT/failed.txt" >&2
    exit 1
fi

started=$(date +%s)
stage bench "$BENCH_S" bash -c benchmark
for file in gpu.md gpu-scaling.png gpu.json; do  # this run's, not an earlier one's
    if [ -f "$RESULTS/$file" ] && [ "$(stat -c %Y "$RESULTS/$file")" -ge "$started" ]; then
        cp "$RESULTS/$file" "$OUT/"
    fi
done
stage tests "$TEST_S" bash -c numerics

if [ ${#failed[@]} -ne 0 ]; then
    printf 'failed: %s\n' "${failed[@]}" | tee "$OUT/failed.txt" >&2
    exit 1
fi
echo "done: $RESULTS/gpu.md; logs in $OUT"
