//! Compute backends. The CPU backend is the reference every other backend is tested against.

pub mod cpu;
