//! The IBA transport headers (being written).
