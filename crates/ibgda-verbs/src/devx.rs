//! DEVX plumbing: general commands and the RAII wrapper of firmware objects.

use std::sync::Arc;

use crate::device::Context;
use crate::driver::DriverObj;
use crate::error::{Result, VerbsError};
use crate::prm::check_output;

/// A command the driver reported failed: firmware's status/syndrome when the output mailbox
/// carries one, else the driver's error.
fn command_error(command: &'static str, err: VerbsError, out: &[u8]) -> VerbsError {
    match check_output(command, out) {
        Err(failed) => VerbsError::firmware(failed, err.errno().unwrap_or(0)),
        Ok(()) => err,
    }
}

/// A command the driver reported done: its output must say so too.
fn command_done(command: &'static str, out: &[u8]) -> Result<()> {
    check_output(command, out).map_err(|failed| VerbsError::firmware(failed, 0))
}

/// Runs a command that creates no object (`mlx5dv_devx_general_cmd`) and returns its output.
pub(crate) fn general_cmd(
    ctx: &Context,
    command: &'static str,
    input: &[u8],
    out_len: usize,
) -> Result<Vec<u8>> {
    ctx.require_devx()?;
    let mut out = vec![0u8; out_len];
    if let Err(e) = ctx.driver().devx_general_cmd(input, &mut out) {
        return Err(command_error(command, e, &out));
    }
    command_done(command, &out)?;
    Ok(out)
}

/// A firmware object created through DEVX, destroyed on drop (the kernel builds the matching
/// destroy command itself).
pub(crate) struct DevxObj {
    // Declared first: destroyed before the context is released.
    obj: Box<dyn DriverObj>,
    // Keeps the context open for as long as the object exists.
    _ctx: Arc<Context>,
}

impl DevxObj {
    /// Creates an object with `input` (a `*_in` command image) and returns it with the output.
    pub(crate) fn create(
        ctx: &Arc<Context>,
        command: &'static str,
        input: &[u8],
        out_len: usize,
    ) -> Result<(Self, Vec<u8>)> {
        ctx.require_devx()?;
        let mut out = vec![0u8; out_len];
        let obj = match ctx.driver().devx_obj_create(input, &mut out) {
            Ok(obj) => obj,
            Err(e) => return Err(command_error(command, e, &out)),
        };
        let obj = Self {
            obj,
            _ctx: ctx.clone(),
        };
        // A created object with a failed status cannot happen, but check rather than trust.
        command_done(command, &out)?;
        Ok((obj, out))
    }

    /// Sends a modify command (a QP state transition) to the object.
    pub(crate) fn modify(
        &self,
        command: &'static str,
        input: &[u8],
        out_len: usize,
    ) -> Result<Vec<u8>> {
        let mut out = vec![0u8; out_len];
        if let Err(e) = self.obj.modify(input, &mut out) {
            return Err(command_error(command, e, &out));
        }
        command_done(command, &out)?;
        Ok(out)
    }

    /// Sends a query command (`QUERY_QP`, `QUERY_CQ`) to the object and returns its output.
    pub(crate) fn query(
        &self,
        command: &'static str,
        input: &[u8],
        out_len: usize,
    ) -> Result<Vec<u8>> {
        let mut out = vec![0u8; out_len];
        if let Err(e) = self.obj.query(input, &mut out) {
            return Err(command_error(command, e, &out));
        }
        command_done(command, &out)?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failed_commands_prefer_firmware_status() {
        let mut out = [0u8; 16];
        out[0] = 0x05;
        let e = command_error(
            "CREATE_QP",
            VerbsError::from_errno("mlx5dv_devx_obj_create", 121),
            &out,
        );
        assert!(matches!(e, VerbsError::Firmware { errno: 121, .. }), "{e}");
        assert!(e.to_string().contains("bad resource"));
        let e = command_error(
            "RTR2RTS_QP",
            VerbsError::from_errno("mlx5dv_devx_obj_modify", 13),
            &[0u8; 16],
        );
        assert_eq!(
            e.to_string(),
            "mlx5dv_devx_obj_modify failed: Permission denied (errno 13)"
        );
    }
}
