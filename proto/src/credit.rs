//! End-to-end flow control (spec/02): the SQ Logic's Limit Sequence Number.
//!
//! The RQ Logic reports in every positive Ack how many receive WQEs it has posted, encoded
//! in five bits ([`CreditCode`], Table 17-8, rounding down). The SQ
//! Logic adds the count to the Ack's MSN to get the LSN: the SSN of the last message it may
//! start that needs a receive WQE. Messages that need none (RDMA Write without immediate,
//! RDMA Read, Atomics) extend the limit by one each ("LSN + 1 for each SQ WQE that doesn't
//! need RQ WQE"), which [`CreditState`] implements by counting only the messages that
//! consume a receive WQE.

use crate::wire::aeth::CreditCode;

/// The SQ Logic's view of the remote RQ's credits.
///
/// Work requests are numbered by their SSN (24-bit, the first is 0 here as in spec/02's
/// pictures offset by one) and each records `consumers_through`: how many of the messages
/// up to and including it consume a receive WQE. A consuming message with count `c` may be
/// started when `c - consumers_at(MSN) <= credits`.
#[derive(Debug, Clone)]
pub struct CreditState {
    /// Whether the remote reports credits at all (CM-negotiated, and turned off by an Ack
    /// whose credit field is invalid). If not, every message is unlimited.
    enabled: bool,
    /// The highest consuming count the remote has allowed, once known.
    limit: Option<u64>,
}

impl CreditState {
    /// Credit state for a QP whose remote RQ Logic does (`enabled`) or does not report credits.
    pub fn new(enabled: bool) -> CreditState {
        CreditState {
            enabled,
            limit: None,
        }
    }

    /// Applies an Ack's credit code. `consumers_at_msn` is the consuming count of the message
    /// the Ack's MSN names (the caller knows it from its WQE history).
    ///
    /// The invalid code (11111b, Table 17-8) is what a responder sends that counts no
    /// credits: a QP on a shared receive queue (spec/02), or a peer without end-to-end flow
    /// control (RoCE NICs and Linux's soft-RoCE on such QPs). Nothing limits this
    /// requester from then on, as if the connection had been set up without credits:
    /// waiting for a count that never comes would leave it probing one message at a time.
    #[inline]
    pub fn update(&mut self, code: CreditCode, consumers_at_msn: u64) {
        match code.credits() {
            Some(credits) => {
                let limit = consumers_at_msn + u64::from(credits);
                // Credits never shrink below what was already granted: an older Ack can
                // arrive after a newer one only as a duplicate, and a grant cannot be
                // revoked (spec/02).
                self.limit = Some(self.limit.map_or(limit, |l| l.max(limit)));
            }
            None => self.enabled = false,
        }
    }

    /// Whether a message that consumes a receive WQE, with consuming count `consumers`
    /// (including itself), may be sent in full.
    pub fn allows(&self, consumers: u64) -> bool {
        !self.enabled || self.limit.is_some_and(|l| consumers <= l)
    }

    /// Whether the remote reports credits.
    pub fn enabled(&self) -> bool {
        self.enabled
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn code(n: u32) -> CreditCode {
        CreditCode::encode(n)
    }

    #[test]
    fn spec_example_msn_0x18_plus_6() {
        // Figure 17-18: MSN 0x18 and a credit count of 6 allow messages up to SSN 0x1E.
        // With every message consuming, consuming counts equal SSNs here.
        let mut c = CreditState::new(true);
        assert!(!c.allows(1), "no credits before the first Ack");
        c.update(code(6), 0x18);
        assert!(c.allows(0x1E));
        assert!(!c.allows(0x1F));
    }

    #[test]
    fn non_consuming_messages_extend_the_limit() {
        // spec/02: 26..31 with 27 and 29 not consuming: LSN 0x20 rather than 0x1E. In
        // consuming counts: with MSN at consuming count 24, 6 credits allow count 30,
        // which the 8th message after MSN (two of them non-consuming) reaches.
        let mut c = CreditState::new(true);
        c.update(code(6), 24);
        assert!(c.allows(30));
        assert!(!c.allows(31));
    }

    #[test]
    fn rounding_down_never_over_grants() {
        let mut c = CreditState::new(true);
        c.update(code(5), 0); // 5 is not in Table 17-8: advertised as 4
        assert!(c.allows(4));
        assert!(!c.allows(5));
    }

    #[test]
    fn stale_acks_never_revoke_credits_and_disabled_means_unlimited() {
        let mut c = CreditState::new(true);
        c.update(code(8), 10);
        c.update(code(0), 10);
        assert!(c.allows(18));
        assert!(!c.allows(19));
        assert!(CreditState::new(false).allows(u64::MAX));
    }

    #[test]
    fn the_invalid_code_means_the_responder_counts_no_credits() {
        // Before any count, and after one: the invalid code lifts every limit for good.
        for first in [None, Some(code(2))] {
            let mut c = CreditState::new(true);
            if let Some(k) = first {
                c.update(k, 0);
            }
            assert!(!c.allows(3));
            c.update(CreditCode::NONE, 0);
            assert!(c.allows(3) && c.allows(u64::MAX), "{first:?}");
            assert!(!c.enabled(), "the remote reports no credits");
            // A count after it does not bring a limit back.
            c.update(code(0), 5);
            assert!(c.allows(u64::MAX));
        }
    }

    #[test]
    fn enabled_says_whether_the_remote_reports_credits() {
        assert!(CreditState::new(true).enabled());
        assert!(!CreditState::new(false).enabled());
    }
}
