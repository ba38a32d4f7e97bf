//! Tests of the decode kernels (placeholder).
