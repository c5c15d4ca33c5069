//! The ACK Extended Transport Header (AETH, 4 bytes; spec 01 Figure 17-6, Tables 17-3 and
//! 17-4; spec 02 Table 17-8).
//!
//! ```text
//! +-----------+--------------------------------------+
//! | Syndrome  |              MSN (24)                |
//! +-----------+--------------------------------------+
//! ```
//!
//! Syndrome bits 6:5 say what the packet is (bit 7 is reserved, 0):
//!
//! | bits 7:5 | meaning                                             | bits 4:0            |
//! |----------|-----------------------------------------------------|---------------------|
//! | `000`    | positive Ack                                        | credit count        |
//! | `001`    | RNR Nak                                             | RNR timer code      |
//! | `010`    | reserved                                            |                     |
//! | `011`    | Nak                                                 | Nak code (17-4)     |

use core::time::Duration;

use super::{Msn, Result, read_u24, write_u24};

mod field {
    use crate::wire::Field;

    pub(super) const SYNDROME: usize = 0;
    pub(super) const MSN: Field = 1..4;
}

/// The length of an AETH in bytes.
pub const HEADER_LEN: usize = 4;

/// A 5-bit end-to-end credit code (spec 02 Table 17-8): the number of receive WQEs
/// posted at the responder, in a logarithmic encoding; `0b11111` means "no credit count".
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CreditCode(u8);

/// Table 17-8: the credit count each code stands for (code 31 is "invalid", no count).
const CREDITS: [u32; 31] = [
    0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536,
    2048, 3072, 4096, 6144, 8192, 12288, 16384, 24576, 32768,
];

impl CreditCode {
    /// `0b11111`: the responder gives no credit count.
    pub const NONE: CreditCode = CreditCode(0b1_1111);

    /// Makes a credit code from the low 5 bits of `code`.
    pub const fn new(code: u8) -> CreditCode {
        CreditCode(code & 0x1F)
    }

    /// The code, `0..=31`.
    pub const fn get(self) -> u8 {
        self.0
    }

    /// Whether this is the "no credit count" code.
    pub const fn is_none(self) -> bool {
        self.0 == Self::NONE.0
    }

    /// The number of credits (receive WQEs) the code stands for (Table 17-8), or `None`
    /// for the "no credit count" code.
    pub const fn credits(self) -> Option<u32> {
        if self.is_none() {
            None
        } else {
            Some(CREDITS[self.0 as usize])
        }
    }

    /// The largest code whose credit count does not exceed `available` receive WQEs (a
    /// responder never advertises more than it has). 32768 or more encode as code 30.
    pub const fn encode(available: u32) -> CreditCode {
        // Table 17-8 counts 0..=4, then alternates 2^k and 1.5 * 2^k: the code of 2^k is
        // 2k and the code of 1.5 * 2^k is 2k + 1. (Closed form: this runs per Ack.)
        if available < 4 {
            return CreditCode(available as u8);
        }
        if available >= 32768 {
            return CreditCode(30);
        }
        let k = 31 - available.leading_zeros();
        let half_step = (available >> (k - 1)) & 1;
        CreditCode((2 * k + half_step) as u8)
    }
}

/// A 5-bit RNR Nak timer code: the minimum time the requester waits before retrying
/// (DESIGN.md "RNR Nak timer codes", spec 01 Table 17-6).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RnrTimer(u8);

/// The RNR timer codes in units of 10 µs (code 0 is the longest, 655.36 ms).
const RNR_10US: [u32; 32] = [
    65536, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536,
    2048, 3072, 4096, 6144, 8192, 12288, 16384, 24576, 32768, 49152,
];

impl RnrTimer {
    /// Makes a timer code from the low 5 bits of `code`.
    pub const fn new(code: u8) -> RnrTimer {
        RnrTimer(code & 0x1F)
    }

    /// The code, `0..=31`.
    pub const fn get(self) -> u8 {
        self.0
    }

    /// The delay the code stands for (0 → 655.36 ms, 1 → 10 µs, …, 31 → 491.52 ms).
    pub const fn duration(self) -> Duration {
        Duration::from_micros(RNR_10US[self.0 as usize] as u64 * 10)
    }
}

/// A Nak error code (spec 01 Table 17-4).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum NakCode {
    /// 0: PSN Sequence Error (a request arrived ahead of ePSN).
    PsnSequenceError,
    /// 1: Invalid Request.
    InvalidRequest,
    /// 2: Remote Access Error (R_Key, bounds or rights).
    RemoteAccessError,
    /// 3: Remote Operational Error.
    RemoteOperationalError,
    /// 4: Invalid RD Request (Reliable Datagram only; never sent on RC).
    InvalidRdRequest,
    /// 5..=31: reserved codes, kept as received.
    Unknown(u8),
}

impl NakCode {
    /// Decodes the low 5 bits of `code`.
    pub const fn from_u8(code: u8) -> NakCode {
        match code & 0x1F {
            0 => NakCode::PsnSequenceError,
            1 => NakCode::InvalidRequest,
            2 => NakCode::RemoteAccessError,
            3 => NakCode::RemoteOperationalError,
            4 => NakCode::InvalidRdRequest,
            other => NakCode::Unknown(other),
        }
    }

    /// The 5-bit code (`Unknown` keeps its low 5 bits).
    pub const fn to_u8(self) -> u8 {
        match self {
            NakCode::PsnSequenceError => 0,
            NakCode::InvalidRequest => 1,
            NakCode::RemoteAccessError => 2,
            NakCode::RemoteOperationalError => 3,
            NakCode::InvalidRdRequest => 4,
            NakCode::Unknown(code) => code & 0x1F,
        }
    }
}

/// The AETH Syndrome (spec 01 Table 17-3): what kind of acknowledgement this is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Syndrome {
    /// `000CCCCC`: positive Ack, with the responder's credit count.
    Ack {
        /// The credit code.
        credits: CreditCode,
    },
    /// `001TTTTT`: Receiver Not Ready Nak, with the minimum delay before a retry.
    RnrNak {
        /// The RNR timer code.
        timer: RnrTimer,
    },
    /// `011NNNNN`: Nak with an error code.
    Nak(NakCode),
    /// `010XXXXX` or any byte with bit 7 set: reserved; the whole byte as received.
    Reserved(u8),
}

impl Syndrome {
    /// Decodes a syndrome byte. Every byte decodes, and `from_u8(b).to_u8() == b` for all `b`.
    pub const fn from_u8(b: u8) -> Syndrome {
        match b >> 5 {
            0b000 => Syndrome::Ack {
                credits: CreditCode::new(b),
            },
            0b001 => Syndrome::RnrNak {
                timer: RnrTimer::new(b),
            },
            0b011 => Syndrome::Nak(NakCode::from_u8(b)),
            _ => Syndrome::Reserved(b),
        }
    }

    /// Encodes the syndrome byte. `Reserved(b)` gives `b` unchanged, so a reserved syndrome
    /// is reproduced as it was received.
    pub const fn to_u8(self) -> u8 {
        match self {
            Syndrome::Ack { credits } => credits.get(),
            Syndrome::RnrNak { timer } => 0b0010_0000 | timer.get(),
            Syndrome::Nak(code) => 0b0110_0000 | code.to_u8(),
            Syndrome::Reserved(b) => b,
        }
    }

    /// Whether this is a positive Ack.
    pub const fn is_ack(self) -> bool {
        matches!(self, Syndrome::Ack { .. })
    }
}

super::header_view!("an AETH");

impl<T: AsRef<[u8]>> Packet<T> {
    /// Syndrome (byte 0, Table 17-3).
    pub fn syndrome(&self) -> Syndrome {
        Syndrome::from_u8(self.buffer.as_ref()[field::SYNDROME])
    }

    /// The credit code if the syndrome is a positive Ack (`000CCCCC`), else `None`:
    /// [`syndrome`](Packet::syndrome) without decoding the other classes (the Ack fast
    /// path reads this).
    #[inline]
    pub fn ack_credits(&self) -> Option<CreditCode> {
        let b = self.buffer.as_ref()[field::SYNDROME];
        if b >> 5 == 0 {
            Some(CreditCode::new(b))
        } else {
            None
        }
    }

    /// MSN, Message Sequence Number (bytes 1-3): the SSN of the last message the responder
    /// completed (spec 02).
    pub fn msn(&self) -> Msn {
        Msn::new(read_u24(&self.buffer.as_ref()[field::MSN]))
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
    /// Sets Syndrome.
    pub fn set_syndrome(&mut self, syndrome: Syndrome) {
        self.buffer.as_mut()[field::SYNDROME] = syndrome.to_u8();
    }

    /// Sets MSN.
    pub fn set_msn(&mut self, msn: Msn) {
        write_u24(&mut self.buffer.as_mut()[field::MSN], msn.get());
    }
}

/// A decoded AETH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AethRepr {
    /// Syndrome.
    pub syndrome: Syndrome,
    /// MSN.
    pub msn: Msn,
}

impl AethRepr {
    /// Parses an AETH. Every syndrome byte is accepted (reserved ones as
    /// [`Syndrome::Reserved`]); judging them is the completer's job.
    ///
    /// # Errors
    ///
    /// [`Error::Truncated`](super::Error::Truncated) if the buffer is shorter than [`HEADER_LEN`].
    #[inline]
    pub fn parse<T: AsRef<[u8]>>(packet: &Packet<T>) -> Result<AethRepr> {
        packet.check_len()?;
        Ok(AethRepr {
            syndrome: packet.syndrome(),
            msn: packet.msn(),
        })
    }

    /// The length of the emitted header: [`HEADER_LEN`].
    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    /// Writes the AETH into a buffer of at least [`HEADER_LEN`] bytes.
    #[inline]
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, packet: &mut Packet<T>) {
        packet.set_syndrome(self.syndrome);
        packet.set_msn(self.msn);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::Error;

    #[test]
    fn ack_credits_is_the_credit_code_of_a_positive_ack_for_every_byte() {
        for b in 0..=u8::MAX {
            let bytes = [b, 1, 2, 3];
            let p = Packet::new_unchecked(&bytes[..]);
            let want = match p.syndrome() {
                Syndrome::Ack { credits } => Some(credits),
                _ => None,
            };
            assert_eq!(p.ack_credits(), want, "syndrome {b:#04x}");
        }
    }

    #[test]
    fn syndrome_classes_bit_exact() {
        assert_eq!(
            Syndrome::from_u8(0b0000_0110),
            Syndrome::Ack {
                credits: CreditCode::new(6)
            }
        );
        assert_eq!(
            Syndrome::from_u8(0b0001_1111),
            Syndrome::Ack {
                credits: CreditCode::NONE
            }
        );
        assert_eq!(
            Syndrome::from_u8(0b0011_1111),
            Syndrome::RnrNak {
                timer: RnrTimer::new(31)
            }
        );
        assert_eq!(
            Syndrome::from_u8(0x60),
            Syndrome::Nak(NakCode::PsnSequenceError)
        );
        assert_eq!(
            Syndrome::from_u8(0x61),
            Syndrome::Nak(NakCode::InvalidRequest)
        );
        assert_eq!(
            Syndrome::from_u8(0x62),
            Syndrome::Nak(NakCode::RemoteAccessError)
        );
        assert_eq!(
            Syndrome::from_u8(0x63),
            Syndrome::Nak(NakCode::RemoteOperationalError)
        );
        assert_eq!(
            Syndrome::from_u8(0x64),
            Syndrome::Nak(NakCode::InvalidRdRequest)
        );
        assert_eq!(Syndrome::from_u8(0x65), Syndrome::Nak(NakCode::Unknown(5)));
        assert_eq!(Syndrome::from_u8(0x7F), Syndrome::Nak(NakCode::Unknown(31)));
        assert_eq!(Syndrome::from_u8(0x40), Syndrome::Reserved(0x40));
        assert_eq!(Syndrome::from_u8(0x80), Syndrome::Reserved(0x80));
        assert_eq!(Syndrome::from_u8(0xE0), Syndrome::Reserved(0xE0));

        assert_eq!(Syndrome::Nak(NakCode::RemoteAccessError).to_u8(), 0x62);
        assert_eq!(
            Syndrome::RnrNak {
                timer: RnrTimer::new(14)
            }
            .to_u8(),
            0x2E
        );
        assert!(Syndrome::from_u8(3).is_ack());
        assert!(!Syndrome::from_u8(0x23).is_ack());
    }

    #[test]
    fn syndrome_round_trips_every_byte() {
        for b in 0..=u8::MAX {
            assert_eq!(Syndrome::from_u8(b).to_u8(), b, "syndrome {b:#04x}");
        }
    }

    #[test]
    fn credit_codes_follow_table_17_8() {
        assert_eq!(CreditCode::new(0).credits(), Some(0));
        assert_eq!(CreditCode::new(5).credits(), Some(6));
        assert_eq!(CreditCode::new(13).credits(), Some(96));
        assert_eq!(CreditCode::new(30).credits(), Some(32768));
        assert_eq!(CreditCode::NONE.credits(), None);
        assert_eq!(CreditCode::new(0xFF), CreditCode::NONE);
        // Each code doubles every second step after 4 (2^(n/2) or 3*2^((n-3)/2)).
        for n in 4u32..31 {
            let want = if n % 2 == 0 {
                1 << (n / 2)
            } else {
                3 << ((n - 3) / 2)
            };
            assert_eq!(CreditCode::new(n as u8).credits(), Some(want), "code {n}");
        }
    }

    #[test]
    fn credit_encode_rounds_down() {
        assert_eq!(CreditCode::encode(0).get(), 0);
        assert_eq!(CreditCode::encode(4).get(), 4);
        assert_eq!(CreditCode::encode(5).get(), 4);
        assert_eq!(CreditCode::encode(6).get(), 5);
        assert_eq!(CreditCode::encode(32767).get(), 29);
        assert_eq!(CreditCode::encode(u32::MAX).get(), 30);
        for n in 0..40_000u32 {
            let c = CreditCode::encode(n).credits().unwrap();
            assert!(c <= n);
            let next = CreditCode::new(CreditCode::encode(n).get() + 1).credits();
            assert!(next.is_none_or(|next| next > n), "{n}");
        }
    }

    #[test]
    fn rnr_timer_durations() {
        assert_eq!(RnrTimer::new(0).duration(), Duration::from_micros(655_360));
        assert_eq!(RnrTimer::new(1).duration(), Duration::from_micros(10));
        assert_eq!(RnrTimer::new(14).duration(), Duration::from_micros(1_280));
        assert_eq!(RnrTimer::new(31).duration(), Duration::from_micros(491_520));
        assert_eq!(RnrTimer::new(0x3F).get(), 31);
    }

    // Ack, credit code 6 (8 credits), MSN 0x000018 (spec 02 Figure 17-18).
    static ACK: [u8; 4] = [0x06, 0x00, 0x00, 0x18];
    // RNR Nak, timer 14 (1.28 ms), MSN 0xFFFFFF.
    static RNR: [u8; 4] = [0x2E, 0xFF, 0xFF, 0xFF];
    // Nak, remote access error, MSN 0x123456.
    static NAK: [u8; 4] = [0x62, 0x12, 0x34, 0x56];

    #[test]
    fn deconstruct() {
        let p = Packet::new_checked(&ACK[..]).unwrap();
        assert_eq!(
            p.syndrome(),
            Syndrome::Ack {
                credits: CreditCode::new(6)
            }
        );
        assert_eq!(p.msn(), Msn::new(0x18));
        let p = Packet::new_checked(&RNR[..]).unwrap();
        assert_eq!(
            p.syndrome(),
            Syndrome::RnrNak {
                timer: RnrTimer::new(14)
            }
        );
        assert_eq!(p.msn(), Msn::new(0xFF_FFFF));
        let p = Packet::new_checked(&NAK[..]).unwrap();
        assert_eq!(p.syndrome(), Syndrome::Nak(NakCode::RemoteAccessError));
        assert_eq!(p.msn(), Msn::new(0x12_3456));
    }

    #[test]
    fn construct() {
        let mut buf = [0u8; 4];
        let mut p = Packet::new_unchecked(&mut buf[..]);
        p.set_syndrome(Syndrome::Nak(NakCode::RemoteAccessError));
        p.set_msn(Msn::new(0x12_3456));
        assert_eq!(buf, NAK);
    }

    #[test]
    fn parse_and_emit() {
        for bytes in [ACK, RNR, NAK, [0x40, 0, 0, 1]] {
            let repr = AethRepr::parse(&Packet::new_unchecked(&bytes[..])).unwrap();
            let mut buf = [0xAAu8; 4];
            repr.emit(&mut Packet::new_unchecked(&mut buf[..]));
            assert_eq!(buf, bytes);
            assert_eq!(repr.buffer_len(), 4);
        }
        assert_eq!(
            AethRepr::parse(&Packet::new_unchecked(&RNR[..])).unwrap(),
            AethRepr {
                syndrome: Syndrome::RnrNak {
                    timer: RnrTimer::new(14)
                },
                msn: Msn::new(0xFF_FFFF)
            }
        );
    }

    #[test]
    fn truncated() {
        for len in 0..HEADER_LEN {
            assert_eq!(Packet::new_checked(&ACK[..len]), Err(Error::Truncated));
        }
    }
}
