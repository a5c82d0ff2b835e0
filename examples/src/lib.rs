//! Shared helpers for the example binaries.

pub mod bench {
    //! What every `bench_*` binary needs to report: dates, percentiles and JSON values. The
    //! records are written by hand (one object per line) so they read well in a diff.

    fn civil_from_unix(secs: u64) -> (i64, u32, u32) {
        // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
        let z = (secs / 86_400) as i64 + 719_468;
        let era = z.div_euclid(146_097);
        let doe = z - era * 146_097;
        let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
        let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
        let mp = (5 * doy + 2) / 153;
        let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
        let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
        (yoe + era * 400 + i64::from(m <= 2), m, d)
    }

    fn unix_now() -> u64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0)
    }

    /// Today as `YYYY-MM-DD` (UTC), the `date` of a benchmark record.
    pub fn utc_date() -> String {
        let (y, m, d) = civil_from_unix(unix_now());
        format!("{y:04}-{m:02}-{d:02}")
    }

    /// Now as `YYYY-MM-DDTHH:MM:SSZ` (UTC).
    pub fn utc_timestamp() -> String {
        let secs = unix_now();
        let (y, m, d) = civil_from_unix(secs);
        let s = secs % 86_400;
        format!(
            "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
            s / 3600,
            s / 60 % 60,
            s % 60
        )
    }

    /// The value at quantile `p` (0..=1) of ascending `sorted` values; NaN when empty.
    pub fn percentile(sorted: &[f64], p: f64) -> f64 {
        if sorted.is_empty() {
            return f64::NAN;
        }
        let i = ((sorted.len() - 1) as f64 * p).round() as usize;
        sorted[i.min(sorted.len() - 1)]
    }

    /// A JSON number with 3 decimals, or `null` when not measured (NaN or infinite).
    pub fn json_num(x: f64) -> String {
        if x.is_finite() {
            format!("{x:.3}")
        } else {
            "null".into()
        }
    }

    /// A JSON string literal.
    pub fn json_str(s: &str) -> String {
        let mut o = String::from("\"");
        for c in s.chars() {
            match c {
                '"' => o.push_str("\\\""),
                '\\' => o.push_str("\\\\"),
                c if (c as u32) < 0x20 => o.push_str(&format!("\\u{:04x}", c as u32)),
                c => o.push(c),
            }
        }
        o.push('"');
        o
    }

    /// Environment variables that change what a benchmark measures, recorded with its command
    /// where set: the emulated NIC's GPU agent and strict mode, the NIC and its handler mode.
    const COMMAND_ENV: [&str; 4] = [
        "IBGDA_EMU_AGENT",
        "IBGDA_EMU_STRICT",
        "EP_NIC",
        "IBGDA_NIC_HANDLER",
    ];

    /// The command that produced this run's records: the [`COMMAND_ENV`] variables that are set,
    /// then the program's arguments as given.
    pub fn command_line() -> String {
        let env = COMMAND_ENV
            .iter()
            .filter_map(|k| std::env::var(k).ok().map(|v| format!("{k}={v}")));
        env.chain(std::env::args()).collect::<Vec<_>>().join(" ")
    }

    /// `record` (one JSON object) with a `command` field appended.
    pub fn with_command(record: &str, command: &str) -> String {
        let body = record.trim_end();
        let body = body.strip_suffix('}').unwrap_or(body);
        let sep = if body.trim_end().ends_with('{') {
            ""
        } else {
            ", "
        };
        format!("{body}{sep}\"command\": {}}}", json_str(command))
    }

    /// Writes `records` (JSON objects, one string each) to `path` as a JSON array, one object
    /// a line, each with the run's `command` ([`command_line`]), and says where.
    pub fn write_records(path: &str, records: &[String]) -> anyhow::Result<()> {
        let command = command_line();
        let lines: Vec<String> = records
            .iter()
            .map(|r| format!("  {}", with_command(r.trim_start(), &command)))
            .collect();
        std::fs::write(path, format!("[\n{}\n]\n", lines.join(",\n")))
            .map_err(|e| anyhow::anyhow!("writing {path}: {e}"))?;
        println!("wrote {path}");
        Ok(())
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn civil_dates() {
            assert_eq!(civil_from_unix(0), (1970, 1, 1));
            assert_eq!(civil_from_unix(951_782_400), (2000, 2, 29));
            assert_eq!(civil_from_unix(1_795_910_400 + 86_399), (2026, 11, 29));
        }

        #[test]
        fn percentiles_and_json() {
            let v = [1.0, 2.0, 3.0, 4.0, 5.0];
            assert_eq!(percentile(&v, 0.5), 3.0);
            assert_eq!(percentile(&v, 1.0), 5.0);
            assert!(percentile(&[], 0.5).is_nan());
            assert_eq!(json_num(f64::NAN), "null");
            assert_eq!(json_str("a\"b\\c\n"), "\"a\\\"b\\\\c\\u000a\"");
        }

        #[test]
        fn records_carry_their_command() {
            assert_eq!(
                with_command("{\"us\": 1.0}  ", "bench_x --json a"),
                "{\"us\": 1.0, \"command\": \"bench_x --json a\"}"
            );
            assert_eq!(with_command("{}", "b"), "{\"command\": \"b\"}");
        }
    }
}

pub mod ranks {
    //! What the multi-rank examples share: random routing, a thread per rank, and the teardown of
    //! a group's buffers.

    use ep::Bf16;
    use ep_kernels::testing::Rng;

    /// `tokens` rows of `topk` distinct experts of `experts`, drawn uniformly (row-major).
    pub fn random_topk_ids(rng: &mut Rng, tokens: usize, topk: usize, experts: usize) -> Vec<i32> {
        let mut ids = Vec::with_capacity(tokens * topk);
        for _ in 0..tokens {
            let mut row: Vec<i32> = Vec::new();
            while row.len() < topk {
                let e = rng.below(experts as u64) as i32;
                if !row.contains(&e) {
                    row.push(e);
                }
            }
            ids.extend(row);
        }
        ids
    }

    /// `n` BF16 values, uniform in [-1, 1) in steps of 2^-15.
    pub fn random_bf16(rng: &mut Rng, n: usize) -> Vec<Bf16> {
        (0..n)
            .map(|_| Bf16::from_f32(rng.below(1 << 16) as f32 / 32768.0 - 1.0))
            .collect()
    }

    /// `seed`, or one from the clock where it is 0 (the command lines' "default: from the clock").
    pub fn seed_or_clock(seed: u64) -> anyhow::Result<u64> {
        Ok(if seed == 0 {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)?
                .as_nanos() as u64
        } else {
            seed
        })
    }

    /// A rank's thread panicked.
    #[derive(Debug)]
    pub struct RankPanicked;

    impl std::fmt::Display for RankPanicked {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("rank thread panicked")
        }
    }

    impl std::error::Error for RankPanicked {}

    impl From<RankPanicked> for String {
        fn from(p: RankPanicked) -> String {
            p.to_string()
        }
    }

    /// Runs `f(rank, buffer)` on a thread per buffer (the collectives need every rank at once)
    /// and returns the results in rank order; a thread that panicked gives [`RankPanicked`].
    pub fn on_rank_threads<B, T, E, F>(bufs: &mut [B], f: F) -> Vec<Result<T, E>>
    where
        B: Send,
        T: Send,
        E: Send + From<RankPanicked>,
        F: Fn(usize, &mut B) -> Result<T, E> + Sync,
    {
        std::thread::scope(|s| {
            let joins: Vec<_> = bufs
                .iter_mut()
                .enumerate()
                .map(|(r, buf)| {
                    let f = &f;
                    s.spawn(move || f(r, buf))
                })
                .collect();
            joins
                .into_iter()
                .map(|j| j.join().unwrap_or_else(|_| Err(RankPanicked.into())))
                .collect()
        })
    }

    /// Drops a group's buffers on a thread each: a buffer's teardown waits for its peers'.
    pub fn drop_on_rank_threads<B: Send>(bufs: Vec<B>) {
        std::thread::scope(|s| {
            for b in bufs {
                s.spawn(move || drop(b));
            }
        });
    }
}

/// The command line as flags: `--flag value` pairs and switches without a value.
///
/// ```no_run
/// let mut flags = ep_examples::Flags::new("usage: demo [--fast] [--tokens N]\n");
/// let (mut fast, mut tokens) = (false, 512usize);
/// while let Some(f) = flags.next_flag() {
///     match f.as_str() {
///         "--fast" => fast = true,
///         "--tokens" => tokens = flags.value(&f)?,
///         other => anyhow::bail!("unknown argument {other}"),
///     }
/// }
/// # Ok::<(), anyhow::Error>(())
/// ```
pub struct Flags {
    args: std::iter::Skip<std::env::Args>,
    usage: &'static str,
}

impl Flags {
    /// This process's arguments; `usage` is what `-h` and `--help` print.
    pub fn new(usage: &'static str) -> Self {
        Flags {
            args: std::env::args().skip(1),
            usage,
        }
    }

    /// The next flag; `-h` or `--help` prints the usage and exits with status 0.
    pub fn next_flag(&mut self) -> Option<String> {
        let f = self.args.next()?;
        if f == "-h" || f == "--help" {
            print!("{}", self.usage);
            std::process::exit(0);
        }
        Some(f)
    }

    /// The value after `flag`, as text.
    pub fn string(&mut self, flag: &str) -> anyhow::Result<String> {
        use anyhow::Context as _;
        self.args
            .next()
            .with_context(|| format!("{flag} needs a value"))
    }

    /// The value after `flag`, parsed.
    pub fn value<V>(&mut self, flag: &str) -> anyhow::Result<V>
    where
        V: std::str::FromStr,
        V::Err: std::error::Error + Send + Sync + 'static,
    {
        Ok(self.string(flag)?.parse()?)
    }
}

/// The size of an internode run on virtual nodes, as `internode` and `bench_internode` take it
/// from their command lines.
#[derive(Debug, Clone)]
pub struct InternodeSize {
    /// `--nodes`.
    pub nodes: usize,
    /// `--ranks-per-node`.
    pub rpn: usize,
    /// `--tokens`: per rank.
    pub tokens: usize,
    /// `--hidden`.
    pub hidden: usize,
    /// `--topk`.
    pub topk: usize,
    /// `--experts`: in all.
    pub experts: usize,
    /// `--iters`.
    pub iters: usize,
}

impl InternodeSize {
    /// Reads the value of `flag` into the field it names; false where `flag` names none.
    pub fn set(&mut self, flag: &str, flags: &mut Flags) -> anyhow::Result<bool> {
        match flag {
            "--nodes" => self.nodes = flags.value(flag)?,
            "--ranks-per-node" => self.rpn = flags.value(flag)?,
            "--tokens" => self.tokens = flags.value(flag)?,
            "--hidden" => self.hidden = flags.value(flag)?,
            "--topk" => self.topk = flags.value(flag)?,
            "--experts" => self.experts = flags.value(flag)?,
            "--iters" => self.iters = flags.value(flag)?,
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// Fails unless the size makes a run: 2 to 8 ranks on 2+ nodes, experts a multiple of the
    /// ranks, top-k 1..=experts, hidden a multiple of `hidden_multiple`, 1+ iterations.
    pub fn check(&self, hidden_multiple: usize) -> anyhow::Result<()> {
        use anyhow::ensure;
        ensure!(
            self.nodes >= 2 && self.rpn >= 1 && self.nodes * self.rpn <= 8,
            "nodes x ranks per node must be 2..=8 with 2+ nodes"
        );
        ensure!(
            self.experts > 0 && self.experts % (self.nodes * self.rpn) == 0,
            "experts must be a multiple of the rank count"
        );
        ensure!(
            self.topk >= 1 && self.topk <= self.experts,
            "topk must be 1..=experts"
        );
        ensure!(
            self.hidden % hidden_multiple == 0,
            "hidden must be a multiple of {hidden_multiple}"
        );
        ensure!(self.iters >= 1, "iters must be at least 1");
        Ok(())
    }
}

/// The number of visible GPUs; with none, says so as `program` and exits with status 2 (what
/// the GPU examples do where there is nothing to run).
pub fn visible_gpus_or_exit(program: &str) -> usize {
    let gpus = ep_kernels::testing::visible_gpus();
    if gpus == 0 {
        eprintln!("{program}: no GPU visible; nothing to run");
        std::process::exit(2);
    }
    gpus
}

/// Prints `usage` and exits with status 0 when the command line asks for help (`-h` or
/// `--help` anywhere among the arguments); every example binary calls it first.
pub fn exit_on_help(usage: &str) {
    if std::env::args().skip(1).any(|a| a == "-h" || a == "--help") {
        print!("{usage}");
        std::process::exit(0);
    }
}
