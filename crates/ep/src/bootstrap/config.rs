//! Who this rank is and where to meet the others: from the environment or the API.

use std::time::Duration;

use super::{BootstrapError, JobToken};

/// The most ranks one job may have.
pub const MAX_WORLD_SIZE: usize = 64;

/// Where rank 0 listens when `MASTER_ADDR` is not set: loopback, so nothing off the host can
/// connect.
pub const DEFAULT_MASTER_ADDR: &str = "127.0.0.1";

/// The time bound of each bootstrap step (rendezvous, one collective) when none is configured.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// The environment variables the bootstrap reads, and the launcher sets.
pub mod vars {
    /// This process's rank, `0..WORLD_SIZE`.
    pub const RANK: &str = "RANK";
    /// The number of ranks in the job, `1..=64`.
    pub const WORLD_SIZE: &str = "WORLD_SIZE";
    /// The address rank 0 listens on (default `127.0.0.1`).
    pub const MASTER_ADDR: &str = "MASTER_ADDR";
    /// The TCP port rank 0 listens on.
    pub const MASTER_PORT: &str = "MASTER_PORT";
    /// The job's token, 32 hex digits (see [`JobToken`](super::JobToken)).
    pub const EP_JOB_TOKEN: &str = "EP_JOB_TOKEN";
    /// The rank's index on its host, which picks its GPU; set by the launcher.
    pub const EP_LOCAL_RANK: &str = "EP_LOCAL_RANK";
    /// As `EP_LOCAL_RANK`, as set by other launchers (torchrun); `EP_LOCAL_RANK` wins.
    pub const LOCAL_RANK: &str = "LOCAL_RANK";
    /// Time bound of each bootstrap step in seconds (default 60).
    pub const EP_BOOTSTRAP_TIMEOUT_S: &str = "EP_BOOTSTRAP_TIMEOUT_S";
    /// Time bound of a whole launch in seconds (default 240), read by the launcher.
    pub const EP_LAUNCH_TIMEOUT_S: &str = "EP_LAUNCH_TIMEOUT_S";
}

/// Everything a rank needs to join its job over TCP.
///
/// ```
/// use ep::bootstrap::{JobToken, RankConfig};
/// use std::time::Duration;
///
/// let cfg = RankConfig::new(1, 4, 29500)
///     .unwrap()
///     .with_token(JobToken::generate().unwrap())
///     .with_timeout(Duration::from_secs(10));
/// assert_eq!(cfg.local_rank, 1);
/// assert_eq!(cfg.master_addr, "127.0.0.1");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankConfig {
    /// This rank, `0..world_size`.
    pub rank: usize,
    /// The number of ranks, `1..=MAX_WORLD_SIZE`.
    pub world_size: usize,
    /// This rank's index on its host: the GPU it uses. Defaults to `rank`.
    pub local_rank: usize,
    /// Host name or IP address rank 0 listens on.
    pub master_addr: String,
    /// Port rank 0 listens on. Rank 0 may be given an already bound listener instead
    /// ([`TcpCommunicator::with_listener`](super::TcpCommunicator::with_listener)).
    pub master_port: u16,
    /// The job's token; all ranks must agree.
    pub token: JobToken,
    /// Time bound of the rendezvous and of each collective.
    pub timeout: Duration,
}

impl RankConfig {
    /// A configuration for `rank` of `world_size` meeting at `127.0.0.1:master_port`, with no
    /// token and the default time bound.
    pub fn new(rank: usize, world_size: usize, master_port: u16) -> Result<Self, BootstrapError> {
        let cfg = Self {
            rank,
            world_size,
            local_rank: rank,
            master_addr: DEFAULT_MASTER_ADDR.to_string(),
            master_port,
            token: JobToken::UNSET,
            timeout: DEFAULT_TIMEOUT,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Sets the address rank 0 listens on.
    pub fn with_master_addr(mut self, addr: impl Into<String>) -> Self {
        self.master_addr = addr.into();
        self
    }

    /// Sets the job token.
    pub fn with_token(mut self, token: JobToken) -> Self {
        self.token = token;
        self
    }

    /// Sets the time bound of each step.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Sets the local rank (the GPU this rank uses).
    pub fn with_local_rank(mut self, local_rank: usize) -> Self {
        self.local_rank = local_rank;
        self
    }

    /// Checks the ranges: `world_size` in `1..=MAX_WORLD_SIZE`, `rank` and `local_rank` below it,
    /// a non-empty address, a non-zero timeout.
    pub fn validate(&self) -> Result<(), BootstrapError> {
        let bad = |what: String| Err(BootstrapError::Config(what));
        if !(1..=MAX_WORLD_SIZE).contains(&self.world_size) {
            return bad(format!(
                "world_size {} is outside 1..={MAX_WORLD_SIZE}",
                self.world_size
            ));
        }
        if self.rank >= self.world_size {
            return bad(format!(
                "rank {} is not below world_size {}",
                self.rank, self.world_size
            ));
        }
        if self.local_rank >= self.world_size {
            return bad(format!(
                "local_rank {} is not below world_size {}",
                self.local_rank, self.world_size
            ));
        }
        if self.master_addr.trim().is_empty() {
            return bad("master_addr is empty".into());
        }
        if self.timeout.is_zero() {
            return bad("timeout is zero".into());
        }
        Ok(())
    }

    /// Reads the configuration from the process environment: `RANK`, `WORLD_SIZE` (required),
    /// `MASTER_PORT` (required when `WORLD_SIZE` > 1), `MASTER_ADDR` (default `127.0.0.1`),
    /// `EP_JOB_TOKEN` (32 hex digits; when unset the job runs without a token and a warning is
    /// logged), `EP_LOCAL_RANK` or `LOCAL_RANK` (default `RANK`), `EP_BOOTSTRAP_TIMEOUT_S`
    /// (default 60). Errors name the variable and its value.
    pub fn from_env() -> Result<Self, BootstrapError> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// As [`from_env`](Self::from_env), reading variables through `lookup` (for tests, or a
    /// launcher's own table).
    pub fn from_vars(lookup: impl Fn(&str) -> Option<String>) -> Result<Self, BootstrapError> {
        let get = |var: &'static str| {
            lookup(var)
                .map(|v| v.trim().to_string())
                .filter(|v| !v.is_empty())
        };
        let int = |var: &'static str, value: &str| -> Result<usize, BootstrapError> {
            value
                .parse::<usize>()
                .map_err(|_| BootstrapError::EnvInvalid {
                    var,
                    value: value.to_string(),
                    reason: "not a non-negative integer".into(),
                })
        };
        let invalid = |var: &'static str, value: &str, reason: String| BootstrapError::EnvInvalid {
            var,
            value: value.to_string(),
            reason,
        };

        let world_s = get(vars::WORLD_SIZE).ok_or(BootstrapError::EnvMissing {
            var: vars::WORLD_SIZE,
            hint: "the number of ranks in the job",
        })?;
        let world_size = int(vars::WORLD_SIZE, &world_s)?;
        if !(1..=MAX_WORLD_SIZE).contains(&world_size) {
            return Err(invalid(
                vars::WORLD_SIZE,
                &world_s,
                format!("must be in 1..={MAX_WORLD_SIZE}"),
            ));
        }
        let rank_s = get(vars::RANK).ok_or(BootstrapError::EnvMissing {
            var: vars::RANK,
            hint: "this process's rank, 0..WORLD_SIZE",
        })?;
        let rank = int(vars::RANK, &rank_s)?;
        if rank >= world_size {
            return Err(invalid(
                vars::RANK,
                &rank_s,
                format!("must be below WORLD_SIZE={world_size}"),
            ));
        }

        let local_rank = match [vars::EP_LOCAL_RANK, vars::LOCAL_RANK]
            .into_iter()
            .find_map(|var| get(var).map(|v| (var, v)))
        {
            Some((var, v)) => {
                let lr = int(var, &v)?;
                if lr >= world_size {
                    return Err(invalid(
                        var,
                        &v,
                        format!("must be below WORLD_SIZE={world_size}"),
                    ));
                }
                lr
            }
            None => rank,
        };

        let master_addr = get(vars::MASTER_ADDR).unwrap_or_else(|| DEFAULT_MASTER_ADDR.into());
        let master_port = match get(vars::MASTER_PORT) {
            Some(p) => {
                let port = p.parse::<u16>().map_err(|_| {
                    invalid(vars::MASTER_PORT, &p, "not a TCP port (1..=65535)".into())
                })?;
                if port == 0 && world_size > 1 {
                    return Err(invalid(
                        vars::MASTER_PORT,
                        &p,
                        "port 0 cannot be connected to; pick a free port".into(),
                    ));
                }
                port
            }
            None if world_size == 1 => 0,
            None => {
                return Err(BootstrapError::EnvMissing {
                    var: vars::MASTER_PORT,
                    hint: "the TCP port rank 0 listens on",
                })
            }
        };

        let token = match get(vars::EP_JOB_TOKEN) {
            Some(t) => JobToken::parse(&t).ok_or_else(|| BootstrapError::EnvInvalid {
                var: vars::EP_JOB_TOKEN,
                // The value is a secret: say only how long it was.
                value: format!("<{} characters>", t.len()),
                reason: "must be 32 hexadecimal digits".into(),
            })?,
            None => {
                if world_size > 1 {
                    tracing::warn!(
                        "{} is not set: rank {rank} joins a job without a token, which any \
                         process reaching {master_addr}:{master_port} without a token could join",
                        vars::EP_JOB_TOKEN
                    );
                }
                JobToken::UNSET
            }
        };

        let timeout = match get(vars::EP_BOOTSTRAP_TIMEOUT_S) {
            Some(s) => {
                let secs = s.parse::<f64>().ok().filter(|x| x.is_finite() && *x > 0.0);
                Duration::from_secs_f64(secs.ok_or_else(|| {
                    invalid(
                        vars::EP_BOOTSTRAP_TIMEOUT_S,
                        &s,
                        "must be a positive number of seconds".into(),
                    )
                })?)
            }
            None => DEFAULT_TIMEOUT,
        };

        Ok(Self {
            rank,
            world_size,
            local_rank,
            master_addr,
            master_port,
            token,
            timeout,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn parse(pairs: &[(&str, &str)]) -> Result<RankConfig, BootstrapError> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        RankConfig::from_vars(|k| map.get(k).cloned())
    }

    fn err(pairs: &[(&str, &str)]) -> String {
        parse(pairs).unwrap_err().to_string()
    }

    const TOKEN: &str = "0123456789abcdef0123456789ABCDEF";

    #[test]
    fn full_environment() {
        let cfg = parse(&[
            ("RANK", "2"),
            ("WORLD_SIZE", "4"),
            ("MASTER_ADDR", "localhost"),
            ("MASTER_PORT", "29500"),
            ("EP_JOB_TOKEN", TOKEN),
            ("EP_LOCAL_RANK", "1"),
            ("LOCAL_RANK", "3"),
            ("EP_BOOTSTRAP_TIMEOUT_S", "2.5"),
        ])
        .unwrap();
        assert_eq!(
            cfg,
            RankConfig {
                rank: 2,
                world_size: 4,
                local_rank: 1,
                master_addr: "localhost".into(),
                master_port: 29500,
                token: JobToken::parse(TOKEN).unwrap(),
                timeout: Duration::from_millis(2500),
            }
        );
    }

    #[test]
    fn defaults() {
        let cfg = parse(&[("RANK", "1"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "1234")]).unwrap();
        assert_eq!(cfg.master_addr, DEFAULT_MASTER_ADDR);
        assert_eq!(cfg.local_rank, 1);
        assert!(cfg.token.is_unset());
        assert_eq!(cfg.timeout, DEFAULT_TIMEOUT);
        let cfg = parse(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "3"),
            ("MASTER_PORT", "9"),
        ])
        .unwrap();
        assert_eq!(cfg.local_rank, 3);
        // One rank needs no port.
        let cfg = parse(&[("RANK", "0"), ("WORLD_SIZE", "1")]).unwrap();
        assert_eq!(cfg.master_port, 0);
    }

    #[test]
    fn errors_name_the_variable() {
        let base = [("MASTER_PORT", "29500")];
        let with = |extra: &[(&str, &str)]| {
            let mut v: Vec<(&str, &str)> = base.to_vec();
            v.extend_from_slice(extra);
            err(&v)
        };
        type Vars<'a> = &'a [(&'a str, &'a str)];
        let cases: &[(Vars, &[&str])] = &[
            (&[("RANK", "0")], &["WORLD_SIZE", "not set"]),
            (&[("WORLD_SIZE", "2")], &["RANK", "not set"]),
            (
                &[("RANK", "x"), ("WORLD_SIZE", "2")],
                &["RANK=\"x\"", "integer"],
            ),
            (&[("RANK", "-1"), ("WORLD_SIZE", "2")], &["RANK=\"-1\""]),
            (
                &[("RANK", "2"), ("WORLD_SIZE", "2")],
                &["RANK=\"2\"", "below WORLD_SIZE=2"],
            ),
            (
                &[("RANK", "0"), ("WORLD_SIZE", "0")],
                &["WORLD_SIZE=\"0\"", "1..=64"],
            ),
            (
                &[("RANK", "0"), ("WORLD_SIZE", "65")],
                &["WORLD_SIZE=\"65\"", "1..=64"],
            ),
            (
                &[("RANK", "0"), ("WORLD_SIZE", "2"), ("EP_LOCAL_RANK", "5")],
                &["EP_LOCAL_RANK=\"5\"", "below WORLD_SIZE=2"],
            ),
            (
                &[("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "y")],
                &["LOCAL_RANK=\"y\""],
            ),
            (
                &[
                    ("RANK", "0"),
                    ("WORLD_SIZE", "2"),
                    ("EP_JOB_TOKEN", "secret"),
                ],
                &["EP_JOB_TOKEN", "32 hexadecimal", "<6 characters>"],
            ),
            (
                &[
                    ("RANK", "0"),
                    ("WORLD_SIZE", "2"),
                    ("EP_BOOTSTRAP_TIMEOUT_S", "0"),
                ],
                &["EP_BOOTSTRAP_TIMEOUT_S=\"0\"", "positive"],
            ),
        ];
        for (vars, needles) in cases {
            let msg = with(vars);
            for n in *needles {
                assert!(msg.contains(n), "{vars:?}: {msg:?} lacks {n:?}");
            }
        }
        let msg = err(&[("RANK", "0"), ("WORLD_SIZE", "2")]);
        assert!(
            msg.contains("MASTER_PORT") && msg.contains("not set"),
            "{msg}"
        );
        let msg = err(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "70000")]);
        assert!(msg.contains("MASTER_PORT=\"70000\""), "{msg}");
        let msg = err(&[("RANK", "1"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "0")]);
        assert!(msg.contains("MASTER_PORT=\"0\""), "{msg}");
        // The secret is never echoed.
        let msg = err(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_PORT", "1"),
            ("EP_JOB_TOKEN", "hunter2"),
        ]);
        assert!(!msg.contains("hunter2"), "{msg}");
    }

    #[test]
    fn api_validation() {
        assert!(RankConfig::new(0, 1, 0).is_ok());
        for (r, w) in [(0, 0), (1, 1), (0, 65)] {
            let e = RankConfig::new(r, w, 1).unwrap_err();
            assert!(matches!(e, BootstrapError::Config(_)), "{e}");
        }
        let e = RankConfig::new(0, 2, 1)
            .unwrap()
            .with_local_rank(2)
            .validate()
            .unwrap_err();
        assert!(e.to_string().contains("local_rank 2"), "{e}");
        let e = RankConfig::new(0, 2, 1)
            .unwrap()
            .with_timeout(Duration::ZERO)
            .validate()
            .unwrap_err();
        assert!(e.to_string().contains("timeout"), "{e}");
    }
}
