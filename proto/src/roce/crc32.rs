//! CRC-32 (the Ethernet and zlib CRC, the one the ICRC uses) and arithmetic modulo its
//! polynomial.
//!
//! # Representation
//!
//! The CRC is the reflected one: a 32-bit word stands for the polynomial whose `x^i`
//! coefficient is bit `31 - i` (so `0x8000_0000` is 1 and `0x0000_0001` is `x^31`), and
//! [`POLY`] is `x^32 + x^26 + x^23 + … + x + 1` without its `x^32` term. In that
//! representation a right shift multiplies by `x`.
//!
//! The raw register (no initial or final inversion) after a message `M` of `n` bits, fed
//! from a register value `r`, is `(r·x^n + M(x)·x^32) mod P`, where the message's first bit
//! (bit 0 of its first byte) is its highest-degree coefficient. Two facts the ICRC code
//! relies on follow:
//!
//! * the register is linear in the message bits (for a fixed length and start value), so
//!   changing a field changes the CRC by a term that does not depend on the other bytes;
//! * feeding `k` zero bytes multiplies the register by `x^(8k)`, and every power of `x` is
//!   invertible modulo `P` (its constant term is 1), so that term can be moved back to the
//!   field's position by multiplying with `x^(-8k)` ([`x_pow_neg`]).

/// The CRC-32 polynomial, reflected, without its `x^32` term.
pub(crate) const POLY: u32 = 0xEDB8_8320;

/// The polynomial 1.
pub(crate) const ONE: u32 = 0x8000_0000;

/// `x^(-1) mod P`: `x · (x^31 + (P - x^32 - 1)/x) = P - 1 ≡ 1`, i.e. the polynomial's low
/// terms shifted down by one degree, plus `x^31`.
pub(crate) const X_INV: u32 = (POLY << 1) + 1;

/// Slice-by-16 tables: `TABLES[0]` is the byte-at-a-time table, `TABLES[k][b]` the register
/// contribution of byte `b` followed by `k` zero bytes.
static TABLES: [[u32; 256]; 16] = make_tables();

const fn make_tables() -> [[u32; 256]; 16] {
    let mut t = [[0u32; 256]; 16];
    let mut b = 0;
    while b < 256 {
        let mut c = b as u32;
        let mut bit = 0;
        while bit < 8 {
            c = times_x(c);
            bit += 1;
        }
        t[0][b] = c;
        b += 1;
    }
    let mut k = 1;
    while k < 16 {
        let mut b = 0;
        while b < 256 {
            let prev = t[k - 1][b];
            t[k][b] = (prev >> 8) ^ t[0][(prev & 0xFF) as usize];
            b += 1;
        }
        k += 1;
    }
    t
}

/// `a · x mod P`.
const fn times_x(a: u32) -> u32 {
    if a & 1 != 0 { (a >> 1) ^ POLY } else { a >> 1 }
}

/// Feeds `bytes` through the raw CRC register `crc` (no inversion), 16 bytes at a time
/// (then 8, 4 and 1).
pub(crate) fn update(mut crc: u32, bytes: &[u8]) -> u32 {
    let t = &TABLES;
    let (blocks, rest) = bytes.as_chunks::<16>();
    for c in blocks {
        let a = crc ^ u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        crc = t[15][(a & 0xFF) as usize]
            ^ t[14][((a >> 8) & 0xFF) as usize]
            ^ t[13][((a >> 16) & 0xFF) as usize]
            ^ t[12][(a >> 24) as usize]
            ^ t[11][c[4] as usize]
            ^ t[10][c[5] as usize]
            ^ t[9][c[6] as usize]
            ^ t[8][c[7] as usize]
            ^ t[7][c[8] as usize]
            ^ t[6][c[9] as usize]
            ^ t[5][c[10] as usize]
            ^ t[4][c[11] as usize]
            ^ t[3][c[12] as usize]
            ^ t[2][c[13] as usize]
            ^ t[1][c[14] as usize]
            ^ t[0][c[15] as usize];
    }
    // The rest (under 16 bytes: a packet's headers often end here) 8 and 4 bytes at a
    // time, then byte by byte.
    let (eights, rest) = rest.as_chunks::<8>();
    for c in eights {
        let a = crc ^ u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        crc = t[7][(a & 0xFF) as usize]
            ^ t[6][((a >> 8) & 0xFF) as usize]
            ^ t[5][((a >> 16) & 0xFF) as usize]
            ^ t[4][(a >> 24) as usize]
            ^ t[3][c[4] as usize]
            ^ t[2][c[5] as usize]
            ^ t[1][c[6] as usize]
            ^ t[0][c[7] as usize];
    }
    let (fours, rest) = rest.as_chunks::<4>();
    for c in fours {
        let a = crc ^ u32::from_le_bytes(*c);
        crc = t[3][(a & 0xFF) as usize]
            ^ t[2][((a >> 8) & 0xFF) as usize]
            ^ t[1][((a >> 16) & 0xFF) as usize]
            ^ t[0][(a >> 24) as usize];
    }
    for &b in rest {
        crc = (crc >> 8) ^ t[0][((crc ^ u32::from(b)) & 0xFF) as usize];
    }
    crc
}

/// Feeds `bytes` through the raw register one bit at a time: for constants only.
pub(crate) const fn update_bitwise(mut crc: u32, bytes: &[u8]) -> u32 {
    let mut i = 0;
    while i < bytes.len() {
        crc ^= bytes[i] as u32;
        let mut bit = 0;
        while bit < 8 {
            crc = times_x(crc);
            bit += 1;
        }
        i += 1;
    }
    crc
}

/// `a · b mod P`.
pub(crate) const fn mul_mod_p(a: u32, mut b: u32) -> u32 {
    let mut product = 0;
    let mut i = 0;
    while i < 32 {
        // Bit 31 - i of `a` is its x^i coefficient; `b` holds b·x^i.
        if a & (ONE >> i) != 0 {
            product ^= b;
        }
        b = times_x(b);
        i += 1;
    }
    product
}

/// `n · x^4 mod P` for a 4-bit `n` (the coefficients of `x^28 … x^31`): what a right shift
/// by 4 leaves to reduce in [`mul`].
const TIMES_X4: [u32; 16] = {
    let mut t = [0u32; 16];
    let mut n = 0;
    while n < 16 {
        let mut c = n as u32;
        let mut i = 0;
        while i < 4 {
            c = times_x(c);
            i += 1;
        }
        t[n] = c;
        n += 1;
    }
    t
};

/// `a · b mod P`, as [`mul_mod_p`], four coefficients of `a` at a time: Horner's rule from
/// `a`'s highest-degree nibble down (bits 0–3 hold `x^31 … x^28`), each step a multiplication
/// of the product by `x^4` (a shift and one lookup) and the XOR of the nibble's multiple of
/// `b` (from a table of the 16 made once per call). Leading zero nibbles are skipped, so a
/// sparse `a` of low degree (an IPv4 ID's 16 bits) takes few steps. About a third of
/// [`mul_mod_p`]'s instructions for a dense `a`, a sixth for an ID: for the ICRC's per-packet
/// ID arithmetic; [`mul_mod_p`] stays for constants.
pub(crate) fn mul(a: u32, b: u32) -> u32 {
    if a == 0 {
        return 0;
    }
    // Bit j of a nibble is the coefficient of x^(3 - j) within it.
    let b1 = times_x(b);
    let b2 = times_x(b1);
    let b3 = times_x(b2);
    let mut q = [0u32; 16];
    for (n, slot) in q.iter_mut().enumerate() {
        let mut v = 0;
        if n & 1 != 0 {
            v ^= b3;
        }
        if n & 2 != 0 {
            v ^= b2;
        }
        if n & 4 != 0 {
            v ^= b1;
        }
        if n & 8 != 0 {
            v ^= b;
        }
        *slot = v;
    }
    // Nibble g holds the coefficients x^(31 - 4g) … x^(28 - 4g).
    let mut product = 0u32;
    for g in a.trailing_zeros() / 4..8 {
        product = (product >> 4) ^ TIMES_X4[(product & 0xF) as usize];
        product ^= q[((a >> (4 * g)) & 0xF) as usize];
    }
    product
}

/// `t[i] = base^(2^i) mod P`: the squares a power is made of.
const fn squares(base: u32) -> [u32; 32] {
    let mut t = [0u32; 32];
    t[0] = base;
    let mut i = 1;
    while i < 32 {
        t[i] = mul_mod_p(t[i - 1], t[i - 1]);
        i += 1;
    }
    t
}

/// `X_POW2[i] = x^(2^i) mod P`, `X_INV_POW2[i] = x^(-2^i) mod P`.
const X_POW2: [u32; 32] = squares(ONE >> 1);
const X_INV_POW2: [u32; 32] = squares(X_INV);

/// The product of the `squares[i]` for the bits `i` set in `k`: at most 32 multiplications.
const fn power(squares: &[u32; 32], k: u32) -> u32 {
    let mut r = ONE;
    let mut i = 0;
    while i < 32 {
        if k & (1 << i) != 0 {
            r = mul_mod_p(r, squares[i]);
        }
        i += 1;
    }
    r
}

/// `x^k mod P`.
pub(crate) const fn x_pow(k: u32) -> u32 {
    power(&X_POW2, k)
}

/// `x^(-k) mod P`.
pub(crate) const fn x_pow_neg(k: u32) -> u32 {
    power(&X_INV_POW2, k)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The textbook bit-at-a-time reflected CRC-32 register.
    fn bitwise(mut crc: u32, data: &[u8]) -> u32 {
        for &b in data {
            crc ^= u32::from(b);
            for _ in 0..8 {
                crc = if crc & 1 != 0 {
                    (crc >> 1) ^ 0xEDB8_8320
                } else {
                    crc >> 1
                };
            }
        }
        crc
    }

    fn bytes(n: usize, seed: u32) -> Vec<u8> {
        let mut s = seed | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                s as u8
            })
            .collect()
    }

    #[test]
    fn check_value() {
        // The catalogued check value of CRC-32/ISO-HDLC: "123456789" → 0xCBF43926.
        assert_eq!(!update(!0, b"123456789"), 0xCBF4_3926);
        assert_eq!(!update_bitwise(!0, b"123456789"), 0xCBF4_3926);
        assert_eq!(!update(!0, b""), 0);
    }

    #[test]
    fn slice_by_16_agrees_with_the_bitwise_crc_at_every_length_and_start() {
        let data = bytes(300, 7);
        for len in 0..data.len() {
            for start in [0, !0, 0xDEBB_20E3, 0x1234_5678] {
                assert_eq!(
                    update(start, &data[..len]),
                    bitwise(start, &data[..len]),
                    "len {len} start {start:#x}"
                );
            }
        }
        // Every byte value in every slice lane.
        let all: Vec<u8> = (0..=255u8).chain((0..=255u8).rev()).collect();
        for shift in 0..16 {
            assert_eq!(update(0, &all[shift..]), bitwise(0, &all[shift..]));
        }
    }

    #[test]
    fn x_inverse_is_the_inverse_of_x() {
        assert_eq!(mul_mod_p(X_INV, ONE >> 1), ONE);
        assert_eq!(times_x(X_INV), ONE);
        assert_eq!(mul_mod_p(ONE, 0x1234_5678), 0x1234_5678);
        assert_eq!(mul_mod_p(0x1234_5678, ONE), 0x1234_5678);
    }

    #[test]
    fn multiplication_is_what_zero_bytes_do_to_the_register() {
        // Feeding k zero bytes multiplies the register by x^(8k) ...
        let r = 0x0BAD_F00D;
        let mut x8k = ONE;
        for k in 0..40usize {
            assert_eq!(update(r, &vec![0; k]), mul_mod_p(r, x8k), "k {k}");
            assert_eq!(mul_mod_p(x8k, r), mul_mod_p(r, x8k));
            // ... and x^(-8k) undoes it.
            assert_eq!(
                mul_mod_p(update(r, &vec![0; k]), x_pow_neg(8 * k as u32)),
                r
            );
            x8k = mul_mod_p(x8k, ONE >> 8);
        }
    }

    /// The nibble-at-a-time product is the bit-at-a-time one: for random operands, sparse
    /// ones (an IPv4 ID's bits), single terms and 0.
    #[test]
    fn the_nibble_product_is_the_bitwise_product() {
        let mut s = 0x9E37_79B9u32;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            s
        };
        let mut operands: Vec<u32> = (0..2000).map(|_| next()).collect();
        operands.extend((0..32).map(|i| ONE >> i));
        operands.extend((0..=u16::MAX).step_by(97).map(|id| {
            let [hi, lo] = id.to_be_bytes();
            (u32::from(hi) << 16) | (u32::from(lo) << 24)
        }));
        operands.extend([0, 1, u32::MAX, POLY, X_INV]);
        for (i, &a) in operands.iter().enumerate() {
            for &b in operands.iter().skip(i % 7).step_by(53) {
                assert_eq!(mul(a, b), mul_mod_p(a, b), "{a:#x} · {b:#x}");
            }
        }
    }

    #[test]
    fn negative_powers_compose() {
        for k in [
            0u32,
            1,
            2,
            3,
            31,
            32,
            33,
            255,
            1000,
            0x7_FFFF,
            0x8000_0000,
            u32::MAX - 1,
        ] {
            // x^(-k) · x^(-1) = x^(-(k+1)).
            assert_eq!(mul_mod_p(x_pow_neg(k), X_INV), x_pow_neg(k + 1), "k {k}");
        }
        let mut xk = ONE;
        for k in 0..100 {
            assert_eq!(mul_mod_p(xk, x_pow_neg(k)), ONE, "k {k}");
            xk = times_x(xk);
        }
    }
}
