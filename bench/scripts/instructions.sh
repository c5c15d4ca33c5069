#!/usr/bin/env bash
# Instructions and locked instructions per one-way 8-byte Send and per message of a
# stream, measured with callgrind: deterministic figures that the host's noise cannot move. Runs
# engine/examples/inline_pingpong (both engines driven from one thread, no cross-core
# traffic) for two iteration counts and divides the difference, so that set-up cost
# cancels out. Each round trip is two one-way Sends with their Acks, completions and
# re-posted receives. Two variants: the Send's bytes in a one-entry gather list over a
# registered region (the figure this script has always printed), and inline
# (`SendWr::inline`, as perftest posts small messages by default). Then the one-way 8-byte
# RDMA Write as `shmhca-perf write_lat` runs it (`inline_pingpong --write`: each Write
# signaled and inline, each side watching its region for the peer's marker and polling its
# CQ between looks; per one-way Write, both sides, Ack included). A further figure is the
# message-rate path: engine/examples/inline_stream, a stream of 8-byte inline Sends the way
# `shmhca-perf send_bw` runs them (a window of 128 outstanding, a completion every 100th,
# each receive reposted), per message, sender and receiver together. The next two are the
# round trips of `shmhca-perf read_lat` and `atomic_lat`: engine/examples/inline_read, an
# 8-byte RDMA Read (or Fetch and Add) posted, then its completion polled, the responder's
# engine driven between polls; per round trip, requester and responder together. The last
# figure is the gather-list Send's again, through the verbs ABI: cabi/examples/verbs_pingpong,
# two contexts of the C library (inline mode) with programs' buffers registered by
# `ibv_reg_mr`, every post and poll through `ibv_context.ops` as perftest's `ib_send_lat`
# makes them; its difference from the first figure is what the C layer costs. And the
# stream's, through the verbs ABI: cabi/examples/verbs_stream, as perftest's `ib_send_bw`
# posts and polls. And an empty poll: engine/examples/empty_poll, a connected pair of inline
# engines whose QPs have carried a Send, then `Cq::poll` on side a's empty completion queue
# (each poll runs a's engine once, as in inline mode), per poll.
#
#   bench/scripts/instructions.sh               # prints the figures
#   MAX_INSTR=6000 MAX_LOCKED=4.5 bench/scripts/instructions.sh   # and fails above ceilings
#   bench/scripts/instructions.sh --self-test   # checks that the locked count works
#
# Ceilings (each optional; .ci/run takes them from bench/scripts/ceilings.env):
#   MAX_INSTR, MAX_LOCKED                 the gather-list Send
#   MAX_INSTR_INLINE, MAX_LOCKED_INLINE   the inline Send
#   MAX_INSTR_WRITE, MAX_LOCKED_WRITE     the inline RDMA Write (write_lat's)
#   MAX_INSTR_STREAM, MAX_LOCKED_STREAM   the stream of inline Sends
#   MAX_INSTR_READ, MAX_LOCKED_READ       the RDMA Read round trip
#   MAX_INSTR_ATOMIC, MAX_LOCKED_ATOMIC   the Fetch and Add round trip
#   MAX_INSTR_VERBS, MAX_LOCKED_VERBS     the gather-list Send through the verbs ABI
#   MAX_INSTR_VERBS_STREAM, MAX_LOCKED_VERBS_STREAM   the stream through the verbs ABI
#   MAX_INSTR_EMPTY_POLL, MAX_LOCKED_EMPTY_POLL       an empty poll
#
# Locked instructions: callgrind runs with --dump-instr=yes, which gives the execution
# count of every instruction address, per object (the executable and each shared library),
# as the object's own (link-time) address, the one objdump prints, PIE or not. objdump -d
# of each executed object lists its locked instructions: any with a `lock` prefix, and
# `xchg` with a memory operand (implicitly locked). The count of a figure is the sum of
# their execution counts, differenced over the two iteration counts like the instructions.
# The locked instructions behind the count are listed on stderr (LOCKED_DETAIL=0: not).
#
# The examples run with SHMHCA_PROGRESS=auto (unless set otherwise), the default a
# benchmark like shmhca-perf runs with: with the progress helper, an engine holds an owed
# Ack back one iteration, and a ping-pong's Ack rides in the answer (with `manual` it leaves
# in a line of its own, ~190 instructions more per one-way message). The helper wakes by
# the clock, not per message: under callgrind its wake-ups are a handful of instructions
# per message at most and show as 0.00 locked (listed below the figure when there are
# any), which the ceilings leave room for. SHMHCA_PROGRESS=manual gives the figures
# without the helper.
#
# Needs valgrind and objdump (apt-get install -y valgrind binutils).
set -euo pipefail
cd "$(dirname "$0")/../.."

SELF_TEST=0
case "${1:-}" in
    "") ;;
    --self-test) SELF_TEST=1 ;;
    *)
        echo "instructions.sh: unknown argument $1 (the only option is --self-test)" >&2
        exit 2
        ;;
esac
for tool in valgrind objdump; do
    if ! command -v "$tool" >/dev/null; then
        echo "instructions.sh: $tool not found: apt-get install -y valgrind binutils" >&2
        exit 1
    fi
done
cargo build --release -q -p shmhca --example inline_pingpong --example inline_stream \
    --example inline_read --example empty_poll
cargo build --release -q -p shmhca-verbs-core --example verbs_pingpong --example verbs_stream
PINGPONG=${CARGO_TARGET_DIR:-target}/release/examples/inline_pingpong
STREAM=${CARGO_TARGET_DIR:-target}/release/examples/inline_stream
READ=${CARGO_TARGET_DIR:-target}/release/examples/inline_read
VERBS=${CARGO_TARGET_DIR:-target}/release/examples/verbs_pingpong
VERBS_STREAM=${CARGO_TARGET_DIR:-target}/release/examples/verbs_stream
EMPTY=${CARGO_TARGET_DIR:-target}/release/examples/empty_poll
BIN=$PINGPONG
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
: "${SHMHCA_PROGRESS:=auto}"
export SHMHCA_PROGRESS
N1=${N1:-2000}
N2=${N2:-12000}
# Messages of the two stream runs.
S1=${S1:-20000}
S2=${S2:-120000}
# Polls of the two empty-poll runs.
E1=${E1:-100000}
E2=${E2:-600000}
if [ "$N2" -le "$N1" ] || [ "$S2" -le "$S1" ] || [ "$E2" -le "$E1" ]; then
    echo "instructions.sh: N2 ($N2) must be larger than N1 ($N1), S2 ($S2) than S1 ($S1)," \
        "E2 ($E2) than E1 ($E1)" >&2
    exit 2
fi

# Runs the example $BIN under callgrind: $1 = tag, $2 = round trips (messages for the
# stream), rest = example options.
# Leaves $OUT/cg.$1 (callgrind's output) and $OUT/counts.$1 (object, address in decimal
# and execution count of every executed instruction, tab-separated).
run() {
    local tag=$1 n=$2
    shift 2
    if ! valgrind --tool=callgrind --dump-instr=yes --callgrind-out-file="$OUT/cg.$tag" \
        "$BIN" "$n" 8 "$@" >/dev/null 2>"$OUT/log.$tag"; then
        echo "instructions.sh: ${BIN##*/} $n 8 $* failed under callgrind:" >&2
        tail -20 "$OUT/log.$tag" >&2
        exit 1
    fi
    # Callgrind's format: "ob=(id) name" names an object ("ob=(id)" refers to it again;
    # "cob=" names one too), cost lines are "address line Ir" where an address is absolute
    # (0x...), relative to the previous line's (+n, -n, decimal) or the same (*); the cost
    # line after "calls=" is the call's inclusive cost, not the instruction's own.
    awk '
        function hex(s,    i, v) {
            v = 0
            s = tolower(s)
            for (i = 3; i <= length(s); i++) v = v * 16 + index("0123456789abcdef", substr(s, i, 1)) - 1
            return v
        }
        function name(spec,    id, rest) {
            id = spec; sub(/\).*/, ")", id)
            rest = spec; sub(/^\([0-9]+\) ?/, "", rest)
            if (rest != "") names[id] = rest
            return id
        }
        /^ob=/ { ob = name(substr($0, 4)); next }
        /^cob=/ { name(substr($0, 5)); next }
        /^calls=/ { skip = 1; next }
        /^(0x|[+*-]|[0-9])/ {
            a = $1
            if (a ~ /^0x/) addr = hex(a)
            else if (a ~ /^\+/) addr += substr(a, 2)
            else if (a ~ /^-/) addr -= substr(a, 2)
            else if (a != "*") addr = a + 0
            if (skip) { skip = 0; next }
            if (NF >= 3) count[ob SUBSEP addr] += $3
        }
        END {
            for (k in count) {
                split(k, p, SUBSEP)
                printf "%s\t%.0f\t%.0f\n", names[p[1]], p[2], count[k]
            }
        }' "$OUT/cg.$tag" >"$OUT/counts.$tag"
}

# The locked instructions of every object that executed, in $OUT/locked: object, address
# in decimal, function, instruction (tab-separated).
locked_list() {
    local obj
    cut -f1 "$OUT"/counts.* | sort -u | while IFS= read -r obj; do
        [ -f "$obj" ] || continue # "???": valgrind's own code, the vDSO
        objdump -d -C -w --no-show-raw-insn "$obj" | awk -v obj="$obj" '
            function hex(s,    i, v) {
                v = 0
                s = tolower(s)
                for (i = 1; i <= length(s); i++) v = v * 16 + index("0123456789abcdef", substr(s, i, 1)) - 1
                return v
            }
            /^[0-9a-f]+ <.*>:$/ { fn = $0; sub(/^[0-9a-f]+ </, "", fn); sub(/>:$/, "", fn); next }
            /^ *[0-9a-f]+:\t/ {
                split($0, part, "\t")
                insn = part[2]
                a = part[1]; gsub(/[ :]/, "", a)
                # A lock prefix, or xchg with a memory operand (implicitly locked); judged
                # on the instruction without the symbolic comments objdump adds (<name>, # ...).
                t = insn; sub(/[ \t]*[#<].*$/, "", t)
                if (t ~ /(^|[ \t])lock[ \t]/ || (t ~ /^(data16 )?xchg/ && t ~ /\(/)) {
                    gsub(/[ \t]+/, " ", insn)
                    printf "%s\t%.0f\t%s\t%s\n", obj, hex(a), fn, insn
                }
            }'
    done >"$OUT/locked"
}

# Per message, for tags $1.1 and $1.2, runs that differ by $2 messages: writes
# "instructions locked" to $OUT/result.$1, and the locked instructions behind the count to
# $OUT/detail.$1.
per_message() {
    local tag=$1 messages=$2 i1 i2
    i1=$(awk '/^summary:/ {print $2}' "$OUT/cg.$tag.1")
    i2=$(awk '/^summary:/ {print $2}' "$OUT/cg.$tag.2")
    : >"$OUT/detail.$tag"
    awk -F'\t' -v n="$messages" -v i1="$i1" -v i2="$i2" \
        -v detail="${LOCKED_DETAIL:-1}" -v detail_file="$OUT/detail.$tag" '
        FILENAME == ARGV[1] { what[$1 "\t" $2] = $4 "  in " $3; next }
        FILENAME == ARGV[2] { c1[$1 "\t" $2] = $3; next }
        ($1 "\t" $2) in what { c2[$1 "\t" $2] = $3 }
        END {
            total = 0
            for (k in c2) {
                d = c2[k] - c1[k]
                total += d
                if (detail != 0 && d != 0) {
                    split(k, p, "\t")
                    obj = p[1]; sub(/.*\//, "", obj)
                    printf "  %6.2f  %s (%s 0x%x)\n", d / n, what[k], obj, p[2] > detail_file
                }
            }
            printf "%d %.2f\n", int((i2 - i1) / n), total / n
        }' "$OUT/locked" "$OUT/counts.$tag.1" "$OUT/counts.$tag.2" >"$OUT/result.$tag"
}

# Lists on stderr the locked instructions behind variant $1's count ($2 names it), most
# executed first.
show_detail() {
    [ -s "$OUT/detail.$1" ] || return 0
    echo "locked instructions per message, $2 (count, instruction, function, object and address):" >&2
    sort -rn "$OUT/detail.$1" >&2
}

# Runs variant $1 (example options $2..) of the ping-pong for both iteration counts.
measure() {
    local tag=$1
    shift
    run "$tag.1" "$N1" "$@"
    run "$tag.2" "$N2" "$@"
}

# Runs the stream for both message counts (tag "stream").
measure_stream() {
    BIN=$STREAM
    run stream.1 "$S1"
    run stream.2 "$S2"
    BIN=$PINGPONG
}

# Runs the verbs-ABI ping-pong and stream for both counts (tags "verbs", "verbs_stream").
measure_verbs() {
    BIN=$VERBS
    run verbs.1 "$N1"
    run verbs.2 "$N2"
    BIN=$VERBS_STREAM
    run verbs_stream.1 "$S1"
    run verbs_stream.2 "$S2"
    BIN=$PINGPONG
}

# Runs the empty polls for both poll counts (tag "empty"; the example ignores the size
# argument that run passes).
measure_empty() {
    BIN=$EMPTY
    run empty.1 "$E1"
    run empty.2 "$E2"
    BIN=$PINGPONG
}

# Runs the Read and the Atomic round trips for both iteration counts (tags "read", "atomic").
measure_read() {
    BIN=$READ
    run read.1 "$N1"
    run read.2 "$N2"
    run atomic.1 "$N1" --atomic
    run atomic.2 "$N2" --atomic
    BIN=$PINGPONG
}

# Fails if figure $1 (value $2) is above ceiling $3 (named by variable $4), if set.
check() {
    local figure=$1 value=$2 ceiling=$3 var=$4
    [ -n "$ceiling" ] || return 0
    if awk -v v="$value" -v c="$ceiling" 'BEGIN {exit !(v > c)}'; then
        echo "instructions.sh: FAIL: $figure is $value, above the ceiling $var=$ceiling" \
            "(documented in bench/scripts/ceilings.env: lower it when the code gets faster," \
            "raise it only with the reason in the commit)" >&2
        FAILED=1
    fi
}

if [ "$SELF_TEST" = 1 ]; then
    # The same binary with --locked-probe executes one lock-prefixed fetch_add and one xchg
    # per one-way message on top of the engine's work: the locked count must grow by
    # exactly 2.00, and the instruction count by a handful.
    measure base
    measure probe --locked-probe
    locked_list
    per_message base "$((2 * (N2 - N1)))"
    per_message probe "$((2 * (N2 - N1)))"
    read -r I0 L0 <"$OUT/result.base"
    read -r I1 L1 <"$OUT/result.probe"
    LOCKED_DETAIL=0
    echo "self-test: without the probe $I0 instructions, $L0 locked; with it $I1, $L1 locked"
    if ! awk -v a="$L0" -v b="$L1" 'BEGIN {d = b - a; exit !(d > 1.995 && d < 2.005)}'; then
        echo "instructions.sh: self-test FAILED: the probe's 2 locked instructions per message" \
            "(lock xadd/add and xchg) were counted as $(awk -v a="$L0" -v b="$L1" 'BEGIN {printf "%.2f", b - a}')" >&2
        exit 1
    fi
    if [ "$I1" -le "$I0" ] || [ "$I1" -gt "$((I0 + 100))" ]; then
        echo "instructions.sh: self-test FAILED: the probe added $((I1 - I0)) instructions" \
            "per message (expected 1 to 100: the probe and the closure that posts with it)" >&2
        exit 1
    fi
    echo "self-test passed: the probe's 2 locked instructions per message were counted"
    exit 0
fi

measure sge
measure inline --inline
measure write --write
measure_stream
measure_read
measure_verbs
measure_empty
locked_list
per_message sge "$((2 * (N2 - N1)))"
per_message inline "$((2 * (N2 - N1)))"
per_message write "$((2 * (N2 - N1)))"
per_message stream "$((S2 - S1))"
per_message read "$((N2 - N1))"
per_message atomic "$((N2 - N1))"
per_message verbs "$((2 * (N2 - N1)))"
per_message verbs_stream "$((S2 - S1))"
per_message empty "$((E2 - E1))"
read -r INSTR LOCKED <"$OUT/result.sge"
read -r INSTR_INLINE LOCKED_INLINE <"$OUT/result.inline"
read -r INSTR_WRITE LOCKED_WRITE <"$OUT/result.write"
read -r INSTR_STREAM LOCKED_STREAM <"$OUT/result.stream"
read -r INSTR_READ LOCKED_READ <"$OUT/result.read"
read -r INSTR_ATOMIC LOCKED_ATOMIC <"$OUT/result.atomic"
read -r INSTR_VERBS LOCKED_VERBS <"$OUT/result.verbs"
read -r INSTR_VERBS_STREAM LOCKED_VERBS_STREAM <"$OUT/result.verbs_stream"
read -r INSTR_EMPTY LOCKED_EMPTY <"$OUT/result.empty"
show_detail sge "one-way gather-list Send"
show_detail inline "one-way inline Send"
show_detail write "one-way inline RDMA Write"
show_detail stream "stream of inline Sends"
show_detail read "RDMA Read round trip"
show_detail atomic "Fetch and Add round trip"
show_detail verbs "one-way Send through the verbs ABI"
show_detail verbs_stream "stream of Sends through the verbs ABI"
show_detail empty "empty poll"
echo "instructions per one-way 8-byte Send (both sides, Ack included): $INSTR"
echo "locked instructions per one-way 8-byte Send (both sides, Ack included): $LOCKED"
echo "instructions per one-way 8-byte inline Send (both sides, Ack included): $INSTR_INLINE"
echo "locked instructions per one-way 8-byte inline Send (both sides, Ack included): $LOCKED_INLINE"
echo "instructions per one-way 8-byte inline RDMA Write (both sides, Ack included): $INSTR_WRITE"
echo "locked instructions per one-way 8-byte inline RDMA Write (both sides, Ack included): $LOCKED_WRITE"
echo "instructions per 8-byte inline Send in a stream (both sides, Acks included): $INSTR_STREAM"
echo "locked instructions per 8-byte inline Send in a stream (both sides, Acks included): $LOCKED_STREAM"
echo "instructions per 8-byte RDMA Read round trip (both sides): $INSTR_READ"
echo "locked instructions per 8-byte RDMA Read round trip (both sides): $LOCKED_READ"
echo "instructions per Fetch and Add round trip (both sides): $INSTR_ATOMIC"
echo "locked instructions per Fetch and Add round trip (both sides): $LOCKED_ATOMIC"
echo "instructions per one-way 8-byte Send through the verbs ABI (both sides, Ack included): $INSTR_VERBS"
echo "locked instructions per one-way 8-byte Send through the verbs ABI (both sides, Ack included): $LOCKED_VERBS"
echo "instructions per 8-byte Send in a stream through the verbs ABI (both sides, Acks included): $INSTR_VERBS_STREAM"
echo "locked instructions per 8-byte Send in a stream through the verbs ABI (both sides, Acks included): $LOCKED_VERBS_STREAM"
echo "instructions per empty poll (Cq::poll finding nothing, the engine run once): $INSTR_EMPTY"
echo "locked instructions per empty poll: $LOCKED_EMPTY"
FAILED=0
check "instructions per one-way 8-byte Send" "$INSTR" "${MAX_INSTR:-}" MAX_INSTR
check "locked instructions per one-way 8-byte Send" "$LOCKED" "${MAX_LOCKED:-}" MAX_LOCKED
check "instructions per one-way 8-byte inline Send" "$INSTR_INLINE" \
    "${MAX_INSTR_INLINE:-}" MAX_INSTR_INLINE
check "locked instructions per one-way 8-byte inline Send" "$LOCKED_INLINE" \
    "${MAX_LOCKED_INLINE:-}" MAX_LOCKED_INLINE
check "instructions per one-way 8-byte inline RDMA Write" "$INSTR_WRITE" \
    "${MAX_INSTR_WRITE:-}" MAX_INSTR_WRITE
check "locked instructions per one-way 8-byte inline RDMA Write" "$LOCKED_WRITE" \
    "${MAX_LOCKED_WRITE:-}" MAX_LOCKED_WRITE
check "instructions per 8-byte inline Send in a stream" "$INSTR_STREAM" \
    "${MAX_INSTR_STREAM:-}" MAX_INSTR_STREAM
check "locked instructions per 8-byte inline Send in a stream" "$LOCKED_STREAM" \
    "${MAX_LOCKED_STREAM:-}" MAX_LOCKED_STREAM
check "instructions per 8-byte RDMA Read round trip" "$INSTR_READ" \
    "${MAX_INSTR_READ:-}" MAX_INSTR_READ
check "locked instructions per 8-byte RDMA Read round trip" "$LOCKED_READ" \
    "${MAX_LOCKED_READ:-}" MAX_LOCKED_READ
check "instructions per Fetch and Add round trip" "$INSTR_ATOMIC" \
    "${MAX_INSTR_ATOMIC:-}" MAX_INSTR_ATOMIC
check "locked instructions per Fetch and Add round trip" "$LOCKED_ATOMIC" \
    "${MAX_LOCKED_ATOMIC:-}" MAX_LOCKED_ATOMIC
check "instructions per one-way 8-byte Send through the verbs ABI" "$INSTR_VERBS" \
    "${MAX_INSTR_VERBS:-}" MAX_INSTR_VERBS
check "locked instructions per one-way 8-byte Send through the verbs ABI" "$LOCKED_VERBS" \
    "${MAX_LOCKED_VERBS:-}" MAX_LOCKED_VERBS
check "instructions per 8-byte Send in a stream through the verbs ABI" "$INSTR_VERBS_STREAM" \
    "${MAX_INSTR_VERBS_STREAM:-}" MAX_INSTR_VERBS_STREAM
check "locked instructions per 8-byte Send in a stream through the verbs ABI" \
    "$LOCKED_VERBS_STREAM" "${MAX_LOCKED_VERBS_STREAM:-}" MAX_LOCKED_VERBS_STREAM
check "instructions per empty poll" "$INSTR_EMPTY" "${MAX_INSTR_EMPTY_POLL:-}" MAX_INSTR_EMPTY_POLL
check "locked instructions per empty poll" "$LOCKED_EMPTY" "${MAX_LOCKED_EMPTY_POLL:-}" \
    MAX_LOCKED_EMPTY_POLL
exit "$FAILED"
