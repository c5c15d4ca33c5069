"""A scripted RoCEv2 peer built on scapy's RoCE layers (scapy.contrib.roce), independent
of shmhca's codec: it plays the cases of datenlord/roce-sim against a shmhca UdpPort.

Run by engine/tests/roce_scapy_peer.rs, which drives shmhca's side. The two talk in lines:
this script prints a command on stdout ("post_send ID HEX", "expect_wc ID STATUS HEX",
...), the test answers on stdin with "ok ..." or "fail WHY". Every wait is bounded; the
first failed check prints "FAIL case: why" and exits 1.

Arguments: SHM_IP PEER_IP SHM_QPN SHM_QPN_B SHM_QPN_C PEER_QPN PEER_QPN_B PEER_QPN_C RKEY VA
(QP A plays every case but two; B, a peer that never answers; C, a remote access error
that ends its responder in the Error state).
"""
import socket
import struct
import sys

from scapy.contrib.roce import BTH
from scapy.layers.inet import IP, UDP
from scapy.packet import Raw

SHM_IP, PEER_IP = sys.argv[1], sys.argv[2]
(SHM_QPN, SHM_QPN_B, SHM_QPN_C, PEER_QPN, PEER_QPN_B, PEER_QPN_C, RKEY,
 VA) = (int(a, 0) for a in sys.argv[3:11])
PORT = 4791
SPORT = 0xC123  # this peer's source port (any: RoCEv2 replies go to 4791)

SEND_ONLY, WRITE_ONLY, READ_REQ = 0x04, 0x0A, 0x0C
READ_RESP_ONLY, ACK, ATOMIC_ACK, CMP_SWAP = 0x10, 0x11, 0x12, 0x13

tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
tx.setsockopt(socket.IPPROTO_IP, 10, 2)  # IP_MTU_DISCOVER = IP_PMTUDISC_DO: DF, IP ID 0
tx.bind((PEER_IP, SPORT))
rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
rx.bind((PEER_IP, PORT))
rx.settimeout(5.0)
case = "setup"


def fail(why):
    print(f"FAIL {case}: {why}", flush=True)
    sys.exit(1)


def command(line):
    """Asks shmhca's side to do something; returns its answer after "ok"."""
    print(line, flush=True)
    answer = sys.stdin.readline().strip()
    if not answer.startswith("ok"):
        fail(f"{line!r} -> {answer!r}")
    return answer[2:].strip()


# The requests of shmhca's QPs this peer has answered, as (the QPN they were sent to, PSN).
# Its transport timer (about 17 ms) may resend one before the answer reaches it when this
# script runs slowly (a busy machine): a copy that comes after the answer is passed over,
# as a RoCE NIC answers a duplicate and goes on.
answered = set()

# The QPN shmhca's requests carry (this peer's QP), by the shmhca QP that sends them.
PEER_OF = {SHM_QPN: PEER_QPN, SHM_QPN_B: PEER_QPN_B, SHM_QPN_C: PEER_QPN_C}


def send(opcode, psn, body=b"", dqpn=None, ackreq=1):
    """Sends one RC packet to shmhca: BTH (scapy appends the ICRC) + headers + payload."""
    dest = SHM_QPN if dqpn is None else dqpn
    if opcode in (ACK, READ_RESP_ONLY, ATOMIC_ACK) and dest in PEER_OF:
        answered.add((PEER_OF[dest], psn))
    pad = (4 - len(body) % 4) % 4
    pkt = (IP(src=PEER_IP, dst=SHM_IP, flags="DF", id=0)
           / UDP(sport=SPORT, dport=PORT)
           / BTH(opcode=opcode, psn=psn, dqpn=SHM_QPN if dqpn is None else dqpn,
                 ackreq=ackreq, padcount=pad)
           / Raw(body + b"\0" * pad))
    tx.sendto(bytes(pkt)[28:], (SHM_IP, PORT))


def before(a, b):
    """Whether PSN a is before PSN b (24-bit serial arithmetic)."""
    return a != b and (b - a) & 0xFFFFFF < 0x800000


def receive(expect_psn=None, requests_only=False):
    """The next packet from shmhca, its ICRC checked by scapy: (opcode, psn, dqpn,
    ackreq, the bytes after the BTH without pad and ICRC). Passes over the positive Acks
    a responder may send unasked (credit updates: an Ack of an older PSN, or any Ack
    while a request is awaited), as a RoCE NIC takes them in its stride, and resends of
    requests this peer has answered (`answered`)."""
    while True:
        got = receive_one()
        op, psn, dqpn, _, body = got
        positive_ack = op == ACK and body and body[0] & 0xE0 == 0
        if positive_ack and (requests_only or (expect_psn is not None and before(psn, expect_psn))):
            continue
        if op not in (ACK, READ_RESP_ONLY, ATOMIC_ACK) and (dqpn, psn) in answered:
            continue  # a resend of a request answered already
        return got


def receive_one():
    """The next packet from shmhca, its ICRC checked by scapy."""
    try:
        data, (src, sport) = rx.recvfrom(65536)
    except socket.timeout:
        fail("nothing from shmhca within 5 s")
    if src != SHM_IP:
        fail(f"a packet from {src}")
    bth = BTH(data[:12] + b"\0\0\0\0")
    carried = data[-4:]
    pkt = (IP(src=SHM_IP, dst=PEER_IP, flags="DF", id=0)
           / UDP(sport=sport, dport=PORT) / BTH(data[:12] + data[-4:]) )
    pkt[BTH].remove_payload()
    pkt[BTH].add_payload(Raw(data[12:-4]))
    pkt[BTH].icrc = None
    want = bytes(pkt)[-4:]
    if want != carried:
        fail(f"ICRC {carried.hex()} where scapy computes {want.hex()}")
    body = data[12:-4]
    if bth.padcount:
        body = body[:-bth.padcount]
    return bth.opcode, bth.psn, bth.dqpn, bth.ackreq, body


def expect_ack(psn, syndrome_class=0x00, what="an Ack", peer_qpn=PEER_QPN):
    op, p, dqpn, _, body = receive(expect_psn=psn)
    if op != ACK or p != psn or dqpn != peer_qpn:
        fail(f"{what}: got opcode {op:#x} psn {p:#x} dqpn {dqpn:#x}, want {ACK:#x} {psn:#x}")
    syndrome = body[0]
    if syndrome_class == 0x00 and syndrome & 0xE0 != 0:
        fail(f"{what}: syndrome {syndrome:#x} is not an ACK")
    if syndrome_class != 0x00 and syndrome != syndrome_class and (syndrome & 0xE0) != syndrome_class:
        fail(f"{what}: syndrome {syndrome:#x}, want {syndrome_class:#x}")
    return body


def reth(va, rkey, length):
    return struct.pack(">QII", va, rkey, length)


def aeth(syndrome, msn):
    return struct.pack(">I", syndrome << 24 | msn)


# --- shmhca as the responder (this peer's requests start at PSN 0x100) ---------------------
case = "responder Send"
command("post_recv 1")
send(SEND_ONLY, 0x100, b"hello scapy!")
expect_ack(0x100)
command("expect_wc 1 Success " + b"hello scapy!".hex())

case = "duplicate Send is acknowledged again, not delivered twice"
send(SEND_ONLY, 0x100, b"hello scapy!")
expect_ack(0x100)

case = "responder RDMA Write"
data = b"written by scapy"
send(WRITE_ONLY, 0x101, reth(VA + 1024, RKEY, len(data)) + data)
expect_ack(0x101)
if command(f"read_mem 1024 {len(data)}") != data.hex():
    fail("the Write's bytes are not in memory")

case = "responder RDMA Read"
send(READ_REQ, 0x102, reth(VA + 1024, RKEY, len(data)))
op, p, dqpn, _, body = receive(expect_psn=0x102)
if op != READ_RESP_ONLY or p != 0x102 or body[4:] != data:
    fail(f"opcode {op:#x} psn {p:#x} body {body.hex()}")

case = "responder Compare and Swap"
send(CMP_SWAP, 0x103, struct.pack(">QIQQ", VA + 2048, RKEY, 0x1111, 0))
op, p, dqpn, _, body = receive(expect_psn=0x103)
if op != ATOMIC_ACK or p != 0x103 or struct.unpack(">Q", body[4:12])[0] != 0:
    fail(f"opcode {op:#x} psn {p:#x} body {body.hex()}")
if command("read_mem 2048 8") != struct.pack("<Q", 0x1111).hex():
    fail("the swap is not in memory")

case = "PSN sequence error Nak"
send(SEND_ONLY, 0x106, b"too far ahead")
expect_ack(0x104, 0x60, "a PSN sequence error Nak")

case = "RNR Nak without a receive posted"
send(SEND_ONLY, 0x104, b"no receive yet")
expect_ack(0x104, 0x20, "an RNR Nak")
command("post_recv 2")
send(SEND_ONLY, 0x104, b"no receive yet")
expect_ack(0x104)
command("expect_wc 2 Success " + b"no receive yet".hex())

case = "ghost Ack (for nothing outstanding) is ignored"
send(ACK, 0x150, aeth(0x1F, 0), dqpn=SHM_QPN)

# --- shmhca as the requester (its requests start at PSN 0x200) ----------------------------
case = "requester Send"
command("post_send 10 " + b"ping".hex())
op, p, dqpn, ackreq, body = receive(requests_only=True)
if (op, p, dqpn, ackreq, body) != (SEND_ONLY, 0x200, PEER_QPN, 1, b"ping"):
    fail(f"got {op:#x} {p:#x} {dqpn:#x} ackreq {ackreq} {body!r}")
send(ACK, 0x200, aeth(0x1F, 1), dqpn=SHM_QPN)
command("expect_wc 10 Success")

case = "requester resends a request whose Ack was lost"
command("post_send 11 " + b"again".hex())
first = receive(requests_only=True)
again = receive(requests_only=True)
if first[:2] != (SEND_ONLY, 0x201) or again[:2] != (SEND_ONLY, 0x201) or again[4] != b"again":
    fail(f"{first} then {again}")
send(ACK, 0x201, aeth(0x1F, 2), dqpn=SHM_QPN)
command("expect_wc 11 Success")

case = "requester RDMA Read"
command(f"post_read 12 {0x5000:#x} {0x1234:#x} 8")
op, p, dqpn, ackreq, body = receive(requests_only=True)
if op != READ_REQ or p != 0x202 or body != reth(0x5000, 0x1234, 8):
    fail(f"got {op:#x} {p:#x} {body.hex()}")
send(READ_RESP_ONLY, 0x202, aeth(0x1F, 3) + b"scapydat", dqpn=SHM_QPN)
command("expect_wc 12 Success " + b"scapydat".hex())

case = "requester Send after a ghost Ack"
send(ACK, 0x2F0, aeth(0x1F, 9), dqpn=SHM_QPN)
command("post_send 13 " + b"still fine".hex())
op, p, *_ = receive(requests_only=True)
if (op, p) != (SEND_ONLY, 0x203):
    fail(f"got {op:#x} {p:#x}")
send(ACK, 0x203, aeth(0x1F, 4), dqpn=SHM_QPN)
command("expect_wc 13 Success")

case = "responder R_Key violation (QP C)"
send(WRITE_ONLY, 0x100, reth(VA, RKEY ^ 0xFFFF, 4) + b"nope", dqpn=SHM_QPN_C)
expect_ack(0x100, 0x62, "a remote access error Nak", peer_qpn=PEER_QPN_C)

case = "a Nak for a remote access error fails the request"
command("post_send 14 " + b"denied".hex())
op, p, *_ = receive(requests_only=True)
send(ACK, 0x204, aeth(0x62, 4), dqpn=SHM_QPN)
command("expect_wc 14 RemAccessErr")


# --- QP B: a peer that never answers ------------------------------------------------------
case = "retry count exceeded"
command("post_send_b 20 " + b"anyone?".hex())
seen = 0
while True:
    rx.settimeout(2.0)
    try:
        data, _ = rx.recvfrom(65536)
    except socket.timeout:
        break
    seen += 1
if seen < 2:
    fail(f"{seen} transmissions: the request was not retried")
command("expect_wc_b 20 RetryExcErr")

print("done", flush=True)
