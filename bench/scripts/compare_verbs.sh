#!/usr/bin/env bash
# Measures Debian's perftest over shmhca's libibverbs.so.1 (`shmhca exec`) against
# shmhca-perf, the same tests on shmhca's Rust API, in paired rounds: each round runs a
# perftest test (server and client, two processes) and its shmhca-perf counterpart back to
# back, and the script prints, for each pair, both figures' medians (min-max) and the median
# (min-max) of the per-round ratio, against issue 26's targets:
#   * ib_send_lat -F -s 8 t_typical within 1.1x of shmhca-perf send_lat -s 8;
#   * ib_send_bw -F -s 8 message rate at least 0.9x of shmhca-perf send_bw -s 8;
#   * ib_write_bw -F -s 65536 average bandwidth at least 0.9x of shmhca-perf write_bw -s 65536,
#     with the default registration (a shadow copy per send) and with SHMHCA_VERBS_ZERO_COPY=1.
#
#   bench/scripts/compare_verbs.sh            # 3 rounds, release build
#   ROUNDS=5 ITERS=50000 bench/scripts/compare_verbs.sh
#
# Needs perftest (apt-get install -y perftest). No pinning: this is the default setup a
# user gets from `shmhca exec`.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROUNDS=${ROUNDS:-3}
ITERS=${ITERS:-20000}
command -v ib_send_lat >/dev/null || { echo "compare_verbs.sh: perftest is not installed (apt-get install -y perftest)" >&2; exit 1; }
# (Two builds: `--bin` would limit the first to that binary, leaving libibverbs.so.1 stale.)
cargo build --release -q -p shmhca-verbs -p shmhca-tools
cargo build --release -q -p shmhca-bench --bin shmhca-perf
SHMHCA=target/release/shmhca
PERF=target/release/shmhca-perf
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

# perftest over shmhca, server then client on a fresh port; prints the client's result line.
verbs() {
    local prog=$1; shift
    local port=$((20000 + RANDOM % 20000))
    "$SHMHCA" exec -- "$prog" -F -p "$port" "$@" >"$out/s" 2>&1 &
    local sp=$!
    sleep 0.3
    timeout 120 "$SHMHCA" exec -- "$prog" -F -p "$port" "$@" localhost >"$out/c" 2>&1 || true
    wait "$sp" || true
    grep -A1 '#bytes' "$out/c" | tail -1
}
perf() {
    # (Its progress lines, on stderr for runs of more than a few seconds, would come after
    # the header and be read as the result: "77%" as 77 Mpps.)
    timeout 120 "$PERF" "$@" 2>&1 | grep -v '^shmhca-perf: ' | grep -A1 '#bytes' | tail -1
}

# column N of a result line (t_typical is 5 for latency; BW average 4, MsgRate 5 for bandwidth)
col() { awk -v n="$1" '{print $n}'; }

declare -a lat_v lat_p bw_v bw_p big_v big_p zc_v zc_p
for r in $(seq 1 "$ROUNDS"); do
    lat_v+=("$(verbs ib_send_lat -s 8 -n "$ITERS" | col 5)")
    lat_p+=("$(perf send_lat -s 8 -n "$ITERS" | col 5)")
    bw_v+=("$(verbs ib_send_bw -s 8 -n "$((ITERS * 100))" | col 5)")
    bw_p+=("$(perf send_bw -s 8 -n "$((ITERS * 100))" | col 5)")
    big_v+=("$(verbs ib_write_bw -s 65536 -n "$((ITERS * 2))" | col 4)")
    big_p+=("$(perf write_bw -s 65536 -n "$((ITERS * 2))" | col 4)")
    zc_v+=("$(SHMHCA_VERBS_ZERO_COPY=1 verbs ib_write_bw -s 65536 -n "$((ITERS * 2))" | col 4)")
    zc_p+=("$(perf write_bw -s 65536 -n "$((ITERS * 2))" | col 4)")
    echo "round $r: send_lat ${lat_v[-1]} vs ${lat_p[-1]} us, send_bw ${bw_v[-1]} vs ${bw_p[-1]} Mpps, write_bw 64K ${big_v[-1]} vs ${big_p[-1]} MiB/s, zero copy ${zc_v[-1]} vs ${zc_p[-1]} MiB/s"
done

# median (min-max) of the given numbers
stat() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {printf "%.3g (%.3g-%.3g)", a[int((NR+1)/2)], a[1], a[NR]}'; }
ratios() { local -n x=$1 y=$2; for i in "${!x[@]}"; do awk -v a="${x[$i]}" -v b="${y[$i]}" 'BEGIN {printf "%.3f\n", (b > 0 ? a / b : 0)}'; done; }
report() {
    local name=$1 unit=$2 target=$3 cmp=$4; local -n a=$5 b=$6
    mapfile -t rs < <(ratios "$5" "$6")
    local med; med=$(printf '%s\n' "${rs[@]}" | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}')
    local met; met=$(awk -v m="$med" -v t="$target" -v c="$cmp" 'BEGIN {print ((c == "le" && m <= t) || (c == "ge" && m >= t)) ? "met" : "NOT met"}')
    echo "$name: perftest over shmhca $(stat "${a[@]}") $unit, shmhca-perf $(stat "${b[@]}") $unit, ratio $(stat "${rs[@]}") (target $cmp $target: $met)"
}
echo "--- $ROUNDS rounds, $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
report "ib_send_lat -s 8 t_typical" us 1.1 le lat_v lat_p
report "ib_send_bw -s 8 message rate" Mpps 0.9 ge bw_v bw_p
report "ib_write_bw -s 65536 BW average" MiB/s 0.9 ge big_v big_p
report "ib_write_bw -s 65536 BW average, SHMHCA_VERBS_ZERO_COPY=1" MiB/s 0.9 ge zc_v zc_p
