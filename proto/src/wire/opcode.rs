//! BTH opcodes of the Reliable Connected service and the table of what each one carries.
//!
//! The opcode (BTH byte 0, spec 01 Figure 17-4) decides the rest of the packet: which
//! extended headers follow the BTH and whether a payload does. [`Opcode::info`] answers
//! from one constant table (the idea of rxe's `rxe_opcode.c`), so the parser, the emitter,
//! the requester and the responder all read the same facts.
//!
//! The codes are those of DESIGN.md "Wire constants" (transport bits 7:5 = 000b, RC).

use core::fmt;

use super::{aeth, atomic_ack_eth, atomic_eth, bth, ieth, immdt, reth};

/// A BTH opcode. RC opcodes have their own arm; any other byte is kept in
/// [`Unknown`](Opcode::Unknown) so it can be reported and re-emitted as it was.
///
/// [`From<u8>`] never produces `Unknown` for a byte that has its own arm; constructing
/// `Unknown(0x04)` by hand gives a value that is not equal to `SendOnly`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Opcode {
    /// 0x00 RC Send First.
    SendFirst,
    /// 0x01 RC Send Middle.
    SendMiddle,
    /// 0x02 RC Send Last.
    SendLast,
    /// 0x03 RC Send Last with Immediate.
    SendLastWithImmediate,
    /// 0x04 RC Send Only.
    SendOnly,
    /// 0x05 RC Send Only with Immediate.
    SendOnlyWithImmediate,
    /// 0x06 RC RDMA Write First.
    RdmaWriteFirst,
    /// 0x07 RC RDMA Write Middle.
    RdmaWriteMiddle,
    /// 0x08 RC RDMA Write Last.
    RdmaWriteLast,
    /// 0x09 RC RDMA Write Last with Immediate.
    RdmaWriteLastWithImmediate,
    /// 0x0A RC RDMA Write Only.
    RdmaWriteOnly,
    /// 0x0B RC RDMA Write Only with Immediate.
    RdmaWriteOnlyWithImmediate,
    /// 0x0C RC RDMA Read Request.
    RdmaReadRequest,
    /// 0x0D RC RDMA Read Response First.
    RdmaReadResponseFirst,
    /// 0x0E RC RDMA Read Response Middle.
    RdmaReadResponseMiddle,
    /// 0x0F RC RDMA Read Response Last.
    RdmaReadResponseLast,
    /// 0x10 RC RDMA Read Response Only.
    RdmaReadResponseOnly,
    /// 0x11 RC Acknowledge.
    Acknowledge,
    /// 0x12 RC Atomic Acknowledge.
    AtomicAcknowledge,
    /// 0x13 RC Compare & Swap.
    CompareSwap,
    /// 0x14 RC Fetch & Add.
    FetchAdd,
    /// 0x16 RC Send Last with Invalidate.
    SendLastWithInvalidate,
    /// 0x17 RC Send Only with Invalidate.
    SendOnlyWithInvalidate,
    /// Any other opcode byte (reserved RC codes, and UC, RD, UD and vendor opcodes).
    Unknown(u8),
}

impl From<u8> for Opcode {
    fn from(v: u8) -> Opcode {
        match v {
            0x00 => Opcode::SendFirst,
            0x01 => Opcode::SendMiddle,
            0x02 => Opcode::SendLast,
            0x03 => Opcode::SendLastWithImmediate,
            0x04 => Opcode::SendOnly,
            0x05 => Opcode::SendOnlyWithImmediate,
            0x06 => Opcode::RdmaWriteFirst,
            0x07 => Opcode::RdmaWriteMiddle,
            0x08 => Opcode::RdmaWriteLast,
            0x09 => Opcode::RdmaWriteLastWithImmediate,
            0x0A => Opcode::RdmaWriteOnly,
            0x0B => Opcode::RdmaWriteOnlyWithImmediate,
            0x0C => Opcode::RdmaReadRequest,
            0x0D => Opcode::RdmaReadResponseFirst,
            0x0E => Opcode::RdmaReadResponseMiddle,
            0x0F => Opcode::RdmaReadResponseLast,
            0x10 => Opcode::RdmaReadResponseOnly,
            0x11 => Opcode::Acknowledge,
            0x12 => Opcode::AtomicAcknowledge,
            0x13 => Opcode::CompareSwap,
            0x14 => Opcode::FetchAdd,
            0x16 => Opcode::SendLastWithInvalidate,
            0x17 => Opcode::SendOnlyWithInvalidate,
            other => Opcode::Unknown(other),
        }
    }
}

impl From<Opcode> for u8 {
    fn from(op: Opcode) -> u8 {
        op.code()
    }
}

impl Opcode {
    /// Every RC opcode, in code order (the ones [`Opcode::info`] knows).
    pub const ALL: [Opcode; 23] = [
        Opcode::SendFirst,
        Opcode::SendMiddle,
        Opcode::SendLast,
        Opcode::SendLastWithImmediate,
        Opcode::SendOnly,
        Opcode::SendOnlyWithImmediate,
        Opcode::RdmaWriteFirst,
        Opcode::RdmaWriteMiddle,
        Opcode::RdmaWriteLast,
        Opcode::RdmaWriteLastWithImmediate,
        Opcode::RdmaWriteOnly,
        Opcode::RdmaWriteOnlyWithImmediate,
        Opcode::RdmaReadRequest,
        Opcode::RdmaReadResponseFirst,
        Opcode::RdmaReadResponseMiddle,
        Opcode::RdmaReadResponseLast,
        Opcode::RdmaReadResponseOnly,
        Opcode::Acknowledge,
        Opcode::AtomicAcknowledge,
        Opcode::CompareSwap,
        Opcode::FetchAdd,
        Opcode::SendLastWithInvalidate,
        Opcode::SendOnlyWithInvalidate,
    ];

    /// The opcode byte as it goes on the wire.
    pub const fn code(self) -> u8 {
        match self {
            Opcode::SendFirst => 0x00,
            Opcode::SendMiddle => 0x01,
            Opcode::SendLast => 0x02,
            Opcode::SendLastWithImmediate => 0x03,
            Opcode::SendOnly => 0x04,
            Opcode::SendOnlyWithImmediate => 0x05,
            Opcode::RdmaWriteFirst => 0x06,
            Opcode::RdmaWriteMiddle => 0x07,
            Opcode::RdmaWriteLast => 0x08,
            Opcode::RdmaWriteLastWithImmediate => 0x09,
            Opcode::RdmaWriteOnly => 0x0A,
            Opcode::RdmaWriteOnlyWithImmediate => 0x0B,
            Opcode::RdmaReadRequest => 0x0C,
            Opcode::RdmaReadResponseFirst => 0x0D,
            Opcode::RdmaReadResponseMiddle => 0x0E,
            Opcode::RdmaReadResponseLast => 0x0F,
            Opcode::RdmaReadResponseOnly => 0x10,
            Opcode::Acknowledge => 0x11,
            Opcode::AtomicAcknowledge => 0x12,
            Opcode::CompareSwap => 0x13,
            Opcode::FetchAdd => 0x14,
            Opcode::SendLastWithInvalidate => 0x16,
            Opcode::SendOnlyWithInvalidate => 0x17,
            Opcode::Unknown(v) => v,
        }
    }

    /// What this opcode carries, or `None` for an opcode this HCA does not implement
    /// (anything but the RC opcodes of DESIGN.md, including `Unknown` of any byte).
    pub fn info(self) -> Option<&'static OpcodeInfo> {
        let index = match self {
            Opcode::Unknown(_) => return None,
            Opcode::SendLastWithInvalidate => 21,
            Opcode::SendOnlyWithInvalidate => 22,
            // 0x00..=0x14 are dense in the table.
            known => usize::from(known.code()),
        };
        TABLE.get(index)
    }

    /// The RC opcode of the given class and position, with or without immediate data or
    /// invalidate, if one exists (e.g. `(Send, Last, immediate)` → `SendLastWithImmediate`).
    pub fn find(
        class: OpClass,
        position: Position,
        immediate: bool,
        invalidate: bool,
    ) -> Option<Opcode> {
        use OpClass::*;
        use Position::*;
        // A direct match (the SQ and RQ Logic call this per packet); the table test checks
        // it agrees with the table row by row.
        Some(match (class, position, immediate, invalidate) {
            (Send, First, false, false) => Opcode::SendFirst,
            (Send, Middle, false, false) => Opcode::SendMiddle,
            (Send, Last, false, false) => Opcode::SendLast,
            (Send, Last, true, false) => Opcode::SendLastWithImmediate,
            (Send, Only, false, false) => Opcode::SendOnly,
            (Send, Only, true, false) => Opcode::SendOnlyWithImmediate,
            (Send, Last, false, true) => Opcode::SendLastWithInvalidate,
            (Send, Only, false, true) => Opcode::SendOnlyWithInvalidate,
            (RdmaWrite, First, false, false) => Opcode::RdmaWriteFirst,
            (RdmaWrite, Middle, false, false) => Opcode::RdmaWriteMiddle,
            (RdmaWrite, Last, false, false) => Opcode::RdmaWriteLast,
            (RdmaWrite, Last, true, false) => Opcode::RdmaWriteLastWithImmediate,
            (RdmaWrite, Only, false, false) => Opcode::RdmaWriteOnly,
            (RdmaWrite, Only, true, false) => Opcode::RdmaWriteOnlyWithImmediate,
            (RdmaReadRequest, Only, false, false) => Opcode::RdmaReadRequest,
            (RdmaReadResponse, First, false, false) => Opcode::RdmaReadResponseFirst,
            (RdmaReadResponse, Middle, false, false) => Opcode::RdmaReadResponseMiddle,
            (RdmaReadResponse, Last, false, false) => Opcode::RdmaReadResponseLast,
            (RdmaReadResponse, Only, false, false) => Opcode::RdmaReadResponseOnly,
            (Acknowledge, Only, false, false) => Opcode::Acknowledge,
            (AtomicAcknowledge, Only, false, false) => Opcode::AtomicAcknowledge,
            (CompareSwap, Only, false, false) => Opcode::CompareSwap,
            (FetchAdd, Only, false, false) => Opcode::FetchAdd,
            _ => return None,
        })
    }
}

impl fmt::Display for Opcode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.info() {
            Some(info) => f.write_str(info.name),
            None => write!(f, "opcode {:#04x}", self.code()),
        }
    }
}

/// A set of extended transport headers (those that may follow the BTH in an RC packet).
///
/// Iteration and [`Headers::len`] follow wire order: RETH, AtomicETH, AETH, AtomicAckETH,
/// ImmDt, IETH.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Headers(u8);

impl Headers {
    /// No extended header.
    pub const NONE: Headers = Headers(0);
    /// RDMA Extended Transport Header (16 bytes).
    pub const RETH: Headers = Headers(1 << 0);
    /// Atomic Extended Transport Header (28 bytes).
    pub const ATOMIC_ETH: Headers = Headers(1 << 1);
    /// ACK Extended Transport Header (4 bytes).
    pub const AETH: Headers = Headers(1 << 2);
    /// Atomic ACK Extended Transport Header (8 bytes).
    pub const ATOMIC_ACK_ETH: Headers = Headers(1 << 3);
    /// Immediate Data (4 bytes).
    pub const IMMDT: Headers = Headers(1 << 4);
    /// Invalidate Extended Transport Header (4 bytes).
    pub const IETH: Headers = Headers(1 << 5);

    /// Each single header with its length, in wire order.
    const ORDER: [(Headers, usize, &'static str); 6] = [
        (Headers::RETH, reth::HEADER_LEN, "RETH"),
        (Headers::ATOMIC_ETH, atomic_eth::HEADER_LEN, "AtomicETH"),
        (Headers::AETH, aeth::HEADER_LEN, "AETH"),
        (
            Headers::ATOMIC_ACK_ETH,
            atomic_ack_eth::HEADER_LEN,
            "AtomicAckETH",
        ),
        (Headers::IMMDT, immdt::HEADER_LEN, "ImmDt"),
        (Headers::IETH, ieth::HEADER_LEN, "IETH"),
    ];

    /// Whether every header in `other` is in `self`.
    pub const fn contains(self, other: Headers) -> bool {
        self.0 & other.0 == other.0
    }

    /// The union of two sets.
    pub const fn union(self, other: Headers) -> Headers {
        Headers(self.0 | other.0)
    }

    /// Whether the set is empty.
    pub const fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// The set of the given bits (bits of no header dropped).
    pub const fn from_bits_truncate(bits: u8) -> Headers {
        Headers(bits & 0b11_1111)
    }

    /// The bits of the set (RETH = bit 0 … IETH = bit 5: the wire order).
    pub const fn bits(self) -> u8 {
        self.0
    }

    /// The total length in bytes of the headers in the set (not counting the BTH).
    pub const fn len(self) -> usize {
        // Every set of the six headers, precomputed: this is on the packet path.
        const LENS: [u8; 64] = {
            let mut t = [0u8; 64];
            let mut set = 0;
            while set < 64 {
                let mut total = 0;
                let mut i = 0;
                while i < Headers::ORDER.len() {
                    if set & Headers::ORDER[i].0.0 as usize != 0 {
                        total += Headers::ORDER[i].1;
                    }
                    i += 1;
                }
                t[set] = total as u8;
                set += 1;
            }
            t
        };
        LENS[(self.0 & 63) as usize] as usize
    }

    /// The headers of the set one by one, in wire order.
    pub fn iter(self) -> impl Iterator<Item = Headers> {
        Self::ORDER
            .iter()
            .filter(move |(h, _, _)| self.contains(*h))
            .map(|(h, _, _)| *h)
    }
}

impl core::ops::BitOr for Headers {
    type Output = Headers;
    fn bitor(self, rhs: Headers) -> Headers {
        self.union(rhs)
    }
}

impl fmt::Debug for Headers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Headers(")?;
        let mut first = true;
        for (h, _, name) in Self::ORDER {
            if self.contains(h) {
                if !first {
                    f.write_str(" | ")?;
                }
                f.write_str(name)?;
                first = false;
            }
        }
        if first {
            f.write_str("none")?;
        }
        f.write_str(")")
    }
}

/// The kind of operation a packet belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OpClass {
    /// Send (request).
    Send,
    /// RDMA Write (request).
    RdmaWrite,
    /// RDMA Read request.
    RdmaReadRequest,
    /// RDMA Read response.
    RdmaReadResponse,
    /// Acknowledge (positive Ack, RNR Nak or Nak).
    Acknowledge,
    /// Atomic Acknowledge (response to an atomic request).
    AtomicAcknowledge,
    /// Atomic Compare & Swap request.
    CompareSwap,
    /// Atomic Fetch & Add request.
    FetchAdd,
}

/// Where a packet sits in its message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Position {
    /// The first packet of a multi-packet message.
    First,
    /// A middle packet of a multi-packet message.
    Middle,
    /// The last packet of a multi-packet message.
    Last,
    /// The only packet of a message (every single-packet opcode).
    Only,
}

/// What an opcode carries: one row of the opcode table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct OpcodeInfo {
    /// The opcode this row describes.
    pub opcode: Opcode,
    /// Wireshark's name for the opcode (`"RC Send First"`), used in traces and errors.
    pub name: &'static str,
    /// The extended headers that follow the BTH, in wire order.
    pub headers: Headers,
    /// Whether a payload follows the headers (it may still be empty, e.g. a zero-length Send).
    pub payload: bool,
    /// The kind of operation.
    pub class: OpClass,
    /// The position in the message.
    pub position: Position,
    /// `true` for a request (SQ Logic → RQ Logic), `false` for a response.
    pub request: bool,
    /// Whether the packet carries Immediate Data.
    pub immediate: bool,
    /// Whether the packet carries an IETH (Send with Invalidate).
    pub invalidate: bool,
    /// [`OpcodeInfo::header_len`], computed with the table (the receive path compares it
    /// with every slot's header length).
    hdr_len: u8,
}

impl OpcodeInfo {
    /// The length of the BTH plus the extended headers of this opcode.
    pub const fn header_len(&self) -> usize {
        self.hdr_len as usize
    }
}

/// What the opcode byte `code` carries, or `None` for a byte that is not an RC opcode this
/// HCA implements: [`Opcode::info`] of `Opcode::from(code)`, without building the
/// [`Opcode`] first (the receive path looks the byte of every packet up here).
#[inline]
pub fn info_of_code(code: u8) -> Option<&'static OpcodeInfo> {
    let index = match code {
        // 0x00..=0x14 are dense in the table; 0x15 is reserved.
        0x00..=0x14 => code,
        0x16 | 0x17 => code - 1,
        _ => return None,
    };
    TABLE.get(usize::from(index))
}

/// Makes one table row.
#[allow(clippy::too_many_arguments)]
const fn row(
    opcode: Opcode,
    name: &'static str,
    headers: Headers,
    payload: bool,
    class: OpClass,
    position: Position,
    request: bool,
) -> OpcodeInfo {
    OpcodeInfo {
        opcode,
        name,
        headers,
        payload,
        class,
        position,
        request,
        immediate: headers.contains(Headers::IMMDT),
        invalidate: headers.contains(Headers::IETH),
        hdr_len: (bth::HEADER_LEN + headers.len()) as u8,
    }
}

const NONE: Headers = Headers::NONE;
const RETH: Headers = Headers::RETH;
const IMMDT: Headers = Headers::IMMDT;
const RETH_IMMDT: Headers = Headers::RETH.union(Headers::IMMDT);
const AETH: Headers = Headers::AETH;
const AETH_ATOMIC_ACK: Headers = Headers::AETH.union(Headers::ATOMIC_ACK_ETH);

use OpClass::{
    Acknowledge as Ack, AtomicAcknowledge as AtomicAck, CompareSwap as Cas, FetchAdd as Faa,
    RdmaReadRequest as ReadReq, RdmaReadResponse as ReadResp, RdmaWrite as Write, Send,
};
use Position::{First, Last, Middle, Only};

/// The opcode table: indices 0..=20 are opcodes 0x00..=0x14, then 0x16 and 0x17.
/// Header sets per spec 01 Figures 17-5 to 17-11 and DESIGN.md.
/// The row of Acknowledge (what a riding Ack is).
pub static ACKNOWLEDGE: &OpcodeInfo = &TABLE[0x11];
const _: () = assert!(matches!(TABLE[0x11].opcode, Opcode::Acknowledge));

const TABLE: [OpcodeInfo; 23] = [
    row(
        Opcode::SendFirst,
        "RC Send First",
        NONE,
        true,
        Send,
        First,
        true,
    ),
    row(
        Opcode::SendMiddle,
        "RC Send Middle",
        NONE,
        true,
        Send,
        Middle,
        true,
    ),
    row(
        Opcode::SendLast,
        "RC Send Last",
        NONE,
        true,
        Send,
        Last,
        true,
    ),
    row(
        Opcode::SendLastWithImmediate,
        "RC Send Last Immediate",
        IMMDT,
        true,
        Send,
        Last,
        true,
    ),
    row(
        Opcode::SendOnly,
        "RC Send Only",
        NONE,
        true,
        Send,
        Only,
        true,
    ),
    row(
        Opcode::SendOnlyWithImmediate,
        "RC Send Only Immediate",
        IMMDT,
        true,
        Send,
        Only,
        true,
    ),
    row(
        Opcode::RdmaWriteFirst,
        "RC RDMA Write First",
        RETH,
        true,
        Write,
        First,
        true,
    ),
    row(
        Opcode::RdmaWriteMiddle,
        "RC RDMA Write Middle",
        NONE,
        true,
        Write,
        Middle,
        true,
    ),
    row(
        Opcode::RdmaWriteLast,
        "RC RDMA Write Last",
        NONE,
        true,
        Write,
        Last,
        true,
    ),
    row(
        Opcode::RdmaWriteLastWithImmediate,
        "RC RDMA Write Last Immediate",
        IMMDT,
        true,
        Write,
        Last,
        true,
    ),
    row(
        Opcode::RdmaWriteOnly,
        "RC RDMA Write Only",
        RETH,
        true,
        Write,
        Only,
        true,
    ),
    row(
        Opcode::RdmaWriteOnlyWithImmediate,
        "RC RDMA Write Only Immediate",
        RETH_IMMDT,
        true,
        Write,
        Only,
        true,
    ),
    row(
        Opcode::RdmaReadRequest,
        "RC RDMA Read Request",
        RETH,
        false,
        ReadReq,
        Only,
        true,
    ),
    row(
        Opcode::RdmaReadResponseFirst,
        "RC RDMA Read Response First",
        AETH,
        true,
        ReadResp,
        First,
        false,
    ),
    row(
        Opcode::RdmaReadResponseMiddle,
        "RC RDMA Read Response Middle",
        NONE,
        true,
        ReadResp,
        Middle,
        false,
    ),
    row(
        Opcode::RdmaReadResponseLast,
        "RC RDMA Read Response Last",
        AETH,
        true,
        ReadResp,
        Last,
        false,
    ),
    row(
        Opcode::RdmaReadResponseOnly,
        "RC RDMA Read Response Only",
        AETH,
        true,
        ReadResp,
        Only,
        false,
    ),
    row(
        Opcode::Acknowledge,
        "RC Acknowledge",
        AETH,
        false,
        Ack,
        Only,
        false,
    ),
    row(
        Opcode::AtomicAcknowledge,
        "RC Atomic Acknowledge",
        AETH_ATOMIC_ACK,
        false,
        AtomicAck,
        Only,
        false,
    ),
    row(
        Opcode::CompareSwap,
        "RC Compare Swap",
        Headers::ATOMIC_ETH,
        false,
        Cas,
        Only,
        true,
    ),
    row(
        Opcode::FetchAdd,
        "RC Fetch Add",
        Headers::ATOMIC_ETH,
        false,
        Faa,
        Only,
        true,
    ),
    row(
        Opcode::SendLastWithInvalidate,
        "RC Send Last Invalidate",
        Headers::IETH,
        true,
        Send,
        Last,
        true,
    ),
    row(
        Opcode::SendOnlyWithInvalidate,
        "RC Send Only Invalidate",
        Headers::IETH,
        true,
        Send,
        Only,
        true,
    ),
];

/// The largest BTH + extended-header length of any RC opcode.
pub const fn max_header_len() -> usize {
    let mut max = 0;
    let mut i = 0;
    while i < TABLE.len() {
        let len = TABLE[i].header_len();
        if len > max {
            max = len;
        }
        i += 1;
    }
    max
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn u8_round_trip_for_every_byte() {
        for b in 0..=u8::MAX {
            let op = Opcode::from(b);
            assert_eq!(u8::from(op), b);
            let known = matches!(b, 0x00..=0x14 | 0x16 | 0x17);
            assert_eq!(op.info().is_some(), known, "opcode {b:#04x}");
            assert_eq!(!matches!(op, Opcode::Unknown(_)), known, "opcode {b:#04x}");
        }
    }

    #[test]
    fn info_of_code_is_info_of_the_opcode_for_every_byte() {
        for b in 0..=u8::MAX {
            assert_eq!(info_of_code(b), Opcode::from(b).info(), "opcode {b:#04x}");
        }
    }

    #[test]
    fn table_rows_describe_their_own_opcode() {
        for op in Opcode::ALL {
            let info = op.info().expect("every RC opcode has a row");
            assert_eq!(info.opcode, op);
            let by_header: usize = info.headers.iter().map(Headers::len).sum();
            assert_eq!(info.header_len(), bth::HEADER_LEN + by_header, "{op:?}");
        }
        assert_eq!(TABLE.len(), Opcode::ALL.len());
        assert_eq!(Opcode::Unknown(0x15).info(), None);
        assert_eq!(Opcode::Unknown(0x04).info(), None);
    }

    #[test]
    fn table_rows_match_the_spec() {
        use Opcode::*;
        let h = |op: Opcode| op.info().unwrap().headers;
        assert_eq!(h(SendFirst), Headers::NONE);
        assert_eq!(h(SendLastWithImmediate), Headers::IMMDT);
        assert_eq!(h(RdmaWriteFirst), Headers::RETH);
        assert_eq!(h(RdmaWriteMiddle), Headers::NONE);
        assert_eq!(
            h(RdmaWriteOnlyWithImmediate),
            Headers::RETH | Headers::IMMDT
        );
        assert_eq!(h(RdmaReadRequest), Headers::RETH);
        assert_eq!(h(RdmaReadResponseMiddle), Headers::NONE);
        assert_eq!(h(RdmaReadResponseFirst), Headers::AETH);
        assert_eq!(
            h(AtomicAcknowledge),
            Headers::AETH | Headers::ATOMIC_ACK_ETH
        );
        assert_eq!(h(CompareSwap), Headers::ATOMIC_ETH);
        assert_eq!(h(SendOnlyWithInvalidate), Headers::IETH);
        let payload: Vec<Opcode> = Opcode::ALL
            .into_iter()
            .filter(|op| !op.info().unwrap().payload)
            .collect();
        assert_eq!(
            payload,
            [
                RdmaReadRequest,
                Acknowledge,
                AtomicAcknowledge,
                CompareSwap,
                FetchAdd
            ]
        );
        let responses: Vec<Opcode> = Opcode::ALL
            .into_iter()
            .filter(|op| !op.info().unwrap().request)
            .collect();
        assert_eq!(
            responses,
            [
                RdmaReadResponseFirst,
                RdmaReadResponseMiddle,
                RdmaReadResponseLast,
                RdmaReadResponseOnly,
                Acknowledge,
                AtomicAcknowledge
            ]
        );
        assert!(SendOnlyWithImmediate.info().unwrap().immediate);
        assert!(SendLastWithInvalidate.info().unwrap().invalidate);
        assert!(!RdmaWriteLast.info().unwrap().immediate);
    }

    #[test]
    fn headers_lengths_and_order() {
        assert_eq!(Headers::NONE.len(), 0);
        assert_eq!(Headers::RETH.len(), 16);
        assert_eq!(Headers::ATOMIC_ETH.len(), 28);
        assert_eq!((Headers::AETH | Headers::ATOMIC_ACK_ETH).len(), 12);
        assert_eq!((Headers::RETH | Headers::IMMDT).len(), 20);
        let order: Vec<Headers> = Headers(0x3F).iter().collect();
        assert_eq!(
            order,
            [
                Headers::RETH,
                Headers::ATOMIC_ETH,
                Headers::AETH,
                Headers::ATOMIC_ACK_ETH,
                Headers::IMMDT,
                Headers::IETH
            ]
        );
        assert!((Headers::RETH | Headers::IMMDT).contains(Headers::IMMDT));
        assert!(!Headers::RETH.contains(Headers::IMMDT));
        assert_eq!(
            format!("{:?}", Headers::RETH | Headers::IMMDT),
            "Headers(RETH | ImmDt)"
        );
        assert_eq!(format!("{:?}", Headers::NONE), "Headers(none)");
        assert_eq!(max_header_len(), 40);
    }

    #[test]
    fn find_picks_the_opcode_by_its_properties() {
        assert_eq!(
            Opcode::find(OpClass::Send, Position::Last, true, false),
            Some(Opcode::SendLastWithImmediate)
        );
        assert_eq!(
            Opcode::find(OpClass::Send, Position::Only, false, true),
            Some(Opcode::SendOnlyWithInvalidate)
        );
        assert_eq!(
            Opcode::find(OpClass::RdmaWrite, Position::Middle, false, false),
            Some(Opcode::RdmaWriteMiddle)
        );
        assert_eq!(
            Opcode::find(OpClass::RdmaWrite, Position::First, true, false),
            None
        );
        for op in Opcode::ALL {
            let i = op.info().unwrap();
            assert_eq!(
                Opcode::find(i.class, i.position, i.immediate, i.invalidate),
                Some(op)
            );
        }
    }

    #[test]
    fn display_uses_the_table_name() {
        assert_eq!(Opcode::CompareSwap.to_string(), "RC Compare Swap");
        assert_eq!(Opcode::Unknown(0x64).to_string(), "opcode 0x64");
    }
}
