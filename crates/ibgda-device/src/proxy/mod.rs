//! The CPU proxy of the CPU handler modes (`cpu`, `cpu_host_memory`): device code publishes each
//! QP's new producer index to an 8-byte [`ProducerSlot`]; proxy threads poll the slots and ring
//! the QP's [`Doorbell`] (doorbell record, then the doorbell) when a slot advances.
//!
//! ```
//! use std::sync::atomic::{AtomicU64, Ordering};
//! use std::sync::{Arc, Mutex};
//! use ibgda_device::proxy::{ProducerSlot, Proxy, ProxyConfig, ProxyQp};
//!
//! let slot = Arc::new(AtomicU64::new(0));
//! let rung = Arc::new(Mutex::new(Vec::new()));
//! let (keep, log) = (slot.clone(), rung.clone());
//! let qp = ProxyQp {
//!     // SAFETY (of the example): the doorbell closure keeps the slot alive for the proxy.
//!     slot: unsafe { ProducerSlot::new(slot.as_ptr()) }.unwrap(),
//!     doorbell: Box::new(move |pi: u64| { let _ = &keep; log.lock().unwrap().push(pi) }),
//!     rung_from: 0,
//!     rank: 0,
//!     qp_index: 0,
//! };
//! let proxy = Proxy::start(vec![qp], ProxyConfig::default()).unwrap();
//! slot.fetch_max(3, Ordering::Release); // what the GPU's atomicMax does
//! let report = proxy.stop().unwrap();   // a last sweep first: nothing published is lost
//! assert_eq!(report.rung, vec![3]);
//! assert_eq!(rung.lock().unwrap().last(), Some(&3));
//! ```

mod doorbell;
mod runner;
mod slot;

pub use doorbell::{Doorbell, Mlx5UarDoorbell};
pub use runner::{Proxy, ProxyConfig, ProxyError, ProxyQp, ProxyReport};
pub use slot::{
    check_alignment, ProducerSlot, SlotError, PRODUCER_SLOT_ALIGN, PRODUCER_SLOT_BYTES,
};
