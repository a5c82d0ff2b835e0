//! How a verbs QP is reached and what a peer is told: the real device and port to open
//! ([`RealNicSpec`], with the `EP_NIC_*` overrides), this port's address by its link layer
//! ([`LocalAddress`]: a LID on InfiniBand, a RoCE v2 GID on Ethernet), and the connection info
//! sent through the bootstrap ([`VerbsConnInfo`]: QPN, PSN, LID, GID, link layer, MTU and the
//! memory window the sender's peers may write).

use ibgda_verbs::prm::Mtu;
use ibgda_verbs::{preferred_roce_gid, ConnectInfo, GidEntry, GidType, LinkLayer, PortInfo};

use crate::transport::error::TransportError;

/// Environment variable naming the mlx5 device to open (`mlx5_0`); the first mlx5 device
/// otherwise.
pub const NIC_DEVICE_ENV: &str = "EP_NIC_DEVICE";
/// Environment variable naming the device port (1-based); 1 otherwise.
pub const NIC_PORT_ENV: &str = "EP_NIC_PORT";
/// Environment variable naming the GID table index to send from on RoCE; the preferred RoCE v2
/// GID otherwise (IPv4-mapped first). Ignored on InfiniBand, which is addressed by LID.
pub const NIC_GID_INDEX_ENV: &str = "EP_NIC_GID_INDEX";

/// A real mlx5 device, the port its QPs use, and (RoCE) the GID index they send from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RealNicSpec {
    /// Device name, as `ibv_get_device_list` lists it.
    pub device: String,
    /// Port, 1-based.
    pub port: u8,
    /// GID table index on RoCE; `None` picks the preferred RoCE v2 GID.
    pub gid_index: Option<u32>,
}

impl RealNicSpec {
    /// `device` on port 1 with the preferred GID.
    pub fn new(device: impl Into<String>) -> Self {
        Self {
            device: device.into(),
            port: 1,
            gid_index: None,
        }
    }

    /// `device` (or [`NIC_DEVICE_ENV`] when set) with [`NIC_PORT_ENV`] and
    /// [`NIC_GID_INDEX_ENV`] applied.
    pub fn from_env(device: &str) -> Result<Self, TransportError> {
        let var = |name: &str| {
            std::env::var(name)
                .ok()
                .map(|v| v.trim().to_string())
                .filter(|v| !v.is_empty())
        };
        Self::from_vars(
            device,
            var(NIC_DEVICE_ENV).as_deref(),
            var(NIC_PORT_ENV).as_deref(),
            var(NIC_GID_INDEX_ENV).as_deref(),
        )
    }

    /// As [`from_env`](Self::from_env), from the variables' values.
    pub fn from_vars(
        device: &str,
        device_var: Option<&str>,
        port_var: Option<&str>,
        gid_var: Option<&str>,
    ) -> Result<Self, TransportError> {
        let mut spec = Self::new(device_var.unwrap_or(device));
        if let Some(p) = port_var {
            spec.port = p.parse().ok().filter(|&p| p >= 1).ok_or_else(|| {
                TransportError::Config(format!("{NIC_PORT_ENV}={p:?}: expected a port 1..=255"))
            })?;
        }
        if let Some(g) = gid_var {
            spec.gid_index = Some(g.parse().map_err(|_| {
                TransportError::Config(format!(
                    "{NIC_GID_INDEX_ENV}={g:?}: expected a GID table index"
                ))
            })?);
        }
        Ok(spec)
    }
}

/// This port's address, by its link layer: what peers put in their RTR address path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LocalAddress {
    /// InfiniBand: the port's LID (assigned by the subnet manager; no GRH).
    InfiniBand {
        /// The LID.
        lid: u16,
    },
    /// RoCE (Ethernet): a GID of the port's table, sent with a GRH.
    Roce {
        /// The GID entry (its index is the `sgid_index`).
        gid: GidEntry,
    },
}

impl LocalAddress {
    /// The address of `port`: its LID on InfiniBand; on Ethernet the GID at `gid_index` when
    /// given (it must be a RoCE GID of the table), else the preferred RoCE v2 GID of `gids`.
    pub fn choose(
        port: &PortInfo,
        gids: &[GidEntry],
        gid_index: Option<u32>,
    ) -> Result<Self, String> {
        match port.link_layer {
            LinkLayer::Ethernet => {
                let gid = match gid_index {
                    Some(i) => *gids.iter().find(|g| g.index == i).ok_or_else(|| {
                        format!(
                            "port {} is RoCE and its GID table has no entry {i} \
                             ({NIC_GID_INDEX_ENV}); entries: {:?}",
                            port.port,
                            gids.iter().map(|g| g.index).collect::<Vec<_>>()
                        )
                    })?,
                    None => *preferred_roce_gid(gids).ok_or_else(|| {
                        format!(
                            "port {} is Ethernet (RoCE) but has no GID: configure an IP \
                             address on its network interface",
                            port.port
                        )
                    })?,
                };
                // An old kernel reports no type (Unknown): taken as the table says.
                if gid.kind == GidType::Ib {
                    return Err(format!(
                        "port {}: GID index {} is not a RoCE GID ({:?})",
                        port.port, gid.index, gid.kind
                    ));
                }
                Ok(Self::Roce { gid })
            }
            _ => {
                if port.lid == 0 {
                    return Err(format!(
                        "port {} is InfiniBand and has no LID: is a subnet manager (opensm) \
                         running on the fabric?",
                        port.port
                    ));
                }
                Ok(Self::InfiniBand { lid: port.lid })
            }
        }
    }

    /// The link this address is on.
    pub fn link(&self) -> LinkKind {
        match self {
            Self::InfiniBand { .. } => LinkKind::InfiniBand,
            Self::Roce { .. } => LinkKind::Roce,
        }
    }

    /// The GID entry on RoCE (what `RtrAttrs::for_port` takes), `None` on InfiniBand.
    pub fn gid(&self) -> Option<&GidEntry> {
        match self {
            Self::Roce { gid } => Some(gid),
            Self::InfiniBand { .. } => None,
        }
    }
}

/// The link layer a connection runs over, as the wire says it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinkKind {
    /// InfiniBand, addressed by LID.
    InfiniBand = 1,
    /// RoCE, addressed by GID.
    Roce = 2,
}

/// Memory a peer may write into: its address, length and remote key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RemoteWindow {
    /// First byte, as work requests name it.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// The remote key.
    pub rkey: u32,
}

/// What one verbs QP tells its peer through the bootstrap.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VerbsConnInfo {
    /// QPN, first PSN, LID (InfiniBand) and GID (RoCE).
    pub qp: ConnectInfo,
    /// The link the sender's port is on (both ends must agree).
    pub link: LinkKind,
    /// The sender's active MTU (`enum ibv_mtu` code); the path uses the smaller of the two.
    pub mtu: Mtu,
    /// The memory the sender's peers may write, when it registered some before this info.
    pub window: Option<RemoteWindow>,
}

impl VerbsConnInfo {
    /// Size of the wire form.
    pub const WIRE_LEN: usize = 64;
    const MAGIC: [u8; 4] = *b"EPV1";

    /// The wire form: `"EPV1"`, link, MTU code, flags (bit 0: a window follows), a zero byte,
    /// the 32-byte [`ConnectInfo`], then the window's address and length (big-endian u64),
    /// rkey (big-endian u32) and 4 zero bytes.
    pub fn to_bytes(&self) -> [u8; Self::WIRE_LEN] {
        let mut b = [0u8; Self::WIRE_LEN];
        b[0..4].copy_from_slice(&Self::MAGIC);
        b[4] = self.link as u8;
        b[5] = self.mtu as u8;
        b[6] = u8::from(self.window.is_some());
        b[8..40].copy_from_slice(&self.qp.to_bytes());
        if let Some(w) = self.window {
            b[40..48].copy_from_slice(&w.addr.to_be_bytes());
            b[48..56].copy_from_slice(&w.len.to_be_bytes());
            b[56..60].copy_from_slice(&w.rkey.to_be_bytes());
        }
        b
    }

    /// Parses the wire form; what is wrong with it, in words.
    pub fn from_bytes(b: &[u8]) -> Result<Self, String> {
        if b.len() != Self::WIRE_LEN {
            return Err(format!(
                "{} bytes, a verbs connection record has {}",
                b.len(),
                Self::WIRE_LEN
            ));
        }
        if b[0..4] != Self::MAGIC {
            return Err("not a verbs connection record (wrong magic)".into());
        }
        let link = match b[4] {
            1 => LinkKind::InfiniBand,
            2 => LinkKind::Roce,
            l => return Err(format!("unknown link layer {l}")),
        };
        let mtu =
            Mtu::from_code(u32::from(b[5])).ok_or_else(|| format!("bad MTU code {}", b[5]))?;
        if b[6] > 1 {
            return Err(format!("unknown flags {:#x}", b[6]));
        }
        let qp = ConnectInfo::from_bytes(&b[8..40]).map_err(|e| e.to_string())?;
        let u64_at = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[i..i + 8]);
            u64::from_be_bytes(w)
        };
        let window = (b[6] == 1).then(|| RemoteWindow {
            addr: u64_at(40),
            len: u64_at(48),
            rkey: u32::from_be_bytes([b[56], b[57], b[58], b[59]]),
        });
        Ok(Self {
            qp,
            link,
            mtu,
            window,
        })
    }

    /// Checks that a QP on `local` can reach the sender: the same link layer, and the address
    /// that link needs (a LID on InfiniBand, a GID on RoCE).
    pub fn reachable_from(&self, local: &LocalAddress) -> Result<(), String> {
        if self.link != local.link() {
            return Err(format!(
                "the peer's port is {:?} and this rank's is {:?}: both ends of an RC connection \
                 must be on the same link layer (set {NIC_DEVICE_ENV}/{NIC_PORT_ENV})",
                self.link,
                local.link()
            ));
        }
        match self.link {
            LinkKind::InfiniBand if self.qp.lid == 0 => Err("the peer sent LID 0".into()),
            LinkKind::Roce if self.qp.gid == [0; 16] => Err("the peer sent a zero GID".into()),
            _ => Ok(()),
        }
    }
}

/// The path MTU of a connection: the smaller of the two ports' active MTUs.
pub fn path_mtu(local: Mtu, remote: Mtu) -> Mtu {
    local.min(remote)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ibgda_verbs::PortState;

    fn port(link: LinkLayer, lid: u16) -> PortInfo {
        PortInfo {
            port: 1,
            state: PortState::Active,
            link_layer: link,
            lid,
            sm_lid: 1,
            active_mtu: 5,
            max_mtu: 5,
            gid_tbl_len: 8,
            pkey_tbl_len: 1,
            active_width: 0,
            active_speed: 0,
            phys_state: 5,
        }
    }

    fn gid(index: u32, kind: GidType, last: u8, v4: bool) -> GidEntry {
        let mut g = [0u8; 16];
        if v4 {
            g[10] = 0xff;
            g[11] = 0xff;
            g[12..16].copy_from_slice(&[10, 0, 0, last]);
        } else {
            g[0] = 0xfe;
            g[1] = 0x80;
            g[15] = last;
        }
        GidEntry {
            index,
            gid: g,
            kind,
        }
    }

    #[test]
    fn infiniband_ports_are_addressed_by_lid_and_roce_ports_by_gid() {
        let gids = [
            gid(0, GidType::RoceV1, 1, false),
            gid(1, GidType::RoceV2, 1, false),
            gid(2, GidType::RoceV1, 2, true),
            gid(3, GidType::RoceV2, 2, true),
        ];
        // InfiniBand: the LID; a GID index given for RoCE is ignored.
        let ib = LocalAddress::choose(&port(LinkLayer::InfiniBand, 7), &gids, Some(1)).unwrap();
        assert_eq!(ib, LocalAddress::InfiniBand { lid: 7 });
        assert_eq!((ib.link(), ib.gid()), (LinkKind::InfiniBand, None));
        let no_sm = LocalAddress::choose(&port(LinkLayer::InfiniBand, 0), &[], None).unwrap_err();
        assert!(no_sm.contains("subnet manager"), "{no_sm}");
        // RoCE: the IPv4-mapped RoCE v2 GID by default, or the index asked for.
        let eth = port(LinkLayer::Ethernet, 0);
        let roce = LocalAddress::choose(&eth, &gids, None).unwrap();
        assert_eq!(roce, LocalAddress::Roce { gid: gids[3] });
        assert_eq!(roce.link(), LinkKind::Roce);
        assert_eq!(roce.gid().unwrap().index, 3);
        let asked = LocalAddress::choose(&eth, &gids, Some(1)).unwrap();
        assert_eq!(asked.gid().unwrap().index, 1);
        let missing = LocalAddress::choose(&eth, &gids, Some(9)).unwrap_err();
        assert!(missing.contains(NIC_GID_INDEX_ENV), "{missing}");
        let empty = LocalAddress::choose(&eth, &[], None).unwrap_err();
        assert!(empty.contains("IP address"), "{empty}");
        let ib_gid = [GidEntry {
            kind: GidType::Ib,
            ..gids[1]
        }];
        assert!(LocalAddress::choose(&eth, &ib_gid, Some(1)).is_err());
    }

    fn info(window: Option<RemoteWindow>) -> VerbsConnInfo {
        VerbsConnInfo {
            qp: ConnectInfo {
                qpn: 0xab_cdef,
                psn: 0x12_3456,
                lid: 0,
                gid: gid(3, GidType::RoceV2, 9, true).gid,
            },
            link: LinkKind::Roce,
            mtu: Mtu::Mtu4096,
            window,
        }
    }

    #[test]
    fn connection_info_round_trips_with_gid_mtu_and_window() {
        let w = RemoteWindow {
            addr: 0x7f00_dead_beef_0000,
            len: 1 << 30,
            rkey: 0x1234_5678,
        };
        for c in [info(Some(w)), info(None)] {
            let b = c.to_bytes();
            assert_eq!(&b[0..4], b"EPV1");
            assert_eq!(VerbsConnInfo::from_bytes(&b).unwrap(), c);
            // The GID travels byte for byte, network order.
            assert_eq!(&b[24..40], &c.qp.gid);
            // Never a panic on a short, long or altered record.
            for n in 0..b.len() {
                assert!(VerbsConnInfo::from_bytes(&b[..n]).is_err(), "cut at {n}");
            }
            let mut long = b.to_vec();
            long.push(0);
            assert!(VerbsConnInfo::from_bytes(&long).is_err());
            for (at, v) in [(0, b'X'), (4, 9), (5, 0), (5, 6), (6, 2), (8, b'X')] {
                let mut bad = b;
                bad[at] = v;
                assert!(VerbsConnInfo::from_bytes(&bad).is_err(), "byte {at} = {v}");
            }
        }
        assert_eq!(info(Some(w)).to_bytes()[40..48], w.addr.to_be_bytes());
    }

    #[test]
    fn a_peer_on_another_link_layer_or_without_an_address_is_refused() {
        let roce = LocalAddress::Roce {
            gid: gid(3, GidType::RoceV2, 1, true),
        };
        let ib = LocalAddress::InfiniBand { lid: 3 };
        let c = info(None);
        assert!(c.reachable_from(&roce).is_ok());
        assert!(c.reachable_from(&ib).unwrap_err().contains("link layer"));
        let zero = VerbsConnInfo {
            qp: ConnectInfo {
                gid: [0; 16],
                ..c.qp
            },
            ..c
        };
        assert!(zero.reachable_from(&roce).is_err());
        let ib_peer = VerbsConnInfo {
            link: LinkKind::InfiniBand,
            qp: ConnectInfo { lid: 0, ..c.qp },
            ..c
        };
        assert!(ib_peer.reachable_from(&ib).unwrap_err().contains("LID 0"));
        assert_eq!(path_mtu(Mtu::Mtu4096, Mtu::Mtu1024), Mtu::Mtu1024);
    }

    #[test]
    fn the_rtr_path_follows_the_link_layer_and_takes_the_smaller_mtu() {
        use crate::transport::verbs::transport::rtr_attrs;
        use ibgda_verbs::PathKind;
        // InfiniBand: by LID, no GRH; the peer's 1 KiB MTU wins over the port's 4 KiB.
        let ib_port = port(LinkLayer::InfiniBand, 7);
        let ib = LocalAddress::choose(&ib_port, &[], None).unwrap();
        let peer = VerbsConnInfo {
            qp: ConnectInfo {
                lid: 9,
                gid: [0; 16],
                ..info(None).qp
            },
            link: LinkKind::InfiniBand,
            mtu: Mtu::Mtu1024,
            window: None,
        };
        let a = rtr_attrs(&ib_port, &ib, &peer).unwrap();
        assert!(matches!(a.path, PathKind::InfiniBand { .. }), "{a:?}");
        assert_eq!(a.mtu, Mtu::Mtu1024);
        // RoCE: by GID from the chosen index, with a GRH.
        let eth = port(LinkLayer::Ethernet, 0);
        let gids = [gid(5, GidType::RoceV2, 4, true)];
        let roce = LocalAddress::choose(&eth, &gids, None).unwrap();
        let a = rtr_attrs(&eth, &roce, &info(None)).unwrap();
        assert!(
            matches!(a.path, PathKind::Roce { sgid_index: 5, .. }),
            "{a:?}"
        );
        assert_eq!(a.mtu, Mtu::Mtu4096);
        // Across link layers: refused before any firmware command.
        let e = rtr_attrs(&eth, &roce, &peer).unwrap_err().to_string();
        assert!(e.contains("link layer"), "{e}");
    }

    #[test]
    fn the_env_overrides_device_port_and_gid_index() {
        let s = RealNicSpec::from_vars("mlx5_0", None, None, None).unwrap();
        assert_eq!(s, RealNicSpec::new("mlx5_0"));
        let s = RealNicSpec::from_vars("mlx5_0", Some("mlx5_3"), Some("2"), Some("5")).unwrap();
        assert_eq!(
            s,
            RealNicSpec {
                device: "mlx5_3".into(),
                port: 2,
                gid_index: Some(5)
            }
        );
        for bad_port in ["0", "x", "256"] {
            let e = RealNicSpec::from_vars("d", None, Some(bad_port), None).unwrap_err();
            assert!(e.to_string().contains(NIC_PORT_ENV), "{e}");
        }
        let e = RealNicSpec::from_vars("d", None, None, Some("-1")).unwrap_err();
        assert!(e.to_string().contains(NIC_GID_INDEX_ENV), "{e}");
    }
}
