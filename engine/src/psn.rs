//! 24-bit packet sequence numbers (being written).
