//! Memory registered through a [`VerbsTransport`](super::VerbsTransport).

use std::sync::Arc;

use ibgda_device::cuda::DeviceBuffer;
use ibgda_emu::HostBuffer;
use ibgda_verbs::MemoryRegion;

use crate::transport::backend::Registration;

use super::memory::Block;

/// The registered memory of a [`VerbsTransport`].
#[derive(Debug)]
pub(super) struct VerbsRegistration {
    pub(super) mr: MemoryRegion,
    pub(super) len: usize,
    pub(super) mem: Block,
}

impl Registration for VerbsRegistration {
    fn addr(&self) -> u64 {
        self.mr.addr()
    }

    fn len(&self) -> usize {
        self.len
    }

    fn lkey(&self) -> u32 {
        self.mr.lkey()
    }

    fn rkey(&self) -> u32 {
        self.mr.rkey()
    }

    fn scratch(&self) -> u64 {
        self.mr.addr() + self.len as u64
    }

    fn device(&self) -> Option<&Arc<DeviceBuffer>> {
        match &self.mem {
            Block::Device(d) => Some(d),
            Block::Host(_) => None,
        }
    }

    fn host(&self) -> Option<&Arc<HostBuffer>> {
        match &self.mem {
            Block::Host(h) => Some(h),
            Block::Device(_) => None,
        }
    }
}
