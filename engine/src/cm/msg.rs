//! The connection manager's messages: a small versioned binary format spoken over the
//! Unix-domain socket between two engines while they set up a connection.
//!
//! Every message is a 16-byte header followed by a body of at most [`MAX_BODY`] bytes. All
//! integers are little-endian; every reserved byte is zero.
//!
//! ```text
//! header   0..8   magic "SHMHCACM"
//!          8..10  protocol version (this build: VERSION)
//!         10..12  message type (1 HELLO, 2 REQ, 3 REP, 4 RTU, 5 REJ, 6 KEEPALIVE)
//!         12..16  body length in bytes
//!
//! HELLO    0..8   engine identity          (server -> client, first message)
//!          8..12  trace id (pcap endpoint)
//!         12..16  reserved
//!
//! offer    0..4   QPN                      (the QP block shared by REQ and REP, 40 bytes)
//!          4..8   start PSN (24 bits)
//!          8..10  PMTU in bytes (256, 512, 1024, 2048 or 4096)
//!         10      Local Ack Timeout (0..=31)
//!         11      Target Ack Delay (0..=31)
//!         12      Retry Count (0..=7)
//!         13      RNR Retry Count the peer should use towards the sender (0..=7)
//!         14      minimum RNR NAK timer code (0..=31)
//!         15      end-to-end credits reported by the sender's RQ Logic (0 or 1; 0 for
//!                 a QP on a shared receive queue, which reports none)
//!         16      responder resources (0..=16)
//!         17      initiator depth (0..=16)
//!         18..20  reserved
//!         20..40  max_send_wr, max_recv_wr, max_send_sge, max_recv_sge, max_inline_data
//!
//! REQ      0..8   client engine identity   (client -> server)
//!          8..12  trace id
//!         12      link mode: 1 a new link, whose segment and the client's engine page
//!                 travel with this message (SCM_RIGHTS); 0 reuse the link named by the
//!                 token, created by the client; 2 reuse the link named by the token,
//!                 created by the server. The client QP's arena (read-only) travels
//!                 with every REQ, last.
//!         13      the client QP's arena layout: 0 a shmhca segment (header page, then
//!                 data), 1 a protection domain over the application's memfd (data from
//!                 byte 0, sealed against shrinking; see `Context::alloc_pd_over`)
//!         14..16  reserved
//!         16..24  link token (chosen by the link's creator)
//!         24..64  offer
//!         64..66  private data length (0..=256)
//!         66..68  reserved
//!         68..    private data
//!
//! REP      0..8   link token (echoed)      (server -> client; the server QP's arena
//!          8..48  offer                     travels with it, after the server's engine
//!                                           page when the REQ brought a new link)
//!         48..50  private data length (0..=256)
//!         50      the server QP's arena layout (as REQ byte 13)
//!         51      reserved
//!         52..    private data
//!
//! RTU      (empty)                         (client -> server: ready to use)
//!
//! REJ      0..2   reason                   (either side, at any step)
//!          2..4   text length (0..=256)
//!          4..    text (UTF-8): what was wrong, naming the field
//!
//! KEEPALIVE (empty)                        (either side, after setup only: each side's
//!                                           watcher sends one every KEEPALIVE_INTERVAL)
//! ```
//!
//! After setup (RTU sent or received) a KEEPALIVE is the only message either side may send;
//! anything else on the socket ends the connection. Version 2 added it (version 1 peers are
//! refused with [`MsgError::Version`]).
//!
//! Decoding checks the structure (magic, version, type, exact lengths, reserved bytes);
//! [`Offer::check`] then checks every field's range. Neither ever panics on any input.

use std::fmt;

use crate::error::{Error, Result};
use crate::qp::{MAX_RD_ATOMIC, Mtu, QpCaps};

/// The first eight bytes of every message.
pub const MAGIC: [u8; 8] = *b"SHMHCACM";
/// The protocol version this build speaks.
pub const VERSION: u16 = 2;
/// Bytes of the message header.
pub const HEADER_LEN: usize = 16;
/// The largest message body accepted.
pub const MAX_BODY: usize = 1024;
/// The most private data a REQ or REP carries.
pub const MAX_PRIVATE_DATA: usize = 256;
/// The longest reason text of a REJ.
pub const MAX_REJECT_TEXT: usize = 256;

const OFFER_LEN: usize = 40;
const HELLO_LEN: usize = 16;
const REQ_FIXED: usize = 68;
const REP_FIXED: usize = 52;
const REJ_FIXED: usize = 4;

/// Message type codes.
mod ty {
    pub(super) const HELLO: u16 = 1;
    pub(super) const REQ: u16 = 2;
    pub(super) const REP: u16 = 3;
    pub(super) const RTU: u16 = 4;
    pub(super) const REJ: u16 = 5;
    pub(super) const KEEPALIVE: u16 = 6;
}

/// Why a message could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MsgError {
    /// The first bytes are not the magic: the peer is not shmhca's connection manager.
    #[error(
        "the peer is not a shmhca connection manager: it sent {found:?} where the magic \"SHMHCACM\" belongs"
    )]
    BadMagic {
        /// The bytes found, printable ASCII kept, the rest escaped.
        found: String,
    },
    /// The peer speaks another protocol version.
    #[error(
        "the peer speaks connection-manager protocol version {found}, this side speaks version {ours}: run the same shmhca version on both sides"
    )]
    Version {
        /// The peer's version.
        found: u16,
        /// This build's version.
        ours: u16,
    },
    /// An unknown message type.
    #[error("unknown message type {0}")]
    UnknownType(u16),
    /// The body is longer than any valid message.
    #[error("a message body of {len} bytes exceeds the limit of {max} bytes")]
    TooLong {
        /// The body length claimed by the header.
        len: u32,
        /// The limit.
        max: usize,
    },
    /// The body length does not match the message type.
    #[error("a {what} body must be {expected} bytes, this one is {len}")]
    Length {
        /// The message.
        what: &'static str,
        /// The length found.
        len: usize,
        /// The length its fields call for.
        expected: usize,
    },
    /// A reserved field is not zero.
    #[error("reserved bytes of the {what} are not zero")]
    Reserved {
        /// The message.
        what: &'static str,
    },
    /// A field has a value no valid message has.
    #[error("{what}: field `{field}` is {value}; {allowed}")]
    Field {
        /// The message.
        what: &'static str,
        /// The field.
        field: &'static str,
        /// The value found.
        value: u64,
        /// What is allowed.
        allowed: &'static str,
    },
}

/// A message header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// The message type code.
    pub msg_type: u16,
    /// Body bytes that follow.
    pub body_len: u32,
}

impl Header {
    /// Parses and checks a header: magic, version, and a body length within [`MAX_BODY`].
    ///
    /// # Errors
    /// [`MsgError::BadMagic`], [`MsgError::Version`], [`MsgError::TooLong`].
    pub fn parse(b: &[u8; HEADER_LEN]) -> std::result::Result<Header, MsgError> {
        if b[..8] != MAGIC {
            return Err(MsgError::BadMagic {
                found: b[..8].escape_ascii().to_string(),
            });
        }
        let version = u16::from_le_bytes([b[8], b[9]]);
        if version != VERSION {
            return Err(MsgError::Version {
                found: version,
                ours: VERSION,
            });
        }
        let msg_type = u16::from_le_bytes([b[10], b[11]]);
        let body_len = u32::from_le_bytes([b[12], b[13], b[14], b[15]]);
        if body_len as usize > MAX_BODY {
            return Err(MsgError::TooLong {
                len: body_len,
                max: MAX_BODY,
            });
        }
        Ok(Header { msg_type, body_len })
    }
}

/// The QP parameters a REQ or REP offers (the "offer" block in the layout above): what
/// spec/03 and spec/04 say the connection managers exchange.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Offer {
    /// The sender's QP number.
    pub qpn: u32,
    /// The sender's SQ start PSN: the receiver's RQ Logic expects it first.
    pub start_psn: u32,
    /// Path MTU in bytes: the sender's maximum in a REQ, the chosen one in a REP.
    pub pmtu: u16,
    /// The sender's Local Ack Timeout (transport timer 4.096 µs × 2^value, 0 = off).
    pub local_ack_timeout: u8,
    /// The sender's Target Ack Delay: how long (same scale) its RQ Logic may take to ack.
    pub target_ack_delay: u8,
    /// The sender's Retry Count.
    pub retry_count: u8,
    /// The RNR Retry Count the receiver's SQ Logic must use towards the sender (7 =
    /// forever).
    pub rnr_retry_count: u8,
    /// The RNR NAK timer code the sender's RQ Logic sends.
    pub min_rnr_timer: u8,
    /// 1 if the sender's RQ Logic reports end-to-end credits (spec/02), else 0 (a QP on a
    /// shared receive queue reports none).
    pub credits: u8,
    /// RDMA Read / Atomic requests the sender accepts at once.
    pub responder_resources: u8,
    /// RDMA Read / Atomic requests the sender issues at once.
    pub initiator_depth: u8,
    /// The sender's send queue depth.
    pub max_send_wr: u32,
    /// The sender's receive queue depth.
    pub max_recv_wr: u32,
    /// The sender's gather elements per send.
    pub max_send_sge: u32,
    /// The sender's scatter elements per receive.
    pub max_recv_sge: u32,
    /// The sender's inline data limit.
    pub max_inline_data: u32,
}

impl Offer {
    fn encode(&self, w: &mut Vec<u8>) {
        w.extend_from_slice(&self.qpn.to_le_bytes());
        w.extend_from_slice(&self.start_psn.to_le_bytes());
        w.extend_from_slice(&self.pmtu.to_le_bytes());
        w.extend_from_slice(&[
            self.local_ack_timeout,
            self.target_ack_delay,
            self.retry_count,
            self.rnr_retry_count,
            self.min_rnr_timer,
            self.credits,
            self.responder_resources,
            self.initiator_depth,
            0,
            0,
        ]);
        for v in [
            self.max_send_wr,
            self.max_recv_wr,
            self.max_send_sge,
            self.max_recv_sge,
            self.max_inline_data,
        ] {
            w.extend_from_slice(&v.to_le_bytes());
        }
    }

    fn decode(b: &[u8], what: &'static str) -> std::result::Result<Offer, MsgError> {
        debug_assert_eq!(b.len(), OFFER_LEN);
        if b[18..20] != [0, 0] {
            return Err(MsgError::Reserved { what });
        }
        Ok(Offer {
            qpn: le32(b, 0),
            start_psn: le32(b, 4),
            pmtu: u16::from_le_bytes([b[8], b[9]]),
            local_ack_timeout: b[10],
            target_ack_delay: b[11],
            retry_count: b[12],
            rnr_retry_count: b[13],
            min_rnr_timer: b[14],
            credits: b[15],
            responder_resources: b[16],
            initiator_depth: b[17],
            max_send_wr: le32(b, 20),
            max_recv_wr: le32(b, 24),
            max_send_sge: le32(b, 28),
            max_recv_sge: le32(b, 32),
            max_inline_data: le32(b, 36),
        })
    }

    /// Checks every field's range.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the first field out of range and what is allowed.
    pub fn check(&self) -> Result<()> {
        if !(2..=0xff_ffff).contains(&self.qpn) {
            return Err(Error::invalid(
                "qpn",
                format!(
                    "{:#x}; a QP number is 24 bits and 0 and 1 are the special QPs",
                    self.qpn
                ),
            ));
        }
        if self.start_psn > 0xff_ffff {
            return Err(Error::invalid(
                "start_psn",
                format!("{:#x}; a PSN is 24 bits (0..=0xffffff)", self.start_psn),
            ));
        }
        Mtu::from_bytes(u32::from(self.pmtu))?;
        let small = |name: &'static str, v: u8, max: u8, what: &str| {
            if v > max {
                Err(Error::invalid(name, format!("{v}; {what} is 0..={max}")))
            } else {
                Ok(())
            }
        };
        small(
            "local_ack_timeout",
            self.local_ack_timeout,
            31,
            "the Local Ack Timeout",
        )?;
        small(
            "target_ack_delay",
            self.target_ack_delay,
            31,
            "the Target Ack Delay",
        )?;
        small("retry_count", self.retry_count, 7, "the Retry Count")?;
        small(
            "rnr_retry_count",
            self.rnr_retry_count,
            7,
            "the RNR Retry Count",
        )?;
        small(
            "min_rnr_timer",
            self.min_rnr_timer,
            31,
            "the RNR NAK timer code",
        )?;
        small("credits", self.credits, 1, "the credit support flag")?;
        small(
            "responder_resources",
            self.responder_resources,
            MAX_RD_ATOMIC,
            "the responder resources",
        )?;
        small(
            "initiator_depth",
            self.initiator_depth,
            MAX_RD_ATOMIC,
            "the initiator depth",
        )?;
        self.caps().validate()
    }

    /// The queue capabilities offered.
    pub fn caps(&self) -> QpCaps {
        QpCaps {
            max_send_wr: self.max_send_wr,
            max_recv_wr: self.max_recv_wr,
            max_send_sge: self.max_send_sge,
            max_recv_sge: self.max_recv_sge,
            max_inline_data: self.max_inline_data,
        }
    }
}

/// HELLO: the server's first message, naming its engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hello {
    /// The server engine's identity (process id in the high 32 bits, a random nonce below).
    pub identity: u64,
    /// The engine's endpoint number in packet captures.
    pub trace_id: u32,
}

/// How a REQ names its link.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkMode {
    /// A new link: its segment and the client's engine page travel with the REQ.
    New,
    /// Reuse the link with this token that the client created (the server holds the
    /// segment's opening end).
    ReuseClientCreated,
    /// Reuse the link with this token that the server created (the client holds the
    /// opening end). Telling the two apart matters when both ends are in one engine.
    ReuseServerCreated,
}

/// How the arena that travels with a REQ or REP is laid out, so that its receiver opens it
/// the right way: a peer's data offsets count from the start of the arena's data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ArenaLayout {
    /// A shmhca segment: a validated header page, then the data.
    #[default]
    Segment,
    /// A protection domain over the application's own memfd
    /// ([`Context::alloc_pd_over`](crate::Context::alloc_pd_over)): data from byte 0, no
    /// header; the receiver checks the memfd's seals instead.
    Memfd,
}

impl ArenaLayout {
    fn code(self) -> u8 {
        match self {
            ArenaLayout::Segment => 0,
            ArenaLayout::Memfd => 1,
        }
    }

    fn decode(v: u8, what: &'static str) -> std::result::Result<ArenaLayout, MsgError> {
        match v {
            0 => Ok(ArenaLayout::Segment),
            1 => Ok(ArenaLayout::Memfd),
            v => Err(MsgError::Field {
                what,
                field: "arena_layout",
                value: u64::from(v),
                allowed: "0 (a shmhca segment) or 1 (a protection domain over a memfd)",
            }),
        }
    }
}

/// REQ: the client asks for a connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Req {
    /// The client engine's identity.
    pub identity: u64,
    /// The client engine's endpoint number in captures.
    pub trace_id: u32,
    /// Whether the link is new or reused.
    pub link_mode: LinkMode,
    /// How the client QP's arena is laid out.
    pub arena_layout: ArenaLayout,
    /// The link's token.
    pub link_token: u64,
    /// The client's QP parameters.
    pub offer: Offer,
    /// Data for the server's application (at most [`MAX_PRIVATE_DATA`] bytes).
    pub private_data: Vec<u8>,
}

/// REP: the server accepts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rep {
    /// The REQ's link token, echoed.
    pub link_token: u64,
    /// How the server QP's arena is laid out.
    pub arena_layout: ArenaLayout,
    /// The server's QP parameters (with the negotiated PMTU, responder resources and
    /// initiator depth).
    pub offer: Offer,
    /// Data for the client's application (at most [`MAX_PRIVATE_DATA`] bytes).
    pub private_data: Vec<u8>,
}

/// Why a side rejected the connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RejectReason {
    /// The peer's credentials (SO_PEERCRED) are not admitted by this side's policy.
    PeerRefused,
    /// A field of the peer's message is out of range; the text names it.
    InvalidParameter,
    /// The peer's parameters cannot be met by this side.
    Incompatible,
    /// The REQ named a link this side does not have (any more); retry with a new link.
    UnknownLink,
    /// This side ran out of a resource (QPs, arena, memory mappings).
    NoResources,
    /// The peer's protocol version is not supported.
    UnsupportedVersion,
    /// A message arrived out of turn, or was malformed.
    ProtocolError,
    /// This side failed to finish its part of the setup.
    Aborted,
    /// A reason code this build does not know.
    Unknown(u16),
}

impl RejectReason {
    /// The reason's code on the wire.
    pub fn code(self) -> u16 {
        match self {
            RejectReason::PeerRefused => 1,
            RejectReason::InvalidParameter => 2,
            RejectReason::Incompatible => 3,
            RejectReason::UnknownLink => 4,
            RejectReason::NoResources => 5,
            RejectReason::UnsupportedVersion => 6,
            RejectReason::ProtocolError => 7,
            RejectReason::Aborted => 8,
            RejectReason::Unknown(c) => c,
        }
    }

    /// The reason of a code.
    pub fn from_code(code: u16) -> RejectReason {
        match code {
            1 => RejectReason::PeerRefused,
            2 => RejectReason::InvalidParameter,
            3 => RejectReason::Incompatible,
            4 => RejectReason::UnknownLink,
            5 => RejectReason::NoResources,
            6 => RejectReason::UnsupportedVersion,
            7 => RejectReason::ProtocolError,
            8 => RejectReason::Aborted,
            c => RejectReason::Unknown(c),
        }
    }
}

impl fmt::Display for RejectReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RejectReason::PeerRefused => f.write_str("peer refused"),
            RejectReason::InvalidParameter => f.write_str("invalid parameter"),
            RejectReason::Incompatible => f.write_str("incompatible parameters"),
            RejectReason::UnknownLink => f.write_str("unknown link"),
            RejectReason::NoResources => f.write_str("no resources"),
            RejectReason::UnsupportedVersion => f.write_str("unsupported version"),
            RejectReason::ProtocolError => f.write_str("protocol error"),
            RejectReason::Aborted => f.write_str("setup aborted"),
            RejectReason::Unknown(c) => write!(f, "reason code {c}"),
        }
    }
}

/// REJ: a side gives up, saying why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rej {
    /// The reason.
    pub reason: RejectReason,
    /// What was wrong (at most [`MAX_REJECT_TEXT`] bytes; longer text is cut when encoded).
    pub text: String,
}

/// One connection-manager message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    /// Server → client, first.
    Hello(Hello),
    /// Client → server: the connection request.
    Req(Req),
    /// Server → client: the reply.
    Rep(Rep),
    /// Client → server: ready to use.
    Rtu,
    /// Either side: rejected.
    Rej(Rej),
    /// Either side, after setup: "still here" (see the module documentation).
    Keepalive,
}

fn le32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn le64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

/// Cuts `s` to at most `max` bytes on a character boundary.
fn cut(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

impl Message {
    /// The message's name, for errors.
    pub fn name(&self) -> &'static str {
        match self {
            Message::Hello(_) => "HELLO",
            Message::Req(_) => "REQ",
            Message::Rep(_) => "REP",
            Message::Rtu => "RTU",
            Message::Rej(_) => "REJ",
            Message::Keepalive => "KEEPALIVE",
        }
    }

    /// Encodes the message, header included. Private data beyond [`MAX_PRIVATE_DATA`]
    /// bytes is encoded as it is (the receiver rejects it); REJ text is cut to
    /// [`MAX_REJECT_TEXT`] bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut body = Vec::with_capacity(128);
        let t = match self {
            Message::Hello(h) => {
                body.extend_from_slice(&h.identity.to_le_bytes());
                body.extend_from_slice(&h.trace_id.to_le_bytes());
                body.extend_from_slice(&[0; 4]);
                ty::HELLO
            }
            Message::Req(r) => {
                body.extend_from_slice(&r.identity.to_le_bytes());
                body.extend_from_slice(&r.trace_id.to_le_bytes());
                body.push(match r.link_mode {
                    LinkMode::ReuseClientCreated => 0,
                    LinkMode::New => 1,
                    LinkMode::ReuseServerCreated => 2,
                });
                body.push(r.arena_layout.code());
                body.extend_from_slice(&[0; 2]);
                body.extend_from_slice(&r.link_token.to_le_bytes());
                r.offer.encode(&mut body);
                body.extend_from_slice(&(r.private_data.len() as u16).to_le_bytes());
                body.extend_from_slice(&[0; 2]);
                body.extend_from_slice(&r.private_data);
                ty::REQ
            }
            Message::Rep(r) => {
                body.extend_from_slice(&r.link_token.to_le_bytes());
                r.offer.encode(&mut body);
                body.extend_from_slice(&(r.private_data.len() as u16).to_le_bytes());
                body.push(r.arena_layout.code());
                body.push(0);
                body.extend_from_slice(&r.private_data);
                ty::REP
            }
            Message::Rtu => ty::RTU,
            Message::Keepalive => ty::KEEPALIVE,
            Message::Rej(r) => {
                let text = cut(&r.text, MAX_REJECT_TEXT);
                body.extend_from_slice(&r.reason.code().to_le_bytes());
                body.extend_from_slice(&(text.len() as u16).to_le_bytes());
                body.extend_from_slice(text.as_bytes());
                ty::REJ
            }
        };
        let mut out = Vec::with_capacity(HEADER_LEN + body.len());
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&t.to_le_bytes());
        out.extend_from_slice(&(body.len() as u32).to_le_bytes());
        out.extend_from_slice(&body);
        out
    }

    /// Decodes the body of a message of type `msg_type` (from its [`Header`]).
    ///
    /// # Errors
    /// A [`MsgError`] naming what is malformed; never a panic.
    pub fn decode(msg_type: u16, body: &[u8]) -> std::result::Result<Message, MsgError> {
        let exact = |what: &'static str, expected: usize| {
            if body.len() == expected {
                Ok(())
            } else {
                Err(MsgError::Length {
                    what,
                    len: body.len(),
                    expected,
                })
            }
        };
        let at_least = |what: &'static str, fixed: usize| {
            if body.len() >= fixed {
                Ok(())
            } else {
                Err(MsgError::Length {
                    what,
                    len: body.len(),
                    expected: fixed,
                })
            }
        };
        // The private data length sits at `fixed - 4`; reserved bytes from `reserved` to
        // `fixed`.
        let private = |what: &'static str, fixed: usize, reserved: usize| {
            let n = u16::from_le_bytes([body[fixed - 4], body[fixed - 3]]) as usize;
            if n > MAX_PRIVATE_DATA {
                return Err(MsgError::Field {
                    what,
                    field: "private_data_len",
                    value: n as u64,
                    allowed: "private data is at most 256 bytes",
                });
            }
            if body[reserved..fixed].iter().any(|&b| b != 0) {
                return Err(MsgError::Reserved { what });
            }
            exact(what, fixed + n)?;
            Ok(body[fixed..].to_vec())
        };
        match msg_type {
            ty::HELLO => {
                exact("HELLO", HELLO_LEN)?;
                if body[12..16] != [0; 4] {
                    return Err(MsgError::Reserved { what: "HELLO" });
                }
                Ok(Message::Hello(Hello {
                    identity: le64(body, 0),
                    trace_id: le32(body, 8),
                }))
            }
            ty::REQ => {
                at_least("REQ", REQ_FIXED)?;
                let link_mode = match body[12] {
                    0 => LinkMode::ReuseClientCreated,
                    1 => LinkMode::New,
                    2 => LinkMode::ReuseServerCreated,
                    v => {
                        return Err(MsgError::Field {
                            what: "REQ",
                            field: "link_mode",
                            value: u64::from(v),
                            allowed: "0 (reuse, client-created), 1 (new link) or 2 (reuse, server-created)",
                        });
                    }
                };
                let arena_layout = ArenaLayout::decode(body[13], "REQ")?;
                if body[14..16] != [0; 2] {
                    return Err(MsgError::Reserved { what: "REQ" });
                }
                let offer = Offer::decode(&body[24..24 + OFFER_LEN], "REQ")?;
                let private_data = private("REQ", REQ_FIXED, REQ_FIXED - 2)?;
                Ok(Message::Req(Req {
                    identity: le64(body, 0),
                    trace_id: le32(body, 8),
                    link_mode,
                    arena_layout,
                    link_token: le64(body, 16),
                    offer,
                    private_data,
                }))
            }
            ty::REP => {
                at_least("REP", REP_FIXED)?;
                let offer = Offer::decode(&body[8..8 + OFFER_LEN], "REP")?;
                let arena_layout = ArenaLayout::decode(body[REP_FIXED - 2], "REP")?;
                let private_data = private("REP", REP_FIXED, REP_FIXED - 1)?;
                Ok(Message::Rep(Rep {
                    link_token: le64(body, 0),
                    arena_layout,
                    offer,
                    private_data,
                }))
            }
            ty::RTU => {
                exact("RTU", 0)?;
                Ok(Message::Rtu)
            }
            ty::KEEPALIVE => {
                exact("KEEPALIVE", 0)?;
                Ok(Message::Keepalive)
            }
            ty::REJ => {
                at_least("REJ", REJ_FIXED)?;
                let n = u16::from_le_bytes([body[2], body[3]]) as usize;
                if n > MAX_REJECT_TEXT {
                    return Err(MsgError::Field {
                        what: "REJ",
                        field: "text_len",
                        value: n as u64,
                        allowed: "the reason text is at most 256 bytes",
                    });
                }
                exact("REJ", REJ_FIXED + n)?;
                Ok(Message::Rej(Rej {
                    reason: RejectReason::from_code(u16::from_le_bytes([body[0], body[1]])),
                    text: String::from_utf8_lossy(&body[REJ_FIXED..]).into_owned(),
                }))
            }
            t => Err(MsgError::UnknownType(t)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn offer() -> Offer {
        Offer {
            qpn: 0x1005,
            start_psn: 0xabcdef,
            pmtu: 1024,
            local_ack_timeout: 14,
            target_ack_delay: 3,
            retry_count: 7,
            rnr_retry_count: 6,
            min_rnr_timer: 12,
            credits: 1,
            responder_resources: 4,
            initiator_depth: 2,
            max_send_wr: 128,
            max_recv_wr: 64,
            max_send_sge: 2,
            max_recv_sge: 3,
            max_inline_data: 64,
        }
    }

    fn roundtrip(m: &Message) -> Message {
        let b = m.encode();
        let h = Header::parse(b[..HEADER_LEN].try_into().unwrap()).unwrap();
        assert_eq!(h.body_len as usize, b.len() - HEADER_LEN);
        Message::decode(h.msg_type, &b[HEADER_LEN..]).unwrap()
    }

    #[test]
    fn every_message_round_trips() {
        let msgs = [
            Message::Hello(Hello {
                identity: 0x1234_5678_9abc_def0,
                trace_id: 77,
            }),
            Message::Req(Req {
                identity: 42,
                trace_id: 9,
                link_mode: LinkMode::New,
                arena_layout: ArenaLayout::Segment,
                link_token: 0xfeed,
                offer: offer(),
                private_data: vec![1, 2, 3],
            }),
            Message::Req(Req {
                identity: 42,
                trace_id: 9,
                link_mode: LinkMode::ReuseServerCreated,
                arena_layout: ArenaLayout::Segment,
                link_token: 1,
                offer: offer(),
                private_data: vec![0xaa; MAX_PRIVATE_DATA],
            }),
            Message::Rep(Rep {
                link_token: 0xfeed,
                arena_layout: ArenaLayout::Memfd,
                offer: offer(),
                private_data: vec![],
            }),
            Message::Rtu,
            Message::Keepalive,
            Message::Rej(Rej {
                reason: RejectReason::Incompatible,
                text: "pmtu 1000".into(),
            }),
        ];
        for m in &msgs {
            assert_eq!(&roundtrip(m), m);
        }
    }

    #[test]
    fn the_layout_is_the_documented_one() {
        let b = Message::Req(Req {
            identity: 0x0102_0304_0506_0708,
            trace_id: 0x0a0b_0c0d,
            link_mode: LinkMode::New,
            arena_layout: ArenaLayout::Segment,
            link_token: 0x1122_3344_5566_7788,
            offer: offer(),
            private_data: vec![0xee; 5],
        })
        .encode();
        assert_eq!(&b[..8], b"SHMHCACM");
        assert_eq!(&b[8..16], &[2, 0, 2, 0, 73, 0, 0, 0]);
        assert_eq!(
            Message::Keepalive.encode(),
            b"SHMHCACM\x02\x00\x06\x00\x00\x00\x00\x00",
            "a KEEPALIVE is a header alone"
        );
        let body = &b[16..];
        assert_eq!(&body[..8], &0x0102_0304_0506_0708u64.to_le_bytes());
        assert_eq!(body[12], 1);
        assert_eq!(&body[16..24], &0x1122_3344_5566_7788u64.to_le_bytes());
        assert_eq!(&body[24..28], &0x1005u32.to_le_bytes(), "QPN");
        assert_eq!(&body[28..32], &0xabcdefu32.to_le_bytes(), "PSN");
        assert_eq!(&body[32..34], &1024u16.to_le_bytes(), "PMTU");
        assert_eq!(&body[34..42], &[14, 3, 7, 6, 12, 1, 4, 2]);
        assert_eq!(&body[44..48], &128u32.to_le_bytes(), "max_send_wr");
        assert_eq!(&body[60..64], &64u32.to_le_bytes(), "max_inline_data");
        assert_eq!(&body[64..66], &5u16.to_le_bytes());
        assert_eq!(&body[68..], &[0xee; 5]);
    }

    #[test]
    fn malformed_headers_are_named() {
        let mut h = [0u8; HEADER_LEN];
        h[..8].copy_from_slice(b"GET / HT");
        assert!(
            matches!(Header::parse(&h), Err(MsgError::BadMagic { found }) if found == "GET / HT")
        );
        let mut good = Message::Rtu.encode();
        good[8] = 9;
        let e = Header::parse(good[..16].try_into().unwrap()).unwrap_err();
        assert_eq!(e, MsgError::Version { found: 9, ours: 2 });
        assert!(e.to_string().contains("version 9") && e.to_string().contains("version 2"));
        let mut long = Message::Rtu.encode();
        long[12..16].copy_from_slice(&(MAX_BODY as u32 + 1).to_le_bytes());
        assert!(matches!(
            Header::parse(long[..16].try_into().unwrap()),
            Err(MsgError::TooLong { len: 1025, .. })
        ));
    }

    #[test]
    fn malformed_bodies_are_rejected_without_panicking() {
        assert!(matches!(
            Message::decode(2, &[0; 10]),
            Err(MsgError::Length { what: "REQ", .. })
        ));
        assert_eq!(Message::decode(99, &[]), Err(MsgError::UnknownType(99)));
        assert!(matches!(
            Message::decode(4, &[0]),
            Err(MsgError::Length { what: "RTU", .. })
        ));
        let mut req = Message::Req(Req {
            identity: 1,
            trace_id: 1,
            link_mode: LinkMode::ReuseServerCreated,
            arena_layout: ArenaLayout::Segment,
            link_token: 1,
            offer: offer(),
            private_data: vec![],
        })
        .encode();
        let body = req.split_off(HEADER_LEN);
        let mut b = body.clone();
        b[12] = 3;
        assert!(matches!(
            Message::decode(2, &b),
            Err(MsgError::Field {
                field: "link_mode",
                ..
            })
        ));
        let mut b = body.clone();
        b[14] = 1;
        assert_eq!(
            Message::decode(2, &b),
            Err(MsgError::Reserved { what: "REQ" })
        );
        let mut b = body.clone();
        b[13] = 2;
        assert!(matches!(
            Message::decode(2, &b),
            Err(MsgError::Field {
                field: "arena_layout",
                ..
            })
        ));
        let mut rep = Message::Rep(Rep {
            link_token: 1,
            arena_layout: ArenaLayout::Memfd,
            offer: offer(),
            private_data: vec![],
        })
        .encode();
        let rep_body = rep.split_off(HEADER_LEN);
        assert_eq!(rep_body[50], 1, "REP byte 50 is the arena layout");
        let mut b = rep_body.clone();
        b[50] = 2;
        assert!(matches!(
            Message::decode(3, &b),
            Err(MsgError::Field {
                field: "arena_layout",
                ..
            })
        ));
        let mut b = rep_body.clone();
        b[51] = 1;
        assert_eq!(
            Message::decode(3, &b),
            Err(MsgError::Reserved { what: "REP" })
        );
        let mut b = body.clone();
        b[64..66].copy_from_slice(&257u16.to_le_bytes());
        b.extend_from_slice(&[0; 257]);
        assert!(matches!(
            Message::decode(2, &b),
            Err(MsgError::Field {
                field: "private_data_len",
                ..
            })
        ));
        let mut b = body.clone();
        b[64] = 3; // claims 3 bytes of private data that are not there
        assert!(matches!(
            Message::decode(2, &b),
            Err(MsgError::Length { .. })
        ));
        // Every truncation and every single-byte body of every type decodes or errors.
        for t in 0..8u16 {
            for n in 0..body.len() {
                let _ = Message::decode(t, &body[..n]);
            }
        }
    }

    #[test]
    fn offer_ranges_are_checked_by_name() {
        assert!(offer().check().is_ok());
        let cases: [(&str, Offer); 12] = [
            ("qpn", Offer { qpn: 1, ..offer() }),
            (
                "qpn",
                Offer {
                    qpn: 0x100_0000,
                    ..offer()
                },
            ),
            (
                "start_psn",
                Offer {
                    start_psn: 0x100_0000,
                    ..offer()
                },
            ),
            (
                "path MTU",
                Offer {
                    pmtu: 1000,
                    ..offer()
                },
            ),
            (
                "local_ack_timeout",
                Offer {
                    local_ack_timeout: 32,
                    ..offer()
                },
            ),
            (
                "target_ack_delay",
                Offer {
                    target_ack_delay: 32,
                    ..offer()
                },
            ),
            (
                "retry_count",
                Offer {
                    retry_count: 8,
                    ..offer()
                },
            ),
            (
                "rnr_retry_count",
                Offer {
                    rnr_retry_count: 8,
                    ..offer()
                },
            ),
            (
                "credits",
                Offer {
                    credits: 2,
                    ..offer()
                },
            ),
            (
                "responder_resources",
                Offer {
                    responder_resources: 17,
                    ..offer()
                },
            ),
            (
                "max_recv_wr",
                Offer {
                    max_recv_wr: 0,
                    ..offer()
                },
            ),
            (
                "max_send_sge",
                Offer {
                    max_send_sge: 99,
                    ..offer()
                },
            ),
        ];
        for (name, o) in cases {
            let e = o.check().unwrap_err().to_string();
            assert!(e.contains(name), "{name}: {e}");
        }
    }

    #[test]
    fn reject_text_is_cut_on_a_char_boundary() {
        let text = "é".repeat(200); // 400 bytes
        let m = roundtrip(&Message::Rej(Rej {
            reason: RejectReason::Unknown(77),
            text,
        }));
        let Message::Rej(r) = m else { panic!() };
        assert_eq!(r.reason, RejectReason::Unknown(77));
        assert_eq!(r.text.len(), 256);
        assert!(r.text.chars().all(|c| c == 'é'));
    }
}
