//! DEVX plumbing: general commands and the RAII wrapper of firmware objects.

use std::ptr::NonNull;
use std::sync::Arc;

use crate::device::Context;
use crate::error::{Result, VerbsError};
use crate::ffi;
use crate::prm::check_output;

/// The error for a C call that returned `rc` (`-1` with `errno`, `-errno`, or `errno`).
pub(crate) fn rc_error(call: &'static str, rc: i32) -> VerbsError {
    if rc == -1 {
        VerbsError::last_os(call)
    } else {
        VerbsError::from_errno(call, rc)
    }
}

/// A command failed: firmware's status/syndrome when the output carries one, else errno.
fn command_error(call: &'static str, command: &'static str, rc: i32, out: &[u8]) -> VerbsError {
    match check_output(command, out) {
        Err(failed) => VerbsError::firmware(failed),
        Ok(()) => rc_error(call, rc),
    }
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
    // SAFETY: DEVX context; `input` and `out` are valid buffers of the lengths passed.
    let rc = unsafe {
        ffi::mlx5dv_devx_general_cmd(
            ctx.raw(),
            input.as_ptr().cast(),
            input.len(),
            out.as_mut_ptr().cast(),
            out.len(),
        )
    };
    if rc != 0 {
        return Err(command_error("mlx5dv_devx_general_cmd", command, rc, &out));
    }
    check_output(command, &out).map_err(VerbsError::firmware)?;
    Ok(out)
}

/// A firmware object created through DEVX, destroyed on drop (the kernel builds the matching
/// destroy command itself).
pub(crate) struct DevxObj {
    obj: NonNull<ffi::mlx5dv_devx_obj>,
    what: &'static str,
    // Keeps the context open for as long as the object exists.
    _ctx: Arc<Context>,
}

// SAFETY: DEVX objects are handles to kernel objects; rdma-core's DEVX calls on them are
// thread-safe, and the pointer is owned and freed only in Drop.
unsafe impl Send for DevxObj {}
// SAFETY: `&DevxObj` only allows `modify`, a thread-safe ioctl.
unsafe impl Sync for DevxObj {}

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
        // SAFETY: DEVX context; `input` and `out` are valid buffers of the lengths passed.
        let obj = unsafe {
            ffi::mlx5dv_devx_obj_create(
                ctx.raw(),
                input.as_ptr().cast(),
                input.len(),
                out.as_mut_ptr().cast(),
                out.len(),
            )
        };
        let Some(obj) = NonNull::new(obj) else {
            return Err(command_error("mlx5dv_devx_obj_create", command, -1, &out));
        };
        let obj = Self {
            obj,
            what: command,
            _ctx: ctx.clone(),
        };
        // A created object with a failed status cannot happen, but check rather than trust.
        check_output(command, &out).map_err(VerbsError::firmware)?;
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
        // SAFETY: the object is live; `input` and `out` are valid buffers of the lengths passed.
        let rc = unsafe {
            ffi::mlx5dv_devx_obj_modify(
                self.obj.as_ptr(),
                input.as_ptr().cast(),
                input.len(),
                out.as_mut_ptr().cast(),
                out.len(),
            )
        };
        if rc != 0 {
            return Err(command_error("mlx5dv_devx_obj_modify", command, rc, &out));
        }
        check_output(command, &out).map_err(VerbsError::firmware)?;
        Ok(out)
    }
}

impl Drop for DevxObj {
    fn drop(&mut self) {
        // SAFETY: the object is live and destroyed exactly once; objects that reference it (a QP
        // referencing a CQ) hold Arcs and are gone first.
        let rc = unsafe { ffi::mlx5dv_devx_obj_destroy(self.obj.as_ptr()) };
        if rc != 0 {
            tracing::error!(
                "destroying DEVX {} object: {}",
                self.what,
                rc_error("mlx5dv_devx_obj_destroy", rc)
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failed_commands_prefer_firmware_status() {
        let mut out = [0u8; 16];
        out[0] = 0x05;
        let e = command_error("mlx5dv_devx_obj_create", "CREATE_QP", -1, &out);
        assert!(matches!(e, VerbsError::Firmware { .. }), "{e}");
        assert!(e.to_string().contains("bad resource"));
        let e = command_error("mlx5dv_devx_obj_modify", "RTR2RTS_QP", 13, &[0u8; 16]);
        assert_eq!(
            e.to_string(),
            "mlx5dv_devx_obj_modify failed: Permission denied (errno 13)"
        );
    }
}
