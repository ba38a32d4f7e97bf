//! Device-resident decode: the whole forward pass of decode-sized batches (1..=16 rows) on the
//! GPU, with the session's attention state mirrored in device memory.

#[cfg(test)]
mod testutil;
#[cfg(test)]
mod tests_attn;
#[cfg(test)]
mod tests_moe;
#[cfg(test)]
mod tests_ops;
