//! The status/syndrome header of every command output.

use super::bits::BitReader;
use super::layout::cmd_out;

/// Firmware refused a command: the `status` and `syndrome` of its output.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "firmware command {command} failed: status {status:#04x} ({}), syndrome {syndrome:#010x}",
    status_text(*status)
)]
pub struct CommandFailed {
    /// The command (`CREATE_QP`, `INIT2RTR_QP`, ...).
    pub command: &'static str,
    /// `<cmd>_out.status`.
    pub status: u8,
    /// `<cmd>_out.syndrome`: firmware's detailed reason, to quote to NVIDIA support.
    pub syndrome: u32,
}

/// What a command `status` means (`MLX5_CMD_STAT_*` in the kernel's mlx5 driver).
pub fn status_text(status: u8) -> &'static str {
    match status {
        0x00 => "ok",
        0x01 => "internal error",
        0x02 => "bad operation",
        0x03 => "bad parameter",
        0x04 => "bad system state",
        0x05 => "bad resource",
        0x06 => "resource busy",
        0x08 => "limits exceeded",
        0x09 => "bad resource state",
        0x0a => "bad index",
        0x0f => "no resources",
        0x10 => "bad QP state",
        0x30 => "bad packet",
        0x40 => "bad size (too many outstanding CQEs)",
        0x50 => "bad input length",
        0x51 => "bad output length",
        _ => "unknown status",
    }
}

/// Checks the header of a command output: `Ok` when `status` is 0.
///
/// # Panics
/// If `out` is shorter than the 16-byte output header (a bug in the caller's buffer sizes).
pub fn check_output(command: &'static str, out: &[u8]) -> Result<(), CommandFailed> {
    assert!(
        out.len() >= cmd_out::SIZE_BYTES,
        "command output shorter than its header"
    );
    let r = BitReader::new(out);
    let status = r.get(cmd_out::STATUS) as u8;
    if status == 0 {
        return Ok(());
    }
    Err(CommandFailed {
        command,
        status,
        syndrome: r.get(cmd_out::SYNDROME) as u32,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ok_and_failed_outputs() {
        let mut out = [0u8; 16];
        assert_eq!(check_output("CREATE_QP", &out), Ok(()));
        out[0] = 0x03;
        out[4..8].copy_from_slice(&0x1234_5678u32.to_be_bytes());
        let e = check_output("CREATE_QP", &out).unwrap_err();
        assert_eq!(
            e,
            CommandFailed {
                command: "CREATE_QP",
                status: 3,
                syndrome: 0x1234_5678
            }
        );
        let text = e.to_string();
        assert!(
            text.contains("CREATE_QP")
                && text.contains("bad parameter")
                && text.contains("0x12345678"),
            "{text}"
        );
    }

    #[test]
    fn unknown_status_still_reads() {
        assert_eq!(status_text(0x77), "unknown status");
        assert_eq!(status_text(0x10), "bad QP state");
    }
}
