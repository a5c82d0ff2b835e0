//! The per-job secret that keeps strangers out of a rendezvous, and the keyed hashes built on it.

use std::fmt;
use std::io::Read as _;

use hmac::{Hmac, Mac as _};
use sha2::Sha256;

use super::BootstrapError;

/// 128 random bits shared by the ranks of one job (`EP_JOB_TOKEN`, 32 hex digits).
///
/// The ranks prove to each other that they hold it (HMAC-SHA256 over fresh nonces from both
/// sides, see the [`TcpCommunicator`](super::TcpCommunicator) docs); the token itself never
/// crosses the network. A process of another job, a leftover of an earlier run, or a process that
/// took rank 0's port first can therefore neither join nor pass for rank 0. It does not protect
/// against someone who can read the environment of the job's processes.
///
/// `Debug` does not print the value.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct JobToken([u8; 16]);

impl JobToken {
    /// A fresh token from the kernel's random source (`/dev/urandom`).
    pub fn generate() -> Result<Self, BootstrapError> {
        random_bytes("the job token").map(Self)
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
}

impl fmt::Debug for JobToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("JobToken(<redacted>)")
    }
}

/// `N` bytes from the kernel's random source; `what` names their use in the error.
pub(crate) fn random_bytes<const N: usize>(what: &str) -> Result<[u8; N], BootstrapError> {
    let mut bytes = [0u8; N];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .map_err(|source| BootstrapError::Os {
            step: format!("reading {N} random bytes from /dev/urandom for {what}"),
            source,
        })?;
    Ok(bytes)
}

/// An HMAC-SHA256 tag.
pub(crate) type Tag = [u8; 32];

/// HMAC-SHA256 under `key` of the concatenation of `parts`. Callers start `parts` with a label
/// naming the tag's purpose, so a tag made for one purpose is never valid for another.
pub(crate) fn tag(key: &[u8], parts: &[&[u8]]) -> Tag {
    let mut mac = new_mac(key);
    for p in parts {
        mac.update(p);
    }
    mac.finalize().into_bytes().into()
}

/// Whether `claimed` is the tag of `parts` under `key`, compared in constant time.
pub(crate) fn tag_matches(key: &[u8], parts: &[&[u8]], claimed: &Tag) -> bool {
    let mut mac = new_mac(key);
    for p in parts {
        mac.update(p);
    }
    mac.verify_slice(claimed).is_ok()
}

fn new_mac(key: &[u8]) -> Hmac<Sha256> {
    // HMAC takes a key of any length (longer ones are hashed first), so this cannot fail.
    <Hmac<Sha256> as hmac::Mac>::new_from_slice(key).unwrap_or_else(|_| unreachable!())
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
    }

    #[test]
    fn tags_bind_key_label_and_data() {
        // RFC 4231 test case 2: key "Jefe", data "what do ya want for nothing?".
        let t = tag(b"Jefe", &[b"what do ya want ", b"for nothing?"]);
        let hex: String = t.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(
            hex,
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
        assert!(tag_matches(b"Jefe", &[b"what do ya want for nothing?"], &t));
        assert!(!tag_matches(
            b"Jeff",
            &[b"what do ya want for nothing?"],
            &t
        ));
        assert!(!tag_matches(
            b"Jefe",
            &[b"what do ya want for nothing!"],
            &t
        ));
    }
}
