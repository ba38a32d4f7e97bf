//! Optional timing of the forward pass by phase, for finding where a decode step goes.
//!
//! Off unless the environment variable `DS4_PROFILE` is set when first checked; then every
//! forward pass adds its wall time, the time spent in the backend's matrix products and the
//! time spent in the per-row attention loop (state updates, indexer, attention: the work that
//! stays on the CPU whatever the backend). A device decoder's step adds its own phases: the
//! whole step, the host's wait for the GPU, and the replay of the step's journal into the host
//! state; a drafter's proposal on the device its own. [`report`] reads the totals, [`reset`] clears them.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Instant;

/// A timed phase.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// A whole forward pass (every other phase happens inside one).
    Forward = 0,
    /// Backend matrix products (`matmul_many` calls).
    Matmul = 1,
    /// The per-row attention loop of the trunk layers.
    Attention = 2,
    /// A device decoder's whole step (its forward pass).
    DeviceStep = 3,
    /// Inside a device step: the host waiting for the GPU after queueing the step.
    DeviceWait = 4,
    /// Inside a device step: the step's journal applied to the host state.
    Journal = 5,
    /// A drafter's proposal computed by a device decoder (its steps, uploads and downloads).
    DeviceDraft = 6,
}

const N: usize = 7;
const NAMES: [&str; N] = ["forward", "matmul", "attention", "device_step", "device_wait", "journal", "device_draft"];
static NANOS: [AtomicU64; N] = [const { AtomicU64::new(0) }; N];
static CALLS: [AtomicU64; N] = [const { AtomicU64::new(0) }; N];

/// Whether profiling is on (`DS4_PROFILE` set in the environment; read once).
pub fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("DS4_PROFILE").is_some())
}

/// Times the rest of the enclosing scope as `phase` (nothing when profiling is off).
pub struct Scope(Option<(Phase, Instant)>);

impl Drop for Scope {
    fn drop(&mut self) {
        if let Some((p, t)) = self.0 {
            NANOS[p as usize].fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
            CALLS[p as usize].fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Starts timing `phase` until the returned guard is dropped.
#[inline]
pub fn scope(phase: Phase) -> Scope {
    Scope(enabled().then(|| (phase, Instant::now())))
}

/// `(phase, calls, seconds)` accumulated since the last [`reset`].
pub fn report() -> Vec<(&'static str, u64, f64)> {
    (0..NAMES.len())
        .map(|i| (NAMES[i], CALLS[i].load(Ordering::Relaxed), NANOS[i].load(Ordering::Relaxed) as f64 * 1e-9))
        .collect()
}

/// Clears the totals.
pub fn reset() {
    for i in 0..NAMES.len() {
        NANOS[i].store(0, Ordering::Relaxed);
        CALLS[i].store(0, Ordering::Relaxed);
    }
}
