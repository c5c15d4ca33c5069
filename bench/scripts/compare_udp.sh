#!/usr/bin/env bash
# RoCEv2 over a veth pair against the bare line, in paired rounds (issue 28's target:
# shmhca's 8-byte round trip within 1.3x of a plain UDP ping-pong between the same two
# namespaces). Each round runs engine/examples/udp_bare_pingpong (plain datagrams; busy-polling
# a non-blocking socket, as shmhca's inline engine polls its own: BARE=blocking for a blocking
# receive instead), then shmhca-perf send_lat --roce (an RC Send each way over shmhca's UdpPort),
# server in one namespace and client in the other, and prints both round trips and their
# ratio; at the end, the median (min-max) of the ratio. Each round also runs the bare
# ping-pong with --acks: an Ack-sized datagram ahead of each message, the four datagrams an
# RC round trip over RoCEv2 is (RoCEv2 carries no Ack inside a request), which is the line
# for the wire format's own cost; shmhca's ratio to it is printed too. And with --gso: the
# Ack-sized datagram and the message leave as one UDP GSO send and arrive by one recvmmsg,
# as shmhca sends an Ack and the reply it rides with — the line for what the wire format
# forces of an implementation that sends as shmhca does; shmhca's ratio to it is printed
# too. And with --gro: as --gso, the receiving socket taking the GSO send whole (UDP_GRO)
# as shmhca's port does, the floor for any implementation of the wire format over these
# sockets. Each figure is the mean round trip; the medians follow in brackets (a shared
# host's stalls move a mean far more than a median), and the ratios of the medians too.
#
#   bench/scripts/compare_udp.sh                  # as root: 3 rounds, 8-byte messages
#   ROUNDS=5 SIZE=4096 ITERS=20000 bench/scripts/compare_udp.sh
#   STREAM=0 bench/scripts/compare_udp.sh         # the round trips only
#
# Makes its own namespaces (shmhca-cmp-a/-b) and veth pair with addresses in the
# benchmarking range 198.18.0.0/15 only, and removes them on exit. Needs root and `ip`.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROUNDS=${ROUNDS:-3}
SIZE=${SIZE:-8}
ITERS=${ITERS:-10000}
BARE=${BARE:-spin}
STREAM=${STREAM:-1}
[ "$(id -u)" = 0 ] || { echo "compare_udp.sh: needs root (network namespaces)" >&2; exit 1; }
command -v ip >/dev/null || { echo "compare_udp.sh: needs ip (apt-get install -y iproute2)" >&2; exit 1; }
cargo build --release -q -p shmhca --example udp_bare_pingpong
cargo build --release -q -p shmhca-bench --bin shmhca-perf
PERF=${CARGO_TARGET_DIR:-target}/release/shmhca-perf
EX=${CARGO_TARGET_DIR:-target}/release/examples
A=shmhca-cmp-a B=shmhca-cmp-b
IPA=198.18.0.1 IPB=198.18.0.2
out=$(mktemp -d)
cleanup() {
    ip netns del "$A" 2>/dev/null || true
    ip netns del "$B" 2>/dev/null || true
    rm -rf "$out"
}
trap cleanup EXIT
for ns in "$A" "$B"; do
    if ip netns list | grep -qw "$ns"; then
        echo "compare_udp.sh: namespace $ns exists already (another run?); not touching it" >&2
        trap - EXIT
        rm -rf "$out"
        exit 1
    fi
done
ip netns add "$A"
ip netns add "$B"
ip link add shmhca-cmp0 netns "$A" type veth peer name shmhca-cmp1 netns "$B"
ip -n "$A" addr add "$IPA/30" dev shmhca-cmp0
ip -n "$B" addr add "$IPB/30" dev shmhca-cmp1
for ns in "$A" "$B"; do
    ip -n "$ns" link set lo up
done
ip -n "$A" link set shmhca-cmp0 up
ip -n "$B" link set shmhca-cmp1 up

# One ping-pong: $1 = example, then its extra options; prints the client's microseconds per
# round trip, mean and median.
pingpong() {
    local ex=$1
    shift
    ip netns exec "$A" "$EX/$ex" "$IPA" --size "$SIZE" --iters "$ITERS" "$@" >"$out/server" 2>&1 &
    local server=$!
    sleep 0.5
    timeout 300 ip netns exec "$B" "$EX/$ex" "$IPB" "$IPA" --size "$SIZE" --iters "$ITERS" "$@" \
        >"$out/client" 2>&1 || { echo "compare_udp.sh: $ex failed:" >&2; cat "$out/client" "$out/server" >&2; exit 1; }
    wait "$server" || true
    sed -n 's/.* \([0-9.]*\) µs each (median \([0-9.]*\) µs).*/\1 \2/p' "$out/client"
}

# shmhca-perf send_lat --roce -s SIZE (the figure issue 28's target names): prints the
# mean round trip in microseconds (twice perftest's t_avg, which is half a round trip; the
# bare ping-pongs report their mean too), then the median (twice t_typical).
perf_lat() {
    ip netns exec "$A" "$PERF" send_lat --roce -s "$SIZE" -n "$ITERS" >"$out/server" 2>&1 &
    local server=$!
    sleep 0.5
    timeout 300 ip netns exec "$B" "$PERF" send_lat --roce -s "$SIZE" -n "$ITERS" "$IPA" \
        >"$out/client" 2>&1 || { echo "compare_udp.sh: shmhca-perf failed:" >&2; cat "$out/client" "$out/server" >&2; exit 1; }
    wait "$server" || true
    awk -v s="$SIZE" '$1 == s && NF >= 6 {printf "%.2f %.2f\n", 2 * $6, 2 * $5}' "$out/client"
}

# Each round also runs the bare ping-pong with --acks (an Ack-sized datagram ahead of each
# message: the four datagrams an RC round trip over RoCEv2 is, with nothing else), the line
# for what the wire format itself costs.
ratios=()
aratios=()
gratios=()
mratios=()
mbratios=()
mrratios=()
spin=()
[ "$BARE" = spin ] && spin=(--spin)
ratio() { awk -v a="$1" -v b="$2" 'BEGIN {printf "%.2f", a / b}'; }
for r in $(seq 1 "$ROUNDS"); do
    read -r bare bare_m < <(pingpong udp_bare_pingpong "${spin[@]}")
    read -r acks acks_m < <(pingpong udp_bare_pingpong "${spin[@]}" --acks)
    read -r gso gso_m < <(pingpong udp_bare_pingpong "${spin[@]}" --gso)
    read -r gro gro_m < <(pingpong udp_bare_pingpong "${spin[@]}" --gro)
    read -r roce roce_m < <(perf_lat)
    ratios+=("$(ratio "$roce" "$bare")")
    aratios+=("$(ratio "$roce" "$acks")")
    gratios+=("$(ratio "$roce" "$gso")")
    mbratios+=("$(ratio "$roce_m" "$bare_m")")
    mratios+=("$(ratio "$roce_m" "$gso_m")")
    mrratios+=("$(ratio "$roce_m" "$gro_m")")
    echo "round $r: $SIZE-byte round trip, mean (median) µs: bare UDP $bare ($bare_m), bare with Acks $acks ($acks_m), bare GSO Ack+message $gso ($gso_m), the same received whole $gro ($gro_m), shmhca-perf send_lat --roce $roce ($roce_m); ratios of the means to the first three ${ratios[-1]}, ${aratios[-1]}, ${gratios[-1]}; of the medians to bare, GSO and whole ${mbratios[-1]}, ${mratios[-1]}, ${mrratios[-1]}"
done
median() {
    sort -g | awk -v n="$ROUNDS" -v what="$1" -v cmp="$2" -v bound="$3" '{a[NR]=$1} END {m=a[int((NR+1)/2)]; met=(cmp == "le" ? m <= bound : m >= bound); printf "%s median %s (%s-%s) over %d rounds (target %s %s: %s)\n", what, m, a[1], a[NR], n, cmp, bound, (met ? "met" : "NOT met")}'
}
spread() {
    sort -g | awk -v n="$ROUNDS" -v what="$1" '{a[NR]=$1} END {printf "%s: median %s (%s-%s) over %d rounds\n", what, a[int((NR+1)/2)], a[1], a[NR], n}'
}
printf '%s\n' "${ratios[@]}" | median "ratio to the bare ping-pong" le 1.3
printf '%s\n' "${aratios[@]}" | spread "ratio to the bare ping-pong with Acks"
printf '%s\n' "${gratios[@]}" | spread "ratio to the bare GSO Ack+message ping-pong"
printf '%s\n' "${mbratios[@]}" | spread "ratio of the medians to the bare ping-pong's"
printf '%s\n' "${mratios[@]}" | spread "ratio of the medians to the bare GSO Ack+message ping-pong's"
printf '%s\n' "${mrratios[@]}" | spread "ratio of the medians to the bare GSO Ack+message ping-pong's received whole (UDP_GRO)"
[ "$STREAM" = 0 ] && exit 0

# The stream: a bare UDP stream of 1 KiB datagrams (one send_to each) against shmhca-perf
# send_bw --roce -s 65536 (issue 28's target: at least 0.8x the bare goodput), paired.
sratios=()
for r in $(seq 1 "$ROUNDS"); do
    ip netns exec "$A" "$EX/udp_bare_pingpong" "$IPA" --stream --size 1024 --iters 300000 >"$out/server" 2>&1 &
    server=$!
    sleep 0.5
    timeout 300 ip netns exec "$B" "$EX/udp_bare_pingpong" "$IPB" "$IPA" --stream --size 1024 --iters 300000 >/dev/null 2>&1 || true
    wait "$server" || true
    bare=$(grep -o '[0-9.]* MB/s' "$out/server" | cut -d' ' -f1)
    ip netns exec "$A" "$PERF" send_bw --roce -s 65536 -n 3000 >/dev/null 2>&1 &
    server=$!
    sleep 0.5
    roce=$(timeout 300 ip netns exec "$B" "$PERF" send_bw --roce -s 65536 -n 3000 "$IPA" 2>&1 | awk '$1 == 65536 {print $4}')
    wait "$server" || true
    ratio=$(awk -v a="$roce" -v b="$bare" 'BEGIN {printf "%.2f", a / b}')
    sratios+=("$ratio")
    echo "round $r: stream: bare UDP $bare MB/s, shmhca-perf send_bw --roce $roce MB/s, ratio $ratio"
done
printf '%s\n' "${sratios[@]}" | median "stream ratio" ge 0.8
