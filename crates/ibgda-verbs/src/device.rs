//! Device discovery, the device context, and the capabilities the IBGDA path depends on.

use std::fmt;
use std::path::Path;
use std::sync::{Arc, OnceLock};

use crate::devx;
use crate::driver::Driver;
use crate::error::{Result, VerbsError};
use crate::ffi;
use crate::prm::{capability_page, AtomicCaps, GeneralCaps, HcaCap, QueryHcaCap};
use crate::rdma_core;

/// Where the kernel lists RDMA devices.
pub const SYSFS_INFINIBAND: &str = "/sys/class/infiniband";

/// A device as libibverbs lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Kernel name, e.g. `mlx5_0`.
    pub name: String,
    /// Node GUID (host order).
    pub guid: u64,
    /// Node type (`IBV_NODE_*`: 1 = channel adapter).
    pub node_type: i32,
    /// Transport (`IBV_TRANSPORT_*`: 0 = InfiniBand, which RoCE also reports).
    pub transport: i32,
    /// Whether the mlx5 provider drives it (so mlx5dv and DEVX may be available).
    pub mlx5: bool,
}

/// One line that explains an empty [`list_devices`](crate::list_devices) to a user.
pub fn no_device_hint() -> String {
    let hint = no_device_hint_for(Path::new(SYSFS_INFINIBAND));
    match crate::rdma_core::rdma_core_available() {
        Ok(()) => hint,
        Err(missing) => format!("{missing}; {hint}"),
    }
}

fn no_device_hint_for(sysfs: &Path) -> String {
    let fallback = "the emulated NIC (ibgda-emu) will be used by `auto`";
    match std::fs::read_dir(sysfs) {
        Err(_) => format!("no RDMA device found (no {}); {fallback}", sysfs.display()),
        Ok(entries) => {
            let names: Vec<String> = entries
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect();
            if names.is_empty() {
                format!(
                    "no RDMA device found ({} is empty: is the mlx5_ib module loaded?); {fallback}",
                    sysfs.display()
                )
            } else {
                format!(
                    "the kernel lists {} in {} but libibverbs found none: is rdma-core's mlx5 provider \
                     (libmlx5, /etc/libibverbs.d) installed?; {fallback}",
                    names.join(", "),
                    sysfs.display()
                )
            }
        }
    }
}

/// An open device. Everything made from it holds an `Arc<Context>`, so it is closed last.
///
/// Every call below the objects of this crate goes through the context's [`Driver`]: rdma-core
/// for a real device ([`Context::open`]), or any other implementation of the seam
/// ([`Context::with_driver`]; `ibgda-emu` provides the emulated NIC's).
pub struct Context {
    driver: Box<dyn Driver>,
    general: OnceLock<Option<GeneralCaps>>,
}

impl fmt::Debug for Context {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Context")
            .field("device", &self.name())
            .field("driver", &self.driver.kind())
            .field("devx", &self.has_devx())
            .finish()
    }
}

impl Context {
    /// Opens device `name` (e.g. `mlx5_0`) through rdma-core, with DEVX when it is an mlx5
    /// device and the kernel allows it. A device opened without DEVX still answers queries;
    /// DEVX objects then fail with [`VerbsError::DevxUnavailable`].
    pub fn open(name: &str) -> Result<Arc<Self>> {
        Ok(Self::with_driver(rdma_core::open_by_name(name)?))
    }

    /// Opens the first mlx5 device through rdma-core, or the first device of any kind if none is
    /// mlx5.
    pub fn open_first() -> Result<Arc<Self>> {
        Ok(Self::with_driver(rdma_core::open_first()?))
    }

    /// A context over an already opened device of any driver.
    pub fn with_driver(driver: impl Driver + 'static) -> Arc<Self> {
        Arc::new(Self {
            driver: Box::new(driver),
            general: OnceLock::new(),
        })
    }

    /// The driver every call goes through.
    pub fn driver(&self) -> &dyn Driver {
        &*self.driver
    }

    /// The device's name.
    pub fn name(&self) -> &str {
        &self.driver.info().name
    }

    /// What the device list says about the device.
    pub fn info(&self) -> &DeviceInfo {
        self.driver.info()
    }

    /// Whether DEVX objects can be created on this context.
    pub fn has_devx(&self) -> bool {
        self.driver.devx_unavailable().is_none()
    }

    /// Why DEVX is unavailable, if it is.
    pub fn devx_unavailable_reason(&self) -> Option<&str> {
        self.driver.devx_unavailable()
    }

    pub(crate) fn require_devx(&self) -> Result<()> {
        match self.driver.devx_unavailable() {
            None => Ok(()),
            Some(reason) => Err(VerbsError::DevxUnavailable {
                device: self.name().to_string(),
                reason: reason.to_string(),
            }),
        }
    }

    /// `ibv_query_device`: limits and firmware version.
    pub fn device_attrs(&self) -> Result<DeviceAttrs> {
        self.driver.query_device()
    }

    /// `mlx5dv_query_device`: the direct-verbs view (CQE version, flags).
    pub fn dv_attrs(&self) -> Result<DvAttrs> {
        if !self.info().mlx5 {
            return Err(VerbsError::NotMlx5 {
                device: self.name().to_string(),
            });
        }
        self.driver.query_dv()
    }

    /// Reads one HCA capability page through DEVX (`QUERY_HCA_CAP`).
    pub fn query_hca_cap(&self, cap: HcaCap) -> Result<Vec<u8>> {
        self.require_devx()?;
        let out = devx::general_cmd(
            self,
            "QUERY_HCA_CAP",
            &QueryHcaCap::new(cap).build(),
            QueryHcaCap::OUT_LEN,
        )?;
        Ok(capability_page(&out).to_vec())
    }

    /// The general capabilities, read once and cached (`None` without DEVX or if the query
    /// failed; the failure is logged).
    pub fn general_caps(&self) -> Option<&GeneralCaps> {
        self.general
            .get_or_init(|| match self.query_hca_cap(HcaCap::General) {
                Ok(page) => Some(GeneralCaps::parse(&page)),
                Err(e) => {
                    tracing::debug!(device = %self.name(), "QUERY_HCA_CAP(general): {e}");
                    None
                }
            })
            .as_ref()
    }

    /// The atomic capabilities (`QUERY_HCA_CAP` ATOMIC page).
    pub fn atomic_caps(&self) -> Result<AtomicCaps> {
        Ok(AtomicCaps::parse(&self.query_hca_cap(HcaCap::Atomic)?))
    }

    /// Everything [`Capabilities`] gathers; parts that need DEVX are `None` without it.
    pub fn capabilities(&self) -> Result<Capabilities> {
        let device = self.device_attrs()?;
        let dv = self.dv_attrs().ok();
        let general = self.general_caps().copied();
        let atomic = if general.map(|g| g.atomic).unwrap_or(false) {
            self.atomic_caps().ok()
        } else {
            None
        };
        Ok(Capabilities {
            device,
            dv,
            devx: self.has_devx(),
            devx_unavailable: self.devx_unavailable_reason().map(str::to_string),
            general,
            atomic,
        })
    }

    /// `ibv_query_port` for `port` (1-based).
    pub fn port(&self, port: u8) -> Result<PortInfo> {
        self.driver.query_port(port)
    }

    /// The non-empty GID table entries of `port`, with their types.
    pub fn gids(&self, port: u8) -> Result<Vec<GidEntry>> {
        let len = self.port(port)?.gid_tbl_len;
        self.driver.query_gids(port, len)
    }

    /// The EQ that completion events of CQs on `vector` go to (`mlx5dv_devx_query_eqn`).
    pub fn eqn(&self, vector: u32) -> Result<u32> {
        self.require_devx()?;
        self.driver.query_eqn(vector)
    }
}

/// Limits from `ibv_query_device`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceAttrs {
    /// Firmware version string.
    pub fw_ver: String,
    /// Node GUID (host order).
    pub node_guid: u64,
    /// PCI vendor id (0x02c9 = Mellanox/NVIDIA).
    pub vendor_id: u32,
    /// Vendor part id (e.g. 4129 = ConnectX-7).
    pub vendor_part_id: u32,
    /// Hardware revision.
    pub hw_ver: u32,
    /// Number of physical ports.
    pub phys_port_cnt: u8,
    /// Largest number of QPs.
    pub max_qp: i32,
    /// Largest work-queue depth through verbs.
    pub max_qp_wr: i32,
    /// Largest number of CQs.
    pub max_cq: i32,
    /// Largest CQ depth through verbs.
    pub max_cqe: i32,
    /// Largest number of MRs.
    pub max_mr: i32,
    /// Largest MR.
    pub max_mr_size: u64,
    /// Largest number of PDs.
    pub max_pd: i32,
    /// Outstanding reads/atomics per QP as responder.
    pub max_qp_rd_atom: i32,
    /// Outstanding reads/atomics per QP as requester.
    pub max_qp_init_rd_atom: i32,
    /// Atomic guarantee level.
    pub atomic_cap: AtomicCap,
}

/// `enum ibv_atomic_cap`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AtomicCap {
    /// No atomics.
    None,
    /// Atomic with respect to this HCA.
    Hca,
    /// Atomic with respect to every agent (CPU too).
    Global,
}

impl AtomicCap {
    pub(crate) fn from_raw(v: u32) -> Self {
        match v {
            1 => AtomicCap::Hca,
            2 => AtomicCap::Global,
            _ => AtomicCap::None,
        }
    }
}

/// From `mlx5dv_query_device`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DvAttrs {
    /// CQE version the provider negotiated (1 when `MLX5DV_CONTEXT_FLAGS_CQE_V1`).
    pub cqe_version: u8,
    /// `MLX5DV_CONTEXT_FLAGS_*`.
    pub flags: u64,
}

/// All the capabilities this crate reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Capabilities {
    /// `ibv_query_device`.
    pub device: DeviceAttrs,
    /// `mlx5dv_query_device` (mlx5 devices only).
    pub dv: Option<DvAttrs>,
    /// Whether DEVX is enabled on the context.
    pub devx: bool,
    /// Why not, if not.
    pub devx_unavailable: Option<String>,
    /// `QUERY_HCA_CAP` general page (DEVX only).
    pub general: Option<GeneralCaps>,
    /// `QUERY_HCA_CAP` atomic page (DEVX and `cmd_hca_cap.atomic` only).
    pub atomic: Option<AtomicCaps>,
}

/// `enum ibv_port_state`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PortState {
    /// Reserved / no state.
    Nop,
    /// Link down.
    Down,
    /// Link up, not configured by the subnet manager.
    Init,
    /// Configured, not yet active.
    Armed,
    /// Ready for traffic.
    Active,
    /// Active, deferred.
    ActiveDefer,
}

impl PortState {
    pub(crate) fn from_raw(v: u32) -> Self {
        match v {
            1 => PortState::Down,
            2 => PortState::Init,
            3 => PortState::Armed,
            4 => PortState::Active,
            5 => PortState::ActiveDefer,
            _ => PortState::Nop,
        }
    }
}

/// The port's link layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinkLayer {
    /// Not reported (older devices: InfiniBand).
    Unspecified,
    /// InfiniBand: addressed by LID.
    InfiniBand,
    /// Ethernet: RoCE, addressed by GID and MAC.
    Ethernet,
}

impl LinkLayer {
    pub(crate) fn from_raw(v: u8) -> Self {
        match v {
            1 => LinkLayer::InfiniBand,
            2 => LinkLayer::Ethernet,
            _ => LinkLayer::Unspecified,
        }
    }

    /// Whether QPs on this port are addressed by GID (RoCE) rather than LID.
    pub fn is_roce(self) -> bool {
        self == LinkLayer::Ethernet
    }
}

/// From `ibv_query_port`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PortInfo {
    /// Port number, 1-based.
    pub port: u8,
    /// Logical state.
    pub state: PortState,
    /// InfiniBand or Ethernet.
    pub link_layer: LinkLayer,
    /// The port's LID (InfiniBand).
    pub lid: u16,
    /// The subnet manager's LID.
    pub sm_lid: u16,
    /// Active MTU (`enum ibv_mtu`: 1 = 256 … 5 = 4096).
    pub active_mtu: u32,
    /// Largest MTU.
    pub max_mtu: u32,
    /// GID table length.
    pub gid_tbl_len: u32,
    /// P_Key table length.
    pub pkey_tbl_len: u16,
    /// Active link width code.
    pub active_width: u8,
    /// Active link speed code.
    pub active_speed: u8,
    /// Physical state (5 = LinkUp).
    pub phys_state: u8,
}

/// A GID's type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GidType {
    /// InfiniBand.
    Ib,
    /// RoCE v1 (Ethernet, not routable).
    RoceV1,
    /// RoCE v2 (UDP/IP, routable).
    RoceV2,
    /// Not reported (old kernel or library).
    Unknown,
}

impl GidType {
    pub(crate) fn from_raw(v: u32) -> Self {
        match v {
            ffi::IBV_GID_TYPE_IB => GidType::Ib,
            ffi::IBV_GID_TYPE_ROCE_V1 => GidType::RoceV1,
            ffi::IBV_GID_TYPE_ROCE_V2 => GidType::RoceV2,
            _ => GidType::Unknown,
        }
    }
}

/// One GID table entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GidEntry {
    /// Index in the port's table (the `sgid_index` to use).
    pub index: u32,
    /// The GID, network byte order.
    pub gid: [u8; 16],
    /// Its type.
    pub kind: GidType,
}

impl GidEntry {
    /// Whether the GID is an IPv4-mapped IPv6 address (`::ffff:a.b.c.d`).
    pub fn is_ipv4_mapped(&self) -> bool {
        self.gid[..10] == [0; 10] && self.gid[10..12] == [0xff, 0xff]
    }

    /// Whether the GID is link-local (`fe80::/64`).
    pub fn is_link_local(&self) -> bool {
        self.gid[0] == 0xfe && self.gid[1] & 0xc0 == 0x80
    }
}

/// Formats a GID as eight groups of four hex digits.
pub fn format_gid(gid: &[u8; 16]) -> String {
    gid.chunks(2)
        .map(|c| format!("{:02x}{:02x}", c[0], c[1]))
        .collect::<Vec<_>>()
        .join(":")
}

/// The GID a RoCE QP should use: RoCE v2 over IPv4, then RoCE v2 other than link-local, then any
/// RoCE v2, then RoCE v1, then anything. `None` for an empty table.
pub fn preferred_roce_gid(gids: &[GidEntry]) -> Option<&GidEntry> {
    let v2 = |g: &&GidEntry| g.kind == GidType::RoceV2;
    gids.iter()
        .filter(v2)
        .find(|g| g.is_ipv4_mapped())
        .or_else(|| gids.iter().filter(v2).find(|g| !g.is_link_local()))
        .or_else(|| gids.iter().find(v2))
        .or_else(|| gids.iter().find(|g| g.kind == GidType::RoceV1))
        .or_else(|| gids.first())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::list_devices;

    #[test]
    fn listing_without_rdma_is_empty_not_an_error() {
        let devices = list_devices().expect("listing never fails for lack of devices");
        if devices.is_empty() {
            let hint = no_device_hint();
            assert!(
                hint.starts_with("no RDMA device found") || hint.contains("libibverbs found none"),
                "{hint}"
            );
            assert!(hint.contains("ibgda-emu"), "{hint}");
        } else {
            eprintln!("this machine has RDMA devices: {devices:?}");
        }
    }

    #[test]
    fn opening_a_missing_device_names_it() {
        match Context::open("mlx5_does_not_exist") {
            Err(VerbsError::NoSuchDevice { name, .. }) => assert_eq!(name, "mlx5_does_not_exist"),
            Err(e) => panic!("unexpected error: {e}"),
            Ok(_) => panic!("opened a device that does not exist"),
        }
    }

    #[test]
    fn open_first_without_devices_is_an_error() {
        if !list_devices().unwrap().is_empty() {
            eprintln!("note: this machine has RDMA devices; the no-device path is not exercised");
            return;
        }
        let e = Context::open_first().unwrap_err();
        assert!(matches!(e, VerbsError::NoSuchDevice { .. }), "{e}");
    }

    #[test]
    fn hints_for_each_sysfs_state() {
        let dir = std::env::temp_dir().join(format!("ibgda-verbs-sysfs-{}", std::process::id()));
        let missing = dir.join("absent");
        assert!(no_device_hint_for(&missing).contains("(no "));
        std::fs::create_dir_all(&dir).unwrap();
        assert!(no_device_hint_for(&dir).contains("is empty"));
        std::fs::create_dir_all(dir.join("mlx5_0")).unwrap();
        let h = no_device_hint_for(&dir);
        assert!(h.contains("mlx5_0") && h.contains("provider"), "{h}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn gid_helpers() {
        let mut v4 = [0u8; 16];
        v4[10] = 0xff;
        v4[11] = 0xff;
        v4[12..].copy_from_slice(&[10, 0, 0, 1]);
        let mut ll = [0u8; 16];
        ll[0] = 0xfe;
        ll[1] = 0x80;
        ll[15] = 1;
        let gids = [
            GidEntry {
                index: 0,
                gid: ll,
                kind: GidType::RoceV1,
            },
            GidEntry {
                index: 1,
                gid: ll,
                kind: GidType::RoceV2,
            },
            GidEntry {
                index: 2,
                gid: v4,
                kind: GidType::RoceV1,
            },
            GidEntry {
                index: 3,
                gid: v4,
                kind: GidType::RoceV2,
            },
        ];
        assert_eq!(preferred_roce_gid(&gids).unwrap().index, 3);
        assert_eq!(preferred_roce_gid(&gids[..3]).unwrap().index, 1);
        assert_eq!(preferred_roce_gid(&gids[..1]).unwrap().index, 0);
        assert!(preferred_roce_gid(&[]).is_none());
        assert!(gids[3].is_ipv4_mapped() && gids[0].is_link_local());
        assert_eq!(format_gid(&v4), "0000:0000:0000:0000:0000:ffff:0a00:0001");
    }
}
