#!/usr/bin/env bash
# Instructions per one-way 8-byte Send, measured with callgrind: a deterministic figure
# that the host's noise cannot move. Runs engine/examples/inline_pingpong (both engines
# driven from one thread, no cross-core traffic) for two iteration counts and divides the
# difference, so that set-up cost cancels out. Each round trip is two one-way Sends with
# their Acks, completions and re-posted receives.
#
#   bench/scripts/instructions.sh            # prints instructions per one-way message
#   MAX_INSTR=3500 bench/scripts/instructions.sh   # and fails above a ceiling
#
# Needs valgrind (apt-get install -y valgrind).
set -euo pipefail
cd "$(dirname "$0")/../.."
if ! command -v valgrind >/dev/null; then
    echo "valgrind not found: apt-get install -y valgrind" >&2
    exit 1
fi
cargo build --release -q -p shmhca --example inline_pingpong
BIN=${CARGO_TARGET_DIR:-target}/release/examples/inline_pingpong
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
N1=${N1:-2000}
N2=${N2:-12000}
ir() {
    valgrind --tool=callgrind --callgrind-out-file="$OUT/cg.$1" "$BIN" "$1" >/dev/null 2>"$OUT/log.$1"
    awk '/^summary:/ {print $2}' "$OUT/cg.$1"
}
I1=$(ir "$N1")
I2=$(ir "$N2")
PER=$(( (I2 - I1) / (2 * (N2 - N1)) ))
echo "instructions per one-way 8-byte Send (both sides, Ack included): $PER"
if [ -n "${MAX_INSTR:-}" ] && [ "$PER" -gt "$MAX_INSTR" ]; then
    echo "above the ceiling of $MAX_INSTR" >&2
    exit 1
fi
