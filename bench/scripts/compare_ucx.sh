#!/usr/bin/env bash
# Measures shmhca-perf and UCX's ucx_perftest (its shared-memory transports) in the same
# session, interleaved round by round so that machine noise hits both alike, and prints the
# median of each figure over the rounds. The README's performance table comes from here.
#
#   bench/scripts/compare_ucx.sh             # 3 rounds
#   ROUNDS=5 bench/scripts/compare_ucx.sh
#
# Needs ucx-utils (apt-get install -y ucx-utils). Client on core 0, server on core 1;
# run as root to get SCHED_FIFO (chrt), which keeps other tasks off the measuring cores.
set -euo pipefail
cd "$(dirname "$0")/../.."

ROUNDS=${ROUNDS:-3}
LAT_N=${LAT_N:-200000}
BW8_N=${BW8_N:-3000000}
BW64K_N=${BW64K_N:-50000}

if ! command -v ucx_perftest >/dev/null; then
    echo "ucx_perftest not found: apt-get install -y ucx-utils" >&2
    exit 1
fi
cargo build --release -q -p shmhca-bench --bin shmhca-perf
PERF=${CARGO_TARGET_DIR:-target}/release/shmhca-perf
RT=()
if [ "$(id -u)" = 0 ] && command -v chrt >/dev/null; then RT=(chrt -f 10); fi

OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT

# shmhca-perf: $1 = figures to keep, as name:field[,name:field] (awk fields of the result
# row), rest = arguments.
perf() {
    local figures=$1
    shift
    local row
    row=$("${RT[@]}" "$PERF" "$@" --cpu 0,1 2>/dev/null | awk '/^ #bytes/ {getline; print}')
    local fig
    for fig in ${figures//,/ }; do
        echo "$row" | awk -v f="${fig#*:}" '{print $f}' >>"$OUT/${fig%%:*}"
    done
}

# ucx_perftest: $1 = figure name, $2 = awk field of the "Final:" row, $3 = env, rest =
# ucx_perftest arguments. The server runs on core 1, the client on core 0.
ucx() {
    local name=$1 field=$2 env=$3
    shift 3
    local port=$((20000 + RANDOM % 20000))
    env $env taskset -c 1 "${RT[@]}" ucx_perftest -p "$port" "$@" >/dev/null 2>&1 &
    local server=$!
    sleep 0.5
    env $env taskset -c 0 "${RT[@]}" ucx_perftest -p "$port" "$@" localhost 2>/dev/null |
        awk -v f="$field" '/^Final:/ {print $f}' >>"$OUT/$name"
    wait "$server" || true
}

for round in $(seq "$ROUNDS"); do
    echo "round $round of $ROUNDS" >&2
    # Latency rows: $5 = t_typical, $8 = 99% (usec). 2000 unmeasured iterations first
    # (ucx_perftest warms up too; shmhca-perf, like perftest, does not unless asked).
    perf send_lat:5,send_lat_p99:8 send_lat -s 8 -n "$LAT_N" --warmup 2000
    perf write_lat:5,write_lat_p99:8 write_lat -s 8 -n "$LAT_N" --warmup 2000
    perf read_lat:5,read_lat_p99:8 read_lat -s 8 -n "$LAT_N" --warmup 2000
    perf atomic_lat:5,atomic_lat_p99:8 atomic_lat -n "$LAT_N" --warmup 2000
    # Bandwidth rows: $4 = BW average (MiB/s), $5 = MsgRate (Mpps). Posted 32 per doorbell
    # (-l 32) and warmed up, as the README's table was measured.
    BW=(-l 32 --perform_warm_up)
    perf send_bw_8:5 send_bw -s 8 -n "$BW8_N" "${BW[@]}"
    perf send_bw_64k:4 send_bw -s 65536 -n "$BW64K_N" "${BW[@]}"
    perf write_bw_64k:4 write_bw -s 65536 -n "$BW64K_N" "${BW[@]}"
    perf read_bw_64k:4 read_bw -s 65536 -n "$BW64K_N" "${BW[@]}"
    perf atomic_bw:5 atomic_bw -n "$BW8_N" "${BW[@]}"
    # UCX "Final:" rows: $3 = median latency (usec), $6 = MB/s (MiB/s), $8 = msg/s.
    ucx ucx_am_lat 3 "" -x posix -d memory -t am_lat -s 8 -n "$LAT_N"
    ucx ucx_tag_lat 3 UCX_TLS=sm -t tag_lat -s 8 -n "$LAT_N"
    ucx ucx_am_bw_8 8 "" -x posix -d memory -t am_bw -s 8 -n "$BW8_N"
    ucx ucx_tag_bw_64k 6 UCX_TLS=sm -t tag_bw -s 65536 -n "$BW64K_N"
done

# The bare two-process cache-line ping-pong (and the ring's), from the pingpong bench.
echo "bare cache-line ping-pong" >&2
PINGPONG_ROUNDS=$((ROUNDS * 3)) "${RT[@]}" cargo bench -q -p shmhca-bench --bench pingpong 2>/dev/null |
    awk -v out="$OUT" '/^bare line/ {print $3 / 1000 > (out "/bare_one_way")}
                       /^ring 128B/ {print $3 / 1000 > (out "/ring128_one_way")}'

# "median (min-max)" of a figure's rounds, scaled by $2 (default 1).
summary() {
    sort -g "$OUT/$1" | awk -v k="${2:-1}" '{v[NR] = $1 * k}
        END {if (NR) printf "%.3f (%.3f-%.3f)", v[int((NR + 1) / 2)], v[1], v[NR]; else print "n/a"}'
}
printf '%-18s %-28s %s\n' figure "median (min-max) of $ROUNDS" unit
for f in bare_one_way ring128_one_way send_lat send_lat_p99 write_lat write_lat_p99 read_lat \
    read_lat_p99 atomic_lat atomic_lat_p99 ucx_am_lat ucx_tag_lat; do
    printf '%-18s %-28s %s\n' "$f" "$(summary $f)" usec
done
for f in send_bw_8 atomic_bw; do
    printf '%-18s %-28s %s\n' "$f" "$(summary $f)" Mpps
done
printf '%-18s %-28s %s\n' ucx_am_bw_8 "$(summary ucx_am_bw_8 0.000001)" Mpps
for f in send_bw_64k write_bw_64k read_bw_64k ucx_tag_bw_64k; do
    printf '%-18s %-28s %s\n' "$f" "$(summary $f)" MiB/s
done
