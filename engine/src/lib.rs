//! shmhca: a software InfiniBand Host Channel Adapter.
#![deny(unsafe_code)]

pub mod psn;
pub mod trace;
pub mod wire;
