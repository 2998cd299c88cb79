#!/usr/bin/env bash
# The suites on a TPU, timed in the loop: one run, each suite with its own time limit.
#
#   bash benchmarks/tpu.sh     # from the project root, with the project importable
#
# Each suite runs `python -m benchmarks [--SUITE] --large --device tpu --timing loop` and writes
# $RESULTS/tpu-SUITE.md and .json (the default suite: tpu-default.*); its log goes to
# $OUT/tpu-SUITE.log. A suite that fails or runs out of time (exit 124) is listed in
# $OUT/failed.txt, and the script exits 1 after running the others; the cells a stopped
# suite timed are in $RESULTS/tpu-SUITE.partial.json (all but the default suite).
#
# Settings (environment variables):
#   SUITES    the suites to run (default: default discrete composite beta autoregressive flow;
#             tokens is run only when named: SUITES=tokens)
#   BATCHES   batch sizes (default: each suite's --large grid, B in 1,4096,65536,262144,1048576;
#             for tokens N = 8192 tokens, with D = 2048, V = 151936 and decode steps of 256
#             and 1024 rows; its binary-search peer needs pip install --no-deps
#             tpu-inference==0.32.0)
#   ROUNDS    interleaved rounds per cell (default 5)
#   LIMIT_S   each suite's time limit in seconds (default 300)
#   ONLY      the implementations to time beside the references (default: all), e.g.
#             "samplers,samplers (pure layer)": fewer programs to compile
#   CASES     the cases to time, by part of their names (default: all), e.g. "K = 4,spline"
#             with SUITES=flow, "decode" with SUITES=tokens; only for the suites of several
#             cases (--cases)
#   OUT, RESULTS  logs (default benchmarks/results/tpu) and reports (default benchmarks/results)
#   DEVICE    the platform (default tpu; cpu tries the script out at small sizes: there
#             tokens times its CPU sizes, D = 128 and V = 32768, e.g. BATCHES=256)
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
SUITES=${SUITES:-default discrete composite beta autoregressive flow}
BATCHES=${BATCHES:-}
ROUNDS=${ROUNDS:-5}
LIMIT_S=${LIMIT_S:-300}
DEVICE=${DEVICE:-tpu}
OUT=${OUT:-benchmarks/results/tpu}
RESULTS=${RESULTS:-benchmarks/results}
mkdir -p "$OUT" "$RESULTS"
failed=0
for suite in $SUITES; do
    flags=()
    [[ $suite == default ]] || flags=("--$suite")
    echo "== $suite"
    timeout -s INT "$LIMIT_S" python3 -m benchmarks "${flags[@]}" --large --device "$DEVICE" --timing loop \
        ${BATCHES:+--batches "$BATCHES"} --rounds "$ROUNDS" --name "tpu-$suite" --out "$RESULTS" \
        ${ONLY:+--only "$ONLY"} ${CASES:+--cases "$CASES"} \
        >"$OUT/tpu-$suite.log" 2>&1
    status=$?
    if ((status != 0)); then
        echo "$suite: exit $status" | tee -a "$OUT/failed.txt"
        failed=1
    fi
    grep -v -i warn "$OUT/tpu-$suite.log" | tail -n 3
done
exit $failed
