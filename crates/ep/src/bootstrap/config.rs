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
    /// The job's token, 32 hex digits (see [`JobToken`](super::JobToken)); required when
    /// `WORLD_SIZE` > 1. One way to make one: `openssl rand -hex 16`.
    pub const EP_JOB_TOKEN: &str = "EP_JOB_TOKEN";
    /// `1` to run a job of several ranks without a token, explicitly: any process that reaches
    /// rank 0's port can then join or pose as rank 0. Anything else but unset is an error.
    pub const EP_INSECURE_NO_TOKEN: &str = "EP_INSECURE_NO_TOKEN";
    /// The file descriptor of rank 0's listening socket, bound by the launcher and inherited by
    /// rank 0 (so no other process can take the port between choosing and binding it).
    pub const EP_LISTEN_FD: &str = "EP_LISTEN_FD";
    /// The rank's index on its host, which picks its GPU; set by the launcher.
    pub const EP_LOCAL_RANK: &str = "EP_LOCAL_RANK";
    /// As `EP_LOCAL_RANK`, as set by other launchers (torchrun); `EP_LOCAL_RANK` wins.
    pub const LOCAL_RANK: &str = "LOCAL_RANK";
    /// Time bound of each bootstrap step in seconds (default 60), in `(0, 86400]`.
    pub const EP_BOOTSTRAP_TIMEOUT_S: &str = "EP_BOOTSTRAP_TIMEOUT_S";
    /// Time bound of a whole launch in seconds (default 240), in `(0, 86400]`; read by the
    /// launcher.
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
/// cfg.validate().unwrap();
/// // Several ranks and no token: refused unless asked for explicitly.
/// assert!(RankConfig::new(1, 4, 29500).unwrap().validate().is_err());
/// RankConfig::new(1, 4, 29500).unwrap().without_token().validate().unwrap();
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
    /// The job's token; all ranks must hold the same. Required for a job of several ranks
    /// unless [`insecure_no_token`](Self::insecure_no_token) is set.
    pub token: Option<JobToken>,
    /// Run without a token, on purpose ([`without_token`](Self::without_token)): any process
    /// that reaches rank 0's port can join, or pose as rank 0.
    pub insecure_no_token: bool,
    /// Time bound of the rendezvous and of each collective, in `(0, 1 day]`.
    pub timeout: Duration,
}

impl RankConfig {
    /// A configuration for `rank` of `world_size` meeting at `127.0.0.1:master_port`, with the
    /// default time bound and no token yet: a job of several ranks needs
    /// [`with_token`](Self::with_token) (or an explicit [`without_token`](Self::without_token))
    /// before it can connect. Checks the ranks.
    pub fn new(rank: usize, world_size: usize, master_port: u16) -> Result<Self, BootstrapError> {
        let cfg = Self {
            rank,
            world_size,
            local_rank: rank,
            master_addr: DEFAULT_MASTER_ADDR.to_string(),
            master_port,
            token: None,
            insecure_no_token: false,
            timeout: DEFAULT_TIMEOUT,
        };
        cfg.validate_ranks()?;
        Ok(cfg)
    }

    /// Sets the address rank 0 listens on.
    pub fn with_master_addr(mut self, addr: impl Into<String>) -> Self {
        self.master_addr = addr.into();
        self
    }

    /// Sets the job token.
    pub fn with_token(mut self, token: JobToken) -> Self {
        self.token = Some(token);
        self.insecure_no_token = false;
        self
    }

    /// Runs the job without a token, explicitly: the ranks then cannot tell a stranger (another
    /// job, a process that took rank 0's port) from a rank of this job. For tests on a private
    /// machine; jobs should pass a token.
    pub fn without_token(mut self) -> Self {
        self.token = None;
        self.insecure_no_token = true;
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
    /// a non-empty address, a timeout in `(0, 1 day]`, and a token for a job of several ranks
    /// (or [`without_token`](Self::without_token)).
    pub fn validate(&self) -> Result<(), BootstrapError> {
        self.validate_ranks()?;
        let bad = |what: String| Err(BootstrapError::Config(what));
        if self.master_addr.trim().is_empty() {
            return bad("master_addr is empty".into());
        }
        if let Err(e) = ibgda_device::timeout::check(self.timeout) {
            return bad(format!("rank {}: bootstrap timeout: {e}", self.rank));
        }
        if self.world_size > 1 && self.token.is_none() && !self.insecure_no_token {
            return bad(format!(
                "rank {} of {}: no job token: set {} (32 hex digits, the same on every rank, e.g. \
                 from `openssl rand -hex 16`), call RankConfig::with_token, or opt out explicitly \
                 with RankConfig::without_token / {}=1",
                self.rank,
                self.world_size,
                vars::EP_JOB_TOKEN,
                vars::EP_INSECURE_NO_TOKEN
            ));
        }
        Ok(())
    }

    /// The key the ranks prove they hold: the token, or none at all for a job run without one.
    pub(crate) fn key(&self) -> &[u8] {
        match &self.token {
            Some(t) => t.as_bytes(),
            None => &[],
        }
    }

    fn validate_ranks(&self) -> Result<(), BootstrapError> {
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
        Ok(())
    }

    /// Reads the configuration from the process environment: `RANK`, `WORLD_SIZE` (required),
    /// `MASTER_PORT` (required when `WORLD_SIZE` > 1), `MASTER_ADDR` (default `127.0.0.1`),
    /// `EP_JOB_TOKEN` (32 hex digits; required when `WORLD_SIZE` > 1 unless
    /// `EP_INSECURE_NO_TOKEN=1`), `EP_LOCAL_RANK` or `LOCAL_RANK` (default `RANK`),
    /// `EP_BOOTSTRAP_TIMEOUT_S` (default 60, in `(0, 86400]`). Errors name the variable and its
    /// value (a token's value never: only its length).
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

        let insecure_no_token = match get(vars::EP_INSECURE_NO_TOKEN) {
            None => false,
            Some(v) if v == "1" => true,
            Some(v) => {
                return Err(invalid(
                    vars::EP_INSECURE_NO_TOKEN,
                    &v,
                    "set it to 1 to run without a job token, or unset it".into(),
                ))
            }
        };
        let token = match get(vars::EP_JOB_TOKEN) {
            Some(t) => Some(
                JobToken::parse(&t).ok_or_else(|| BootstrapError::EnvInvalid {
                    var: vars::EP_JOB_TOKEN,
                    // The value is a secret: say only how long it was.
                    value: format!("<{} characters>", t.len()),
                    reason: "must be 32 hexadecimal digits".into(),
                })?,
            ),
            None if world_size > 1 && !insecure_no_token => {
                return Err(BootstrapError::EnvMissing {
                    var: vars::EP_JOB_TOKEN,
                    hint: "the job's token, 32 hex digits, the same on every rank (for example \
                           from `openssl rand -hex 16`); EP_INSECURE_NO_TOKEN=1 runs without one",
                })
            }
            None => {
                if world_size > 1 {
                    tracing::warn!(
                        "{}=1: rank {rank} joins a job without a token, which any process \
                         reaching {master_addr}:{master_port} can join or pose as rank 0 of",
                        vars::EP_INSECURE_NO_TOKEN
                    );
                }
                None
            }
        };
        let insecure_no_token = insecure_no_token && token.is_none();

        let timeout = match get(vars::EP_BOOTSTRAP_TIMEOUT_S) {
            Some(s) => ibgda_device::timeout::parse_secs(&s)
                .map_err(|e| invalid(vars::EP_BOOTSTRAP_TIMEOUT_S, &s, e.to_string()))?,
            None => DEFAULT_TIMEOUT,
        };

        Ok(Self {
            rank,
            world_size,
            local_rank,
            master_addr,
            master_port,
            token,
            insecure_no_token,
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
                token: Some(JobToken::parse(TOKEN).unwrap()),
                insecure_no_token: false,
                timeout: Duration::from_millis(2500),
            }
        );
    }

    #[test]
    fn defaults() {
        let cfg = parse(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("MASTER_PORT", "1234"),
            ("EP_JOB_TOKEN", TOKEN),
        ])
        .unwrap();
        assert_eq!(cfg.master_addr, DEFAULT_MASTER_ADDR);
        assert_eq!(cfg.local_rank, 1);
        assert_eq!(cfg.timeout, DEFAULT_TIMEOUT);
        let cfg = parse(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "3"),
            ("MASTER_PORT", "9"),
            ("EP_JOB_TOKEN", TOKEN),
        ])
        .unwrap();
        assert_eq!(cfg.local_rank, 3);
        // One rank needs no port, and no token.
        let cfg = parse(&[("RANK", "0"), ("WORLD_SIZE", "1")]).unwrap();
        assert_eq!(cfg.master_port, 0);
        assert_eq!(cfg.token, None);
        cfg.validate().unwrap();
    }

    #[test]
    fn a_job_of_several_ranks_needs_a_token_or_an_explicit_opt_out() {
        let base = [("RANK", "1"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "1234")];
        let msg = err(&base);
        assert!(
            msg.contains("EP_JOB_TOKEN") && msg.contains("not set"),
            "{msg}"
        );
        let cfg = parse(&[base[0], base[1], base[2], ("EP_INSECURE_NO_TOKEN", "1")]).unwrap();
        assert!(cfg.insecure_no_token && cfg.token.is_none());
        cfg.validate().unwrap();
        let msg = err(&[base[0], base[1], base[2], ("EP_INSECURE_NO_TOKEN", "yes")]);
        assert!(msg.contains("EP_INSECURE_NO_TOKEN=\"yes\""), "{msg}");
        // A token given wins over the opt-out.
        let cfg = parse(&[
            base[0],
            base[1],
            base[2],
            ("EP_INSECURE_NO_TOKEN", "1"),
            ("EP_JOB_TOKEN", TOKEN),
        ])
        .unwrap();
        assert!(!cfg.insecure_no_token && cfg.token.is_some());
        // Through the API.
        let e = RankConfig::new(1, 2, 1234).unwrap().validate().unwrap_err();
        assert!(e.to_string().contains("no job token"), "{e}");
        RankConfig::new(1, 2, 1234)
            .unwrap()
            .without_token()
            .validate()
            .unwrap();
    }

    #[test]
    fn bootstrap_timeouts_are_validated_without_panics() {
        let base = [
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_PORT", "1"),
            ("EP_JOB_TOKEN", TOKEN),
        ];
        for bad in ["0", "-1", "NaN", "inf", "1e300", "1e19", "86401", "soon"] {
            let mut v = base.to_vec();
            v.push(("EP_BOOTSTRAP_TIMEOUT_S", bad));
            let msg = err(&v);
            assert!(
                msg.contains("EP_BOOTSTRAP_TIMEOUT_S") && msg.contains(bad),
                "{bad}: {msg}"
            );
        }
        let cfg = RankConfig::new(0, 1, 0).unwrap();
        for bad in [Duration::ZERO, Duration::MAX, Duration::from_secs(86_401)] {
            let e = cfg.clone().with_timeout(bad).validate().unwrap_err();
            assert!(e.to_string().contains("timeout"), "{bad:?}: {e}");
        }
    }

    #[test]
    fn errors_name_the_variable() {
        let base = [("MASTER_PORT", "29500"), ("EP_JOB_TOKEN", TOKEN)];
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
                &["EP_BOOTSTRAP_TIMEOUT_S=\"0\"", "zero"],
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
