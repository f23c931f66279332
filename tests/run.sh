#!/usr/bin/env bash
# The test command of README.md: the serial suite, the MPI suites at 2 and 3 ranks (and the
# emulated nodes' tests at 4: 2 nodes x 2), and the main job
# on the CPU (which exits 1 if any data movement is not exact). Without a GPU the API runs in the
# host backend with the MPI communicator, and tests/test_backends.py runs the CUDA kernels in Numba's
# CUDA simulator against it. Every stage runs under `timeout` so a hung rank fails the run instead of
# stalling it. At the end: one line per stage (name, passed or FAILED, exit status, seconds), then
# "N passed, N failed" (stages); the exit status is 1 if any stage failed.
set -uo pipefail
cd "$(dirname "$0")/.."

summary=()
passed=0
failed=0
stage() {  # stage NAME COMMAND...: run, treat pytest's exit 5 (no tests collected) as success
    local name=$1 start=$SECONDS verdict=passed
    echo "=== $name"
    shift
    "$@"
    local rc=$?
    if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then
        echo "=== FAILED (exit $rc)"
        verdict=FAILED
        failed=$((failed + 1))
    else
        passed=$((passed + 1))
    fi
    summary+=("$(printf '%-26s %-6s exit %-3s %5s s' "$name" "$verdict" "$rc" $((SECONDS - start)))")
}

stage "serial suite" timeout 2400 python -m pytest -q -m "not mpi and not faults" tests
stage "MPI suite, 2 ranks" timeout 900 mpiexec -n 2 python -m pytest -q --with-mpi -m mpi tests
stage "MPI suite, 3 ranks" timeout 900 mpiexec -n 3 python -m pytest -q --with-mpi -m mpi tests
stage "emulated nodes, 4 ranks" timeout 300 mpiexec -n 4 python -m pytest -q --with-mpi -m mpi tests/test_nodes.py
stage "fault injection, 2 ranks" env FAULTS_RANKS=2 timeout 180 python -m pytest -q -m faults tests/test_faults.py
stage "fault injection, 3 ranks" env FAULTS_RANKS=3 timeout 180 python -m pytest -q -m faults tests/test_faults.py -k "test_rank_raises or test_rank_dies or test_first_layout or test_survivors or test_layout_path or test_mispaired or test_explicit_splits or test_precision_mix or test_layout_exchange_after or test_a_late_rank or test_an_aborted"
stage "soak, 2 ranks" timeout 120 mpiexec -n 2 python bench/soak.py --calls 200
stage "soak, 3 ranks" timeout 120 mpiexec -n 3 python bench/soak.py --calls 40
stage "main job on the CPU" timeout 600 mpiexec -n 2 python -m mxcomm.bench pipeline

echo "=== summary (stage, verdict, exit status, seconds)"
printf '%s\n' "${summary[@]}"
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
