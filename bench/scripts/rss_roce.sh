#!/usr/bin/env bash
# Issue 28's "RSS flat over 10 M messages": shmhca-perf send_bw --roce of N (default
# 10,000,000) 8-byte messages across a veth pair between two namespaces, sampling both
# processes' resident set size (VmRSS, /proc/PID/status) every INTERVAL seconds (default 2),
# then printing the first, the largest and the last sample of each side and the growth
# from the first sample after warm-up to the last.
#
#   bench/scripts/rss_roce.sh                  # as root
#   N=1000000 INTERVAL=1 bench/scripts/rss_roce.sh
#
# Makes its own namespaces (shmhca-rss-a/-b) and veth pair with addresses in the
# benchmarking range 198.18.0.0/15 only, and removes them on exit. Needs root and `ip`.
set -euo pipefail
cd "$(dirname "$0")/../.."
N=${N:-10000000}
INTERVAL=${INTERVAL:-2}
[ "$(id -u)" = 0 ] || { echo "rss_roce.sh: needs root (network namespaces)" >&2; exit 1; }
command -v ip >/dev/null || { echo "rss_roce.sh: needs ip (apt-get install -y iproute2)" >&2; exit 1; }
cargo build --release -q -p shmhca-bench --bin shmhca-perf
PERF=${CARGO_TARGET_DIR:-target}/release/shmhca-perf
A=shmhca-rss-a B=shmhca-rss-b
out=$(mktemp -d)
cleanup() {
    ip netns del "$A" 2>/dev/null || true
    ip netns del "$B" 2>/dev/null || true
    rm -rf "$out"
}
for ns in "$A" "$B"; do
    if ip netns list | grep -qw "$ns"; then
        echo "rss_roce.sh: namespace $ns exists already (another run?); not touching it" >&2
        rm -rf "$out"
        exit 1
    fi
done
trap cleanup EXIT
ip netns add "$A"
ip netns add "$B"
ip link add shmhca-rss0 netns "$A" type veth peer name shmhca-rss1 netns "$B"
ip -n "$A" addr add 198.18.0.1/30 dev shmhca-rss0
ip -n "$B" addr add 198.18.0.2/30 dev shmhca-rss1
for ns in "$A" "$B"; do
    ip -n "$ns" link set lo up
done
ip -n "$A" link set shmhca-rss0 up
ip -n "$B" link set shmhca-rss1 up

rss() { awk '/^VmRSS/ {print $2}' "/proc/$1/status" 2>/dev/null || true; }
ip netns exec "$A" "$PERF" send_bw --roce -s 8 -n "$N" >"$out/server" 2>&1 &
server=$!
sleep 0.5
ip netns exec "$B" "$PERF" send_bw --roce -s 8 -n "$N" 198.18.0.1 >"$out/client" 2>&1 &
client=$!
# `ip netns exec` execs the program: the PIDs are shmhca-perf's own.
while kill -0 "$client" 2>/dev/null; do
    echo "$(date +%s) $(rss "$server") $(rss "$client")" >>"$out/samples"
    sleep "$INTERVAL"
done
wait "$client" || { echo "rss_roce.sh: the client failed:" >&2; cat "$out/client" "$out/server" >&2; exit 1; }
wait "$server" || true
grep -E '^ *8 ' "$out/client" || true
awk 'NF == 3 && $2 != "" && $3 != "" {n++; s[n]=$2; c[n]=$3; if ($2 > ms) ms=$2; if ($3 > mc) mc=$3}
     END {
       if (n < 3) { print "rss_roce.sh: too few samples (" n ")"; exit 1 }
       w = (n >= 5) ? 3 : 2
       printf "%d samples every '"$INTERVAL"' s over '"$N"' messages\n", n
       printf "server RSS KiB: first %d, max %d, last %d; growth after warm-up (sample %d to last) %+d\n", s[1], ms, s[n], w, s[n]-s[w]
       printf "client RSS KiB: first %d, max %d, last %d; growth after warm-up (sample %d to last) %+d\n", c[1], mc, c[n], w, c[n]-c[w]
     }' "$out/samples"
