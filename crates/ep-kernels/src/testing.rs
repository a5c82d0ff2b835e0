//! The harness every GPU test uses: it hands out contexts on the visible GPUs, or says loudly that
//! the test was skipped and why. The device bundle's `run.sh` turns a skip that the machine could
//! have run into a failure, so a GPU test can only be skipped where there are too few GPUs.

use std::sync::Arc;

use cudarc::driver::CudaContext;

/// Contexts on the first `n` GPUs, one per GPU, or `None` after printing
/// `SKIPPED (needs n GPUs, found m)` when fewer are visible (or there is no driver). Only for
/// tests that truly need distinct GPUs (peer access, copy-engine P2P); multi-rank tests take
/// [`rank_gpus`], which shares GPUs among ranks.
///
/// ```no_run
/// let Some(gpus) = ep_kernels::testing::gpus(2) else { return };
/// assert_eq!(gpus.len(), 2);
/// ```
pub fn gpus(n: usize) -> Option<Vec<Arc<CudaContext>>> {
    let found = visible_gpus();
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
    say(&format!("gpus: {n} of {found} visible"));
    Some(ctxs)
}

/// A line straight to the process's stderr, past libtest's capture (the device suite's `run.sh`
/// reads these: a test that printed neither a `gpus:`/`ranks:` line nor a skip ran no case).
fn say(line: &str) {
    use std::io::Write as _;
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// Says (past libtest's capture) that this test in a GPU binary runs no GPU case by design: a
/// child a parent test re-executes, or a CPU check of a helper. The device suite's `run.sh`
/// reports it as `AUX` rather than failing it as a test that ran no case.
pub fn aux(why: &str) {
    say(&format!("AUX ({why})"));
}

/// The GPU of rank `rank` when a group is spread round robin over `gpus` GPUs.
pub fn gpu_of(rank: usize, gpus: usize) -> usize {
    rank % gpus.max(1)
}

/// How `ranks` ranks spread round robin over `gpus` GPUs, as the harness prints it:
/// `4 ranks on 1 GPU: 0,0,0,0`.
///
/// ```
/// assert_eq!(ep_kernels::testing::mapping(4, 1), "4 ranks on 1 GPU: 0,0,0,0");
/// assert_eq!(ep_kernels::testing::mapping(3, 2), "3 ranks on 2 GPUs: 0,1,0");
/// ```
pub fn mapping(ranks: usize, gpus: usize) -> String {
    let used = gpus.min(ranks).max(1);
    let list: Vec<String> = (0..ranks).map(|r| gpu_of(r, used).to_string()).collect();
    format!(
        "{ranks} rank{} on {used} GPU{}: {}",
        if ranks == 1 { "" } else { "s" },
        if used == 1 { "" } else { "s" },
        list.join(",")
    )
}

/// Environment variable that narrows the rank counts a multi-rank GPU test runs
/// ([`rank_counts`]): a comma-separated list such as `8` or `2,4`.
pub const TEST_RANKS_ENV: &str = "EP_TEST_RANKS";

/// The rank counts a multi-rank test runs: `all`, narrowed by [`TEST_RANKS_ENV`] when set (to
/// replay one failing size without the others). Prints what it narrowed to; a list that keeps
/// none of `all` panics, since a test that runs no case must fail.
///
/// ```
/// assert_eq!(ep_kernels::testing::rank_counts(&[2, 4, 8]).len(), 3); // EP_TEST_RANKS unset
/// ```
pub fn rank_counts(all: &[usize]) -> Vec<usize> {
    let Ok(list) = std::env::var(TEST_RANKS_ENV) else {
        return all.to_vec();
    };
    let wanted: Vec<usize> = list
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    let kept: Vec<usize> = all.iter().copied().filter(|n| wanted.contains(n)).collect();
    assert!(
        !kept.is_empty(),
        "{TEST_RANKS_ENV}={list} keeps none of this test's rank counts {all:?}"
    );
    eprintln!("{TEST_RANKS_ENV}={list}: running rank counts {kept:?} of {all:?}");
    kept
}

/// Contexts for `n` ranks on however many GPUs are visible, round robin (rank `i` on GPU
/// `i % m`; ranks on one GPU share its primary context), after printing the mapping
/// (`ranks: 4 ranks on 1 GPU: 0,0,0,0`). `None`, after printing `SKIPPED (needs 1 GPUs, found
/// 0)`, only where there is no GPU at all.
///
/// ```no_run
/// let Some(ctxs) = ep_kernels::testing::rank_gpus(8) else { return };
/// assert_eq!(ctxs.len(), 8);
/// ```
pub fn rank_gpus(n: usize) -> Option<Vec<Arc<CudaContext>>> {
    let found = visible_gpus();
    if found == 0 {
        let test = std::thread::current().name().unwrap_or("?").to_string();
        say(&format!("SKIPPED (needs 1 GPUs, found 0): {test}"));
        return None;
    }
    let ctxs = rank_contexts(n, found).unwrap_or_else(|e| panic!("opening the GPUs: {e}"));
    say(&format!("ranks: {}", mapping(n, found)));
    Some(ctxs)
}

/// Runs `f` on the contexts of each rank count of `all` that [`rank_counts`] keeps, ranks spread
/// over the visible GPUs by [`rank_gpus`]; with no GPU at all it returns after the first count
/// (which `rank_gpus` reports as skipped).
///
/// ```no_run
/// ep_kernels::testing::on_rank_counts(&[2, 4, 8], |ctxs| assert!(ctxs.len() >= 2));
/// ```
pub fn on_rank_counts(all: &[usize], mut f: impl FnMut(&[Arc<CudaContext>])) {
    for ranks in rank_counts(all) {
        let Some(ctxs) = rank_gpus(ranks) else { return };
        f(&ctxs);
    }
}

/// Contexts for `n` ranks of this process spread round robin over the first `gpus` GPUs (rank
/// `i` on GPU `i % gpus`; ranks on one GPU share its primary context): what [`rank_gpus`] hands a
/// test, and what the examples run on.
pub fn rank_contexts(
    n: usize,
    gpus: usize,
) -> Result<Vec<Arc<CudaContext>>, ibgda_device::cuda::CudaError> {
    let used = gpus.min(n).max(1);
    let opened = (0..used)
        .map(ibgda_device::cuda::context)
        .collect::<Result<Vec<_>, _>>()?;
    Ok((0..n).map(|r| opened[gpu_of(r, used)].clone()).collect())
}

/// The context of rank `rank` of a group of processes spread round robin over the visible GPUs
/// (the process's own view: `CUDA_VISIBLE_DEVICES` applies).
pub fn rank_context(rank: usize) -> Result<Arc<CudaContext>, ibgda_device::cuda::CudaError> {
    let found = ibgda_device::cuda::device_count()?;
    ibgda_device::cuda::context(gpu_of(rank, found))
}

/// How many different GPUs `ctxs` are on.
pub fn distinct_gpus(ctxs: &[Arc<CudaContext>]) -> usize {
    let mut devices: Vec<_> = ctxs.iter().map(|c| c.cu_device()).collect();
    devices.sort_unstable();
    devices.dedup();
    devices.len()
}

/// Visible GPUs (0 without a driver, after saying why).
pub fn visible_gpus() -> usize {
    match ibgda_device::cuda::device_count() {
        Ok(m) => m,
        Err(e) => {
            eprintln!("note: {e}");
            0
        }
    }
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

/// `n` values in `[0.01, 1.01)` in steps of 2^-24 (weights and scales that are never zero).
pub fn random_f32(rng: &mut Rng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| rng.below(1 << 24) as f32 / (1 << 24) as f32 + 0.01)
        .collect()
}

/// `Ok` when `got` equals `want`; else says, as `what`, how many elements differ and the first.
pub fn check_eq<T: PartialEq + std::fmt::Debug>(
    what: &str,
    got: &[T],
    want: &[T],
) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!(
            "{what}: {} elements, expected {}",
            got.len(),
            want.len()
        ));
    }
    if let Some(i) = (0..got.len()).find(|&i| got[i] != want[i]) {
        let wrong = (0..got.len()).filter(|&i| got[i] != want[i]).count();
        return Err(format!(
            "{what}: {wrong} of {} differ, first at {i}: got {:?}, expected {:?}",
            got.len(),
            got[i],
            want[i]
        ));
    }
    Ok(())
}

/// Runs `f(rank, buffer)` on a thread per buffer (a collective needs every rank at once) and
/// returns the results in rank order; a thread that panicked gives `Err("rank thread panicked")`.
pub fn on_rank_threads<B, T, F>(bufs: &mut [B], f: F) -> Vec<Result<T, String>>
where
    B: Send,
    T: Send,
    F: Fn(usize, &mut B) -> Result<T, String> + Sync,
{
    std::thread::scope(|sc| {
        let joins: Vec<_> = bufs
            .iter_mut()
            .enumerate()
            .map(|(r, buf)| {
                let f = &f;
                sc.spawn(move || f(r, buf))
            })
            .collect();
        joins
            .into_iter()
            .map(|j| {
                j.join()
                    .unwrap_or_else(|_| Err("rank thread panicked".into()))
            })
            .collect()
    })
}
