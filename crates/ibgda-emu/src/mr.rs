//! Memory registrations: what a key names (base, length, access rights, where the bytes are)
//! and the check every WQE access goes through before any memory is touched.

use std::any::Any;
use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, RwLock};

use crate::backend::Loc;

/// Access rights of a registration (`IBV_ACCESS_*`). Local reads are always allowed.
#[derive(Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Access(u32);

impl Access {
    /// No rights beyond local read.
    pub const NONE: Self = Self(0);
    /// The NIC may write here on behalf of a local WQE (RDMA read targets, atomic results).
    pub const LOCAL_WRITE: Self = Self(1);
    /// Peers may RDMA-write here.
    pub const REMOTE_WRITE: Self = Self(2);
    /// Peers may RDMA-read from here.
    pub const REMOTE_READ: Self = Self(4);
    /// Peers may perform atomics here.
    pub const REMOTE_ATOMIC: Self = Self(8);
    /// Every right.
    pub const ALL: Self = Self(15);

    /// The raw bits.
    pub const fn bits(self) -> u32 {
        self.0
    }

    /// From raw bits (unknown bits dropped).
    pub const fn from_bits(bits: u32) -> Self {
        Self(bits & 15)
    }

    /// Whether every right in `other` is granted.
    pub const fn contains(self, other: Access) -> bool {
        self.0 & other.0 == other.0
    }
}

impl std::ops::BitOr for Access {
    type Output = Access;
    fn bitor(self, rhs: Access) -> Access {
        Access(self.0 | rhs.0)
    }
}

impl fmt::Debug for Access {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names = [
            (Self::LOCAL_WRITE, "LOCAL_WRITE"),
            (Self::REMOTE_WRITE, "REMOTE_WRITE"),
            (Self::REMOTE_READ, "REMOTE_READ"),
            (Self::REMOTE_ATOMIC, "REMOTE_ATOMIC"),
        ];
        let set: Vec<_> = names
            .iter()
            .filter(|(a, _)| self.contains(*a))
            .map(|(_, n)| *n)
            .collect();
        if set.is_empty() {
            write!(f, "Access(NONE)")
        } else {
            write!(f, "Access({})", set.join(" | "))
        }
    }
}

/// Whether registered bytes are host memory or GPU memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Place {
    /// Host memory (heap, pinned, mapped).
    Host,
    /// GPU memory (CUDA backend).
    Device,
}

impl Place {
    /// The location of `addr` in this place.
    pub const fn at(self, addr: u64) -> Loc {
        match self {
            Place::Host => Loc::Host(addr),
            Place::Device => Loc::Device(addr),
        }
    }
}

/// A memory registration as WQEs name it: keys, the address range WQEs use, rights and place.
/// lkey and rkey are equal, as on mlx5.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Mr {
    /// Key for local gather/scatter entries.
    pub lkey: u32,
    /// Key peers put in remote-address segments.
    pub rkey: u32,
    /// First address WQEs may name.
    pub addr: u64,
    /// Bytes covered.
    pub len: u64,
    /// Rights.
    pub access: Access,
    /// Host or GPU memory.
    pub place: Place,
}

impl Mr {
    /// Address `offset` bytes into the registration (for building WQEs).
    pub const fn at(&self, offset: u64) -> u64 {
        self.addr + offset
    }
}

/// A registration as the NIC keeps it.
pub(crate) struct Region {
    pub mr: Mr,
    /// Address this process's backend uses for `mr.addr` (differs from it for IPC imports).
    pub base: u64,
    /// Keeps the memory alive while registered (a buffer, an IPC mapping), if owned.
    pub _keep: Option<Arc<dyn Any + Send + Sync>>,
}

impl fmt::Debug for Region {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Region")
            .field("mr", &self.mr)
            .field("base", &format_args!("{:#x}", self.base))
            .finish()
    }
}

/// Why an access was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Denied {
    /// No registration with this key.
    Key,
    /// The range is not inside the registration.
    Range,
    /// The registration lacks the right.
    Access,
}

/// The registrations of one NIC (or the imported registrations of one remote node).
#[derive(Debug, Default)]
pub(crate) struct Registry {
    regions: RwLock<HashMap<u32, Arc<Region>>>,
}

impl Registry {
    pub fn insert(&self, region: Region) {
        let key = region.mr.lkey;
        self.regions
            .write()
            .expect("registry lock")
            .insert(key, Arc::new(region));
    }

    pub fn remove(&self, key: u32) -> Option<Arc<Region>> {
        self.regions.write().expect("registry lock").remove(&key)
    }

    pub fn all(&self) -> Vec<Arc<Region>> {
        self.regions
            .read()
            .expect("registry lock")
            .values()
            .cloned()
            .collect()
    }

    /// Where `[addr, addr + len)` under `key` lives, if the key exists, the range is inside its
    /// registration and the registration grants `need`. A zero-length range is checked like a
    /// one-byte range at `addr` would be, except that it may sit at the very end.
    #[cfg(test)]
    pub fn check(&self, key: u32, addr: u64, len: u64, need: Access) -> Result<Loc, Denied> {
        self.check_held(key, addr, len, need).map(|(loc, _)| loc)
    }

    /// [`check`](Self::check), and the registration itself, which keeps the memory it owns
    /// alive for as long as the caller holds it (strict mode's WQEs in flight hold theirs).
    pub fn check_held(
        &self,
        key: u32,
        addr: u64,
        len: u64,
        need: Access,
    ) -> Result<(Loc, Arc<Region>), Denied> {
        let map = self.regions.read().expect("registry lock");
        let r = map.get(&key).ok_or(Denied::Key)?;
        let end = addr.checked_add(len).ok_or(Denied::Range)?;
        let mr_end = r.mr.addr + r.mr.len;
        if addr < r.mr.addr || end > mr_end {
            return Err(Denied::Range);
        }
        if !r.mr.access.contains(need) {
            return Err(Denied::Access);
        }
        Ok((r.mr.place.at(r.base + (addr - r.mr.addr)), r.clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reg() -> Registry {
        let r = Registry::default();
        r.insert(Region {
            mr: Mr {
                lkey: 7,
                rkey: 7,
                addr: 0x1000,
                len: 0x100,
                access: Access::REMOTE_WRITE,
                place: Place::Host,
            },
            base: 0x9000,
            _keep: None,
        });
        r
    }

    #[test]
    fn checks_key_range_and_rights() {
        let r = reg();
        assert_eq!(
            r.check(7, 0x1010, 16, Access::REMOTE_WRITE),
            Ok(Loc::Host(0x9010))
        );
        assert_eq!(r.check(7, 0x10f0, 16, Access::NONE), Ok(Loc::Host(0x90f0)));
        assert_eq!(r.check(8, 0x1010, 16, Access::NONE), Err(Denied::Key));
        assert_eq!(r.check(7, 0x10f1, 16, Access::NONE), Err(Denied::Range));
        assert_eq!(r.check(7, 0xfff, 1, Access::NONE), Err(Denied::Range));
        assert_eq!(r.check(7, u64::MAX, 2, Access::NONE), Err(Denied::Range));
        assert_eq!(
            r.check(7, 0x1000, 8, Access::REMOTE_ATOMIC),
            Err(Denied::Access)
        );
    }

    #[test]
    fn access_debug_names_rights() {
        let a = Access::LOCAL_WRITE | Access::REMOTE_ATOMIC;
        assert_eq!(format!("{a:?}"), "Access(LOCAL_WRITE | REMOTE_ATOMIC)");
        assert_eq!(format!("{:?}", Access::NONE), "Access(NONE)");
    }
}
