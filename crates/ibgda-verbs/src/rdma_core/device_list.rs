//! Device discovery: `ibv_get_device_list` and opening an entry of it.

use std::ffi::CStr;
use std::ptr::NonNull;

use super::device::RdmaCoreDevice;
use super::loader::{api, Api};
use crate::device::DeviceInfo;
use crate::error::{Result, VerbsError};
use crate::ffi;

/// The list from `ibv_get_device_list`, freed on drop.
struct DeviceList {
    api: &'static Api,
    list: NonNull<*mut ffi::ibv_device>,
    len: usize,
}

impl DeviceList {
    /// The current device list. No kernel support or no devices gives `None`.
    fn get(api: &'static Api) -> Result<Option<Self>> {
        let mut n: std::ffi::c_int = 0;
        // SAFETY: `n` is a valid out-pointer; the returned array is owned until freed in Drop.
        let list = unsafe { (api.get_device_list)(&mut n) };
        match NonNull::new(list) {
            Some(list) => Ok(Some(Self {
                api,
                list,
                len: n.max(0) as usize,
            })),
            None => {
                let err = VerbsError::last_os("ibv_get_device_list");
                match err.errno() {
                    // ENOSYS: no RDMA support in the kernel; ENODEV/ENOENT: nothing to list.
                    Some(38) | Some(19) | Some(2) | Some(0) | None => Ok(None),
                    _ => Err(err),
                }
            }
        }
    }

    fn devices(&self) -> impl Iterator<Item = *mut ffi::ibv_device> + '_ {
        (0..self.len).map(move |i| {
            // SAFETY: libibverbs returns `len` valid entries followed by a NULL.
            unsafe { *self.list.as_ptr().add(i) }
        })
    }
}

impl Drop for DeviceList {
    fn drop(&mut self) {
        // SAFETY: the list came from ibv_get_device_list and is freed once; contexts opened from
        // its entries stay valid (libibverbs reference-counts devices).
        unsafe { (self.api.free_device_list)(self.list.as_ptr()) }
    }
}

fn device_name(api: &Api, dev: *mut ffi::ibv_device) -> String {
    // SAFETY: `dev` is a live entry of a device list; the name is a NUL-terminated array.
    let name = unsafe { (api.get_device_name)(dev) };
    if name.is_null() {
        return String::from("?");
    }
    // SAFETY: non-null, NUL-terminated, owned by the device entry.
    unsafe { CStr::from_ptr(name) }
        .to_string_lossy()
        .into_owned()
}

fn device_info(api: &Api, dev: *mut ffi::ibv_device) -> DeviceInfo {
    // SAFETY: `dev` is a live entry of a device list (for all three calls and the field reads).
    let (guid, mlx5, node_type, transport) = unsafe {
        (
            u64::from_be((api.get_device_guid)(dev)),
            (api.mlx5_is_supported)(dev),
            (*dev).node_type,
            (*dev).transport_type,
        )
    };
    DeviceInfo {
        name: device_name(api, dev),
        guid,
        node_type,
        transport,
        mlx5,
    }
}

/// Every RDMA device on this machine. No RDMA support at all (rdma-core not installed, no
/// kernel module, no `/sys/class/infiniband`) gives an empty list, not an error;
/// [`no_device_hint`](crate::no_device_hint) says why.
pub fn list_devices() -> Result<Vec<DeviceInfo>> {
    let api = match api() {
        Ok(api) => api,
        Err(VerbsError::RdmaCoreMissing(why)) => {
            tracing::debug!("no RDMA devices: {why}");
            return Ok(Vec::new());
        }
        Err(e) => return Err(e),
    };
    Ok(match DeviceList::get(api)? {
        Some(list) => list.devices().map(|d| device_info(api, d)).collect(),
        None => Vec::new(),
    })
}

/// Opens device `name`.
pub(crate) fn open_by_name(name: &str) -> Result<RdmaCoreDevice> {
    let api = api()?;
    let list = DeviceList::get(api)?;
    let devices: Vec<_> = list
        .as_ref()
        .map(|l| l.devices().collect())
        .unwrap_or_default();
    let dev = devices
        .iter()
        .copied()
        .find(|&d| device_name(api, d) == name)
        .ok_or_else(|| VerbsError::NoSuchDevice {
            name: name.to_string(),
            found: devices.iter().map(|&d| device_name(api, d)).collect(),
        })?;
    RdmaCoreDevice::open(api, dev, device_info(api, dev))
}

/// Opens the first mlx5 device, or the first device of any kind if none is mlx5.
pub(crate) fn open_first() -> Result<RdmaCoreDevice> {
    let api = api()?;
    let list = DeviceList::get(api)?;
    let devices: Vec<_> = list
        .as_ref()
        .map(|l| l.devices().collect())
        .unwrap_or_default();
    let dev = devices
        .iter()
        .copied()
        .find(|&d| device_info(api, d).mlx5)
        .or_else(|| devices.first().copied())
        .ok_or_else(|| VerbsError::NoSuchDevice {
            name: "<any>".into(),
            found: Vec::new(),
        })?;
    RdmaCoreDevice::open(api, dev, device_info(api, dev))
}
