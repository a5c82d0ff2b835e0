//! The per-job secret that keeps strangers out of a rendezvous.

use std::fmt;
use std::io::Read as _;

use super::BootstrapError;

/// 128 random bits shared by the ranks of one job (`EP_JOB_TOKEN`, 32 hex digits).
///
/// Rank 0 turns away any process whose token differs, so a process of another job, or a leftover
/// of an earlier run, cannot join by connecting to the right port. It is a guard against
/// accidents on a shared host, not authentication against an attacker who can read the
/// environment of the job's processes.
///
/// `Debug` does not print the value.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct JobToken([u8; 16]);

impl JobToken {
    /// The token of a job started without `EP_JOB_TOKEN`: all zeros. Processes without a token can
    /// join each other, and only each other.
    pub const UNSET: JobToken = JobToken([0; 16]);

    /// A fresh token from the kernel's random source (`/dev/urandom`).
    pub fn generate() -> Result<Self, BootstrapError> {
        let mut bytes = [0u8; 16];
        std::fs::File::open("/dev/urandom")
            .and_then(|mut f| f.read_exact(&mut bytes))
            .map_err(|source| BootstrapError::Os {
                step: "reading 16 random bytes from /dev/urandom for the job token".into(),
                source,
            })?;
        Ok(Self(bytes))
    }

    /// The token with these bytes.
    pub const fn from_bytes(bytes: [u8; 16]) -> Self {
        Self(bytes)
    }

    /// Parses 32 hexadecimal digits (either case). `None` for anything else.
    pub fn parse(hex: &str) -> Option<Self> {
        let hex = hex.as_bytes();
        if hex.len() != 32 {
            return None;
        }
        let mut bytes = [0u8; 16];
        for (i, pair) in hex.chunks_exact(2).enumerate() {
            let hi = (pair[0] as char).to_digit(16)?;
            let lo = (pair[1] as char).to_digit(16)?;
            bytes[i] = (hi << 4 | lo) as u8;
        }
        Some(Self(bytes))
    }

    /// The token as 32 lowercase hexadecimal digits, the form `EP_JOB_TOKEN` takes.
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// The raw bytes.
    pub const fn as_bytes(&self) -> &[u8; 16] {
        &self.0
    }

    /// Whether this is [`JobToken::UNSET`].
    pub fn is_unset(&self) -> bool {
        *self == Self::UNSET
    }

    /// Compares in time independent of where the tokens differ.
    pub(crate) fn matches(&self, other: &JobToken) -> bool {
        self.0
            .iter()
            .zip(other.0.iter())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
    }
}

impl fmt::Debug for JobToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_unset() {
            f.write_str("JobToken(unset)")
        } else {
            f.write_str("JobToken(<redacted>)")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trip() {
        let t = JobToken::generate().unwrap();
        assert_eq!(JobToken::parse(&t.to_hex()), Some(t));
        assert_eq!(
            JobToken::parse("00112233445566778899AABBCCDDEEFF")
                .unwrap()
                .as_bytes()[15],
            0xff
        );
    }

    #[test]
    fn generated_tokens_differ() {
        let a = JobToken::generate().unwrap();
        let b = JobToken::generate().unwrap();
        assert_ne!(a, b);
        assert!(!a.is_unset());
    }

    #[test]
    fn bad_hex_rejected() {
        for bad in ["", "abc", &"g".repeat(32), &"0".repeat(31), &"0".repeat(33)] {
            assert_eq!(JobToken::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn debug_hides_the_value() {
        let t = JobToken::parse(&"ab".repeat(16)).unwrap();
        assert!(!format!("{t:?}").contains("abab"));
        assert!(t.matches(&t) && !t.matches(&JobToken::UNSET));
    }
}
