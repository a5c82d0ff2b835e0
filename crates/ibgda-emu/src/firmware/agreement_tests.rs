//! `ibgda-verbs`' command builders and this crate's decoders, written separately from the same
//! PRM layout, agree on every field over random values: an offset wrong on either side shows
//! up as a field that does not come back.

use ibgda_verbs::prm::{
    AddressPath, AtomicMode, CreateCq, CreateQp, Init2Rtr, Mtu, RemoteAccess, RqSpec, Rst2Init,
    Rtr2Rts, TsFormat, UmemRef,
};
use proptest::prelude::*;

use super::cq_command::CreateCqImage;
use super::qp_command::CreateQpImage;
use super::qp_transition::{Init2RtrImage, Rst2InitImage, Rtr2RtsImage};

fn u24() -> impl Strategy<Value = u32> {
    0u32..(1 << 24)
}

proptest! {
    #[test]
    fn create_cq_fields_come_back(
        log in 0u8..32, uar in u24(), eqn in any::<u32>(), ring_id in any::<u32>(),
        ring_off in any::<u64>(), dbr_id in any::<u32>(), dbr_off in any::<u64>(),
        log_page in 0u8..32, cc in any::<bool>(), oi in any::<bool>(),
    ) {
        let img = CreateCq::new(log, uar, eqn, UmemRef::new(ring_id, ring_off), UmemRef::new(dbr_id, dbr_off))
            .collapsed(cc)
            .overrun_ignore(oi)
            .log_page_size(log_page)
            .build()
            .unwrap();
        let d = CreateCqImage::decode(&img);
        prop_assert_eq!(d, CreateCqImage {
            cqe_sz: 0,
            collapsed: cc,
            overrun_ignore: oi,
            log_cq_size: log,
            uar_page: uar,
            c_eqn: eqn,
            log_page_size: log_page,
            page_offset: 0,
            dbr_umem_valid: true,
            dbr_umem_id: dbr_id,
            dbr_offset: dbr_off,
            cq_umem_valid: true,
            cq_umem_id: ring_id,
            cq_umem_offset: ring_off,
        });
    }

    #[test]
    fn create_qp_fields_come_back(
        pd in u24(), uar in u24(), scq in u24(), rcq in u24(), log_sq in 0u8..16,
        wq_id in any::<u32>(), wq_off in any::<u64>(), dbr_id in any::<u32>(), dbr_off in any::<u64>(),
        rq in proptest::option::of((0u8..16, 4u8..11)), log_page in 0u8..32, ts in 0u8..3,
        user_index in u24(),
    ) {
        let spec = match rq {
            None => RqSpec::None,
            Some((log_wqe_count, log_stride)) => RqSpec::Ring { log_wqe_count, log_stride },
        };
        let ts_format = [TsFormat::FreeRunning, TsFormat::Default, TsFormat::RealTime][ts as usize];
        let img = CreateQp::new(pd, uar, scq, rcq, log_sq, UmemRef::new(wq_id, wq_off), UmemRef::new(dbr_id, dbr_off))
            .rq(spec)
            .log_page_size(log_page)
            .ts_format(ts_format)
            .user_index(user_index)
            .build()
            .unwrap();
        let d = CreateQpImage::decode(&img);
        let (rq_type, log_rq_size, log_rq_stride) = match rq {
            None => (3, 0, 0),
            Some((n, s)) => (0, n, s - 4),
        };
        prop_assert_eq!(d, CreateQpImage {
            st: 0,
            pd,
            log_rq_size,
            log_rq_stride,
            no_sq: false,
            log_sq_size: log_sq,
            ts_format: ts,
            uar_page: uar,
            user_index,
            log_page_size: log_page,
            cqn_snd: scq,
            cqn_rcv: rcq,
            page_offset: 0,
            rq_type,
            dbr_umem_valid: true,
            dbr_umem_id: dbr_id,
            dbr_offset: dbr_off,
            wq_umem_valid: true,
            wq_umem_id: wq_id,
            wq_offset: wq_off,
        });
    }

    #[test]
    fn transition_fields_come_back(
        qpn in u24(), port in any::<u8>(), pkey in any::<u16>(), read in any::<bool>(),
        write in any::<bool>(), atomic in proptest::option::of(0usize..3), remote in u24(),
        rcv_psn in u24(), snd_psn in u24(), mtu in 1u32..6, rlid in any::<u16>(),
        log_msg in 0u8..32, rnr_nak in 0u8..32, rra in 0u8..8, sra in 0u8..8,
        ack in 0u8..32, retry in 0u8..8, rnr_retry in 0u8..8,
    ) {
        let mode = atomic.map(|i| [AtomicMode::IbSpec, AtomicMode::Only8Bytes, AtomicMode::UpTo8Bytes][i]);
        let access = RemoteAccess { read, write, atomic: mode };
        let img = Rst2Init::new(qpn, port, access).pkey_index(pkey).build().unwrap();
        prop_assert_eq!(super::bits::get(&img, super::layout::cmd_in::OBJ_NUM) as u32, qpn);
        prop_assert_eq!(Rst2InitImage::decode(&img), Rst2InitImage {
            port,
            pkey_index: pkey,
            rre: read,
            rwe: write,
            rae: mode.is_some(),
            atomic_mode: mode.map_or(0, |m| m as u8),
        });

        let mtu = Mtu::from_code(mtu).unwrap();
        let path = AddressPath { pkey_index: pkey, ..AddressPath::infiniband(port, rlid) };
        let img = Init2Rtr::new(qpn, remote, rcv_psn, mtu, path)
            .log_msg_max(log_msg)
            .min_rnr_nak(rnr_nak)
            .log_rra_max(rra)
            .build()
            .unwrap();
        prop_assert_eq!(Init2RtrImage::decode(&img), Init2RtrImage {
            mtu: mtu as u8,
            log_msg_max: log_msg,
            remote_qpn: remote,
            next_rcv_psn: rcv_psn,
            min_rnr_nak: rnr_nak,
            log_rra_max: rra,
            port,
            pkey_index: pkey,
            rlid,
            grh: false,
            rgid: [0; 16],
        });

        let img = Rtr2Rts::new(qpn, snd_psn)
            .ack_timeout(ack)
            .retry_count(retry)
            .rnr_retry(rnr_retry)
            .log_sra_max(sra)
            .build()
            .unwrap();
        prop_assert_eq!(Rtr2RtsImage::decode(&img), Rtr2RtsImage {
            next_send_psn: snd_psn,
            log_sra_max: sra,
            retry_count: retry,
            rnr_retry,
            ack_timeout: ack,
        });
    }
}
