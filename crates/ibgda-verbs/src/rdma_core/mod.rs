//! The rdma-core implementation of the [`Driver`](crate::Driver) seam: libibverbs and libmlx5
//! (mlx5dv, DEVX) on a real ConnectX, both loaded at run time (nothing links them).
//!
//! Nothing here decides anything: each method is the C call it names, its `errno` turned into a
//! [`VerbsError`](crate::VerbsError), and each handle frees its object on drop.

mod device;
mod device_list;
mod handles;
mod loader;

pub use device::RdmaCoreDevice;
pub use device_list::list_devices;
pub(crate) use device_list::{open_by_name, open_first};
pub use loader::{rdma_core_available, IBVERBS_ENV, MLX5_ENV};
