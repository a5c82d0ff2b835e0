//! The harness every GPU test uses: it hands out contexts on the visible GPUs, or says loudly that
//! the test was skipped and why. The device bundle's `run.sh` turns a skip that the machine could
//! have run into a failure, so a GPU test can only be skipped where there are too few GPUs.

use std::sync::Arc;

use cudarc::driver::CudaContext;

/// Contexts on the first `n` GPUs, or `None` after printing
/// `SKIPPED (needs n GPUs, found m)` when fewer are visible (or there is no driver).
///
/// ```no_run
/// let Some(gpus) = ep_kernels::testing::gpus(2) else { return };
/// assert_eq!(gpus.len(), 2);
/// ```
pub fn gpus(n: usize) -> Option<Vec<Arc<CudaContext>>> {
    let found = match ibgda_device::cuda::device_count() {
        Ok(m) => m,
        Err(e) => {
            eprintln!("note: {e}");
            0
        }
    };
    if found < n {
        let test = std::thread::current().name().unwrap_or("?").to_string();
        // Straight to the process's stderr: libtest captures `eprintln!` of passing tests, and
        // a skip must be seen in every run, not only with --nocapture.
        use std::io::Write as _;
        let _ = writeln!(
            std::io::stderr(),
            "SKIPPED (needs {n} GPUs, found {found}): {test}"
        );
        return None;
    }
    let ctxs = (0..n)
        .map(|i| ibgda_device::cuda::context(i).unwrap_or_else(|e| panic!("opening GPU {i}: {e}")))
        .collect();
    Some(ctxs)
}

/// A seed for a test's random inputs: `EP_TEST_SEED` if set, else fresh from the clock. Printed,
/// so a failure can be replayed.
pub fn seed() -> u64 {
    let s = std::env::var("EP_TEST_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(1)
        });
    eprintln!("seed: {s} (replay with EP_TEST_SEED={s})");
    s
}

/// A small, fast generator for test inputs (xorshift64*): not for anything but tests.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator from `seed` (0 is mapped to a fixed non-zero state).
    pub fn new(seed: u64) -> Self {
        Self(if seed == 0 {
            0x9e37_79b9_7f4a_7c15
        } else {
            seed
        })
    }
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    /// A value in `0..n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}
