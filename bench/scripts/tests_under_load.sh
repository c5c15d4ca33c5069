#!/usr/bin/env bash
# The README's test command, run N times in a row from a fresh clone while another process
# keeps every core busy: the check that `cargo test --workspace` passes every time on a slow,
# busy machine in a debug build (issue 24, item 3). Nothing here measures speed.
#
#   bench/scripts/tests_under_load.sh            # 10 runs of HEAD, cores loaded by `yes`
#   RUNS=3 bench/scripts/tests_under_load.sh
#   LOAD=build bench/scripts/tests_under_load.sh # the load is a parallel `cargo build` of a
#                                                # second clone, rebuilt from scratch in a loop
#
# The clone is of the committed HEAD (what CI would get), into a new temporary directory that
# the script removes at the end; it is built once before the first run. Every run's output is
# kept in that directory until the end, and the output of a failing run is printed. Exits
# non-zero when any run failed; the last line is "N passed, M failed" (runs, not tests).
set -euo pipefail

runs=${RUNS:-10}
load=${LOAD:-yes}
repo=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
head=$(git -C "$repo" rev-parse --short HEAD)
work=$(mktemp -d "${TMPDIR:-/tmp}/shmhca-under-load.XXXXXX")
load_pids=()

cleanup() {
    for pid in "${load_pids[@]}"; do
        kill -- "-$pid" 2>/dev/null || kill "$pid" 2>/dev/null || true
    done
    rm -rf -- "$work"
}
trap cleanup EXIT

git clone -q --no-hardlinks "$repo" "$work/clone"
git -C "$work/clone" checkout -q "$head"
ncpu=$(nproc)
echo "tests_under_load: $runs runs of 'cargo test --workspace' at $head, $ncpu cores, load: $load"

case "$load" in
yes)
    # One busy loop per core: every test thread competes for a core.
    for _ in $(seq "$ncpu"); do
        setsid bash -c 'exec yes >/dev/null' &
        load_pids+=("$!")
    done
    ;;
build)
    # A parallel build of another tree, from scratch, over and over.
    git clone -q --no-hardlinks "$repo" "$work/other"
    setsid bash -c "cd '$work/other' && while :; do cargo clean -q; cargo build -q --workspace --all-targets -j $ncpu >/dev/null 2>&1; done" &
    load_pids+=("$!")
    ;;
none) ;;
*)
    echo "LOAD must be yes, build or none (got '$load')" >&2
    exit 2
    ;;
esac

cd "$work/clone"
cargo test --workspace --no-run -q >"$work/build.log" 2>&1 || {
    cat "$work/build.log"
    echo "tests_under_load: the build failed"
    exit 1
}

passed=0
failed=0
for i in $(seq "$runs"); do
    start=$(date +%s)
    if cargo test --workspace >"$work/run-$i.log" 2>&1; then
        passed=$((passed + 1))
        verdict=ok
    else
        failed=$((failed + 1))
        verdict=FAILED
        grep -E '^(test .* FAILED|failures:|---- )|panicked|error' "$work/run-$i.log" | head -40 || true
    fi
    tests=$(grep -E '^test result:' "$work/run-$i.log" | awk '{p+=$4; f+=$6} END {print p" tests passed, "f" failed"}')
    echo "run $i: $verdict in $(($(date +%s) - start)) s ($tests, $(grep -c '^test result:' "$work/run-$i.log") binaries)"
done
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
