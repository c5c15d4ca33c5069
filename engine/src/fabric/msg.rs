//! The fabric's setup messages, exchanged over a LID's Unix socket while a QP goes to RTR.
//!
//! Every message is one 48-byte frame (little-endian; every byte not named is zero):
//!
//! ```text
//!  0..8   magic "SHMHCAFB"
//!  8..10  version (this build: VERSION)
//! 10..11  type: 1 HELLO, 2 WELCOME, 3 LINK, 4 LINK_REPLY, 5 DONE, 6 ATTACH, 7 ATTACH_REPLY
//! 11..12  mode (LINK: 0 reuse, 1 offer, 2 need, 3 offer a pending link; LINK_REPLY: 0 ok, 1 offer, 2 unknown,
//!         3 retry; ATTACH / ATTACH_REPLY: the arena layout, 0 segment, 1 memfd)
//! 12..16  reserved
//! 16..24  engine identity (HELLO, WELCOME) or link token (LINK, LINK_REPLY)
//! 24..28  trace id (HELLO, WELCOME) or the sender's QPN (ATTACH)
//! 28..32  the QPN asked for (ATTACH); 1 if found (ATTACH_REPLY)
//! 32..34  the sender's LID (HELLO, WELCOME)
//! 34..36  the LID the client wants (HELLO)
//! 36..48  reserved
//! ```
//!
//! Descriptors travel with SCM_RIGHTS: a LINK or LINK_REPLY offer carries the link segment
//! and the sender's engine page; an OK to an offer and a DONE carry the sender's engine
//! page; an ATTACH, and an ATTACH_REPLY that found its QP, carry a read-only arena.
//! [`Msg::decode`] checks every field's range and never panics.

/// The first eight bytes of every message.
pub(crate) const MAGIC: [u8; 8] = *b"SHMHCAFB";
/// The protocol version of this build.
pub(crate) const VERSION: u16 = 1;
/// Bytes of every message.
pub(crate) const LEN: usize = 48;

/// What a client asks of the link to the server's engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LinkAsk {
    /// Use the live link named by the token.
    Reuse(u64),
    /// Take the new link whose segment comes with this message.
    Offer(u64),
    /// Take the link whose segment comes with this message, made while the server's LID
    /// had no engine (QPs of the client face it already).
    OfferPending(u64),
    /// Make a link (the client has none, and the server's LID is the lower).
    Need,
}

/// The server's answer about the link.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LinkReply {
    /// The link named by the token it is (after an offer: taken, with the server's page).
    Ok(u64),
    /// Take this segment instead (with the server's engine page).
    Offer(u64),
    /// No live link has the token the client named.
    Unknown,
    /// The server is setting a link up with the client right now: ask again.
    Retry,
}

/// One setup message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Msg {
    /// Client → server, first.
    Hello {
        identity: u64,
        trace_id: u32,
        lid: u16,
        target_lid: u16,
    },
    /// Server → client, the answer to HELLO.
    Welcome {
        identity: u64,
        trace_id: u32,
        lid: u16,
    },
    Link(LinkAsk),
    LinkReply(LinkReply),
    /// Client → server after taking the server's offer (with the client's engine page).
    Done,
    /// Client → server: the sender's QP and its arena; which QP's arena it wants back.
    Attach {
        qpn: u32,
        want: u32,
        memfd: bool,
    },
    /// Server → client: the wanted QP's arena, if there is such a QP.
    AttachReply {
        found: bool,
        memfd: bool,
    },
}

/// A malformed message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Malformed(pub(crate) String);

impl Msg {
    /// The message's name, for errors.
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Msg::Hello { .. } => "HELLO",
            Msg::Welcome { .. } => "WELCOME",
            Msg::Link(_) => "LINK",
            Msg::LinkReply(_) => "LINK_REPLY",
            Msg::Done => "DONE",
            Msg::Attach { .. } => "ATTACH",
            Msg::AttachReply { .. } => "ATTACH_REPLY",
        }
    }

    /// The frame of this message.
    pub(crate) fn encode(&self) -> [u8; LEN] {
        let mut b = [0u8; LEN];
        b[..8].copy_from_slice(&MAGIC);
        b[8..10].copy_from_slice(&VERSION.to_le_bytes());
        let (ty, mode, word, a, c, lid, target) = match *self {
            Msg::Hello {
                identity,
                trace_id,
                lid,
                target_lid,
            } => (1, 0, identity, trace_id, 0, lid, target_lid),
            Msg::Welcome {
                identity,
                trace_id,
                lid,
            } => (2, 0, identity, trace_id, 0, lid, 0),
            Msg::Link(ask) => {
                let (m, t) = match ask {
                    LinkAsk::Reuse(t) => (0, t),
                    LinkAsk::Offer(t) => (1, t),
                    LinkAsk::Need => (2, 0),
                    LinkAsk::OfferPending(t) => (3, t),
                };
                (3, m, t, 0, 0, 0, 0)
            }
            Msg::LinkReply(r) => {
                let (m, t) = match r {
                    LinkReply::Ok(t) => (0, t),
                    LinkReply::Offer(t) => (1, t),
                    LinkReply::Unknown => (2, 0),
                    LinkReply::Retry => (3, 0),
                };
                (4, m, t, 0, 0, 0, 0)
            }
            Msg::Done => (5, 0, 0, 0, 0, 0, 0),
            Msg::Attach { qpn, want, memfd } => (6, u8::from(memfd), 0, qpn, want, 0, 0),
            Msg::AttachReply { found, memfd } => (7, u8::from(memfd), 0, 0, u32::from(found), 0, 0),
        };
        b[10] = ty;
        b[11] = mode;
        b[16..24].copy_from_slice(&word.to_le_bytes());
        b[24..28].copy_from_slice(&a.to_le_bytes());
        b[28..32].copy_from_slice(&c.to_le_bytes());
        b[32..34].copy_from_slice(&lid.to_le_bytes());
        b[34..36].copy_from_slice(&target.to_le_bytes());
        b
    }

    /// Parses and checks a frame.
    ///
    /// # Errors
    /// [`Malformed`] naming what is wrong.
    pub(crate) fn decode(b: &[u8; LEN]) -> Result<Msg, Malformed> {
        let bad = |s: String| Err(Malformed(s));
        if b[..8] != MAGIC {
            return bad(format!(
                "not a shmhca fabric peer: it sent {:?} where \"SHMHCAFB\" belongs",
                b[..8].escape_ascii().to_string()
            ));
        }
        let version = u16::from_le_bytes([b[8], b[9]]);
        if version != VERSION {
            return bad(format!(
                "the peer speaks fabric protocol version {version}, this side {VERSION}: run the same shmhca version on both sides"
            ));
        }
        let (ty, mode) = (b[10], b[11]);
        let word = u64::from_le_bytes(b[16..24].try_into().expect("8 bytes"));
        let a = u32::from_le_bytes(b[24..28].try_into().expect("4 bytes"));
        let c = u32::from_le_bytes(b[28..32].try_into().expect("4 bytes"));
        let lid = u16::from_le_bytes([b[32], b[33]]);
        let target = u16::from_le_bytes([b[34], b[35]]);
        let zero = |r: std::ops::Range<usize>| b[r].iter().all(|&x| x == 0);
        if !zero(12..16) || !zero(36..48) {
            return bad("reserved bytes are not zero".into());
        }
        let lid_ok = |l: u16| (super::dir::MIN_LID..=super::dir::MAX_LID).contains(&l);
        // Fields a type does not use must be zero.
        let unused = |word_used: bool, a_used: bool, c_used: bool, lids: u8| {
            (word_used || word == 0)
                && (a_used || a == 0)
                && (c_used || c == 0)
                && (lids >= 1 || lid == 0)
                && (lids >= 2 || target == 0)
        };
        let m = match ty {
            1 if mode == 0 && unused(true, true, false, 2) && lid_ok(lid) && lid_ok(target) => {
                Msg::Hello {
                    identity: word,
                    trace_id: a,
                    lid,
                    target_lid: target,
                }
            }
            2 if mode == 0 && unused(true, true, false, 1) && lid_ok(lid) => Msg::Welcome {
                identity: word,
                trace_id: a,
                lid,
            },
            3 if unused(true, false, false, 0) => Msg::Link(match mode {
                0 => LinkAsk::Reuse(word),
                1 => LinkAsk::Offer(word),
                2 if word == 0 => LinkAsk::Need,
                3 => LinkAsk::OfferPending(word),
                _ => return bad(format!("LINK with mode {mode}")),
            }),
            4 if unused(true, false, false, 0) => Msg::LinkReply(match mode {
                0 => LinkReply::Ok(word),
                1 => LinkReply::Offer(word),
                2 if word == 0 => LinkReply::Unknown,
                3 if word == 0 => LinkReply::Retry,
                _ => return bad(format!("LINK_REPLY with mode {mode}")),
            }),
            5 if mode == 0 && unused(false, false, false, 0) => Msg::Done,
            6 if mode <= 1 && unused(false, true, true, 0) && a < 1 << 24 && c < 1 << 24 => {
                Msg::Attach {
                    qpn: a,
                    want: c,
                    memfd: mode == 1,
                }
            }
            7 if mode <= 1 && unused(false, false, true, 0) && c <= 1 => Msg::AttachReply {
                found: c == 1,
                memfd: mode == 1,
            },
            _ => {
                return bad(format!(
                    "message type {ty} with fields out of range (mode {mode}, LIDs {lid}, {target}, QPNs {a:#x}, {c:#x})"
                ));
            }
        };
        Ok(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_message_survives_a_round_trip() {
        let all = [
            Msg::Hello {
                identity: 0x1122_3344_5566_7788,
                trace_id: 9,
                lid: 1,
                target_lid: 0xbfff,
            },
            Msg::Welcome {
                identity: 5,
                trace_id: 6,
                lid: 300,
            },
            Msg::Link(LinkAsk::Reuse(42)),
            Msg::Link(LinkAsk::Offer(43)),
            Msg::Link(LinkAsk::Need),
            Msg::Link(LinkAsk::OfferPending(46)),
            Msg::LinkReply(LinkReply::Ok(44)),
            Msg::LinkReply(LinkReply::Offer(45)),
            Msg::LinkReply(LinkReply::Unknown),
            Msg::LinkReply(LinkReply::Retry),
            Msg::Done,
            Msg::Attach {
                qpn: 0xabcdef,
                want: 0x12,
                memfd: true,
            },
            Msg::AttachReply {
                found: true,
                memfd: false,
            },
        ];
        for m in all {
            assert_eq!(Msg::decode(&m.encode()), Ok(m), "{}", m.name());
        }
    }

    #[test]
    fn bad_frames_are_refused_without_panicking() {
        let good = Msg::Hello {
            identity: 1,
            trace_id: 2,
            lid: 3,
            target_lid: 4,
        }
        .encode();
        let mut magic = good;
        magic[0] = b'X';
        assert!(Msg::decode(&magic).unwrap_err().0.contains("SHMHCAFB"));
        let mut ver = good;
        ver[8] = 9;
        assert!(Msg::decode(&ver).unwrap_err().0.contains("version"));
        let mut lid0 = good;
        lid0[32] = 0;
        assert!(Msg::decode(&lid0).is_err(), "LID 0 is no unicast LID");
        let mut multicast = good;
        multicast[34..36].copy_from_slice(&0xc000u16.to_le_bytes());
        assert!(Msg::decode(&multicast).is_err());
        let mut qpn = Msg::Attach {
            qpn: 1,
            want: 2,
            memfd: false,
        }
        .encode();
        qpn[27] = 1; // QPN 2^24 + 1
        assert!(Msg::decode(&qpn).is_err());
        // Every single-byte change of every message either decodes to a valid message or
        // is refused; none panics.
        for m in [good, Msg::Done.encode(), qpn] {
            for i in 0..LEN {
                for v in [0u8, 1, 0x7f, 0xff] {
                    let mut f = m;
                    f[i] = v;
                    let _ = Msg::decode(&f);
                }
            }
        }
    }
}
