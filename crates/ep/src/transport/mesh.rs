//! Connecting a rank's QPs to every peer through the bootstrap ([`connect_mesh`]), whatever the
//! NIC ([`RankTransport`]) and whether the ranks are threads of one process or processes.
//!
//! For every peer, a rank makes responder QPs on its NIC ([`RankTransport::respond`]) and sends
//! their connection info; each rank then connects its QPs to the peers' responders
//! ([`RankTransport::connect`]) and sends its QPs' info back, which the responders accept; a
//! last all-gather says every rank's responders are ready. Every exchange carries a rank's
//! failure, so every rank fails at once, naming the rank, rather than at a timeout.
//!
//! An exchange's record, as the u64 words [`Exchange::all_gather`] moves: `[TAG, 1]`, then for
//! every destination rank the number of infos and each info as its byte length and its bytes
//! (little-endian, zero-padded to whole words); or `[TAG, 0, length, text]` for a failure.

use super::backend::{ConnInfo, QpSet, RankTransport, Registration, Responder};
use super::emulated::QpGroupConfig;
use super::error::TransportError;
use crate::error::EpError;
use crate::rendezvous::Exchange;

/// First word of every record ("LLQPINF1").
const TAG: u64 = u64::from_le_bytes(*b"LLQPINF1");

/// Per destination rank, the byte records a rank sends it.
type Posted = Vec<Vec<Vec<u8>>>;

/// A rank's QPs to every peer: per rank, this rank's QP set to it and the responders answering
/// that rank's set (`None` for this rank).
#[derive(Debug)]
pub struct Mesh {
    /// Per rank, this rank's QPs to it.
    pub sets: Vec<Option<Box<dyn QpSet>>>,
    /// Per rank, the responder QPs on this rank's NIC that its QPs are connected to.
    pub responders: Vec<Option<Box<dyn Responder>>>,
}

impl Mesh {
    /// The first failure device code recorded on this rank's QPs (rank `prefer`'s first).
    pub fn first_failure(&self, prefer: Option<usize>) -> Option<(usize, TransportError)> {
        let check = |r: usize| {
            self.sets
                .get(r)
                .and_then(|g| g.as_ref())
                .and_then(|g| g.check().err())
                .map(|e| (r, e))
        };
        prefer
            .and_then(check)
            .or_else(|| (0..self.sets.len()).find_map(check))
    }

    /// Stops the proxies and destroys this rank's QPs, then the responders; the first error,
    /// with the rank its QPs led to.
    pub fn close(self) -> Result<(), (usize, TransportError)> {
        let mut first = None;
        for (r, g) in self.sets.into_iter().enumerate() {
            if let Some(Err(e)) = g.map(|g| g.shutdown()) {
                first.get_or_insert((r, e));
            }
        }
        for (r, p) in self.responders.into_iter().enumerate() {
            if let Some(Err(e)) = p.map(|p| p.close()) {
                first.get_or_insert((r, e));
            }
        }
        first.map_or(Ok(()), Err)
    }
}

fn push_bytes(w: &mut Vec<u64>, b: &[u8]) {
    w.push(b.len() as u64);
    w.extend(b.chunks(8).map(|c| {
        let mut word = [0u8; 8];
        word[..c.len()].copy_from_slice(c);
        u64::from_le_bytes(word)
    }));
}

/// One rank's record: its infos per destination rank, or why it has none.
fn encode(p: &Result<Posted, String>) -> Vec<u64> {
    let mut w = vec![TAG];
    match p {
        Ok(dests) => {
            w.push(1);
            for infos in dests {
                w.push(infos.len() as u64);
                for b in infos {
                    push_bytes(&mut w, b);
                }
            }
        }
        Err(why) => {
            w.push(0);
            push_bytes(&mut w, why.as_bytes());
        }
    }
    w
}

struct Cursor<'a> {
    w: &'a [u64],
    at: usize,
}

impl Cursor<'_> {
    fn left(&self) -> usize {
        self.w.len() - self.at
    }

    fn word(&mut self, what: &str) -> Result<u64, String> {
        let v = *self
            .w
            .get(self.at)
            .ok_or_else(|| format!("record ends before {what} (word {})", self.at))?;
        self.at += 1;
        Ok(v)
    }

    fn bytes(&mut self, what: &str) -> Result<Vec<u8>, String> {
        let len = self.word(what)?;
        let words = len.div_ceil(8);
        if words > self.left() as u64 {
            return Err(format!(
                "{what}: {len} bytes announced, {} words left in the record",
                self.left()
            ));
        }
        let words = words as usize;
        let mut b: Vec<u8> = self.w[self.at..self.at + words]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        b.truncate(len as usize);
        self.at += words;
        Ok(b)
    }
}

/// Parses a record of a group of `ranks`: `Err` when it is malformed, `Ok(Err(why))` when the
/// rank reported a failure.
fn decode(w: &[u64], ranks: usize) -> Result<Result<Posted, String>, String> {
    let mut c = Cursor { w, at: 0 };
    if c.word("the tag")? != TAG {
        return Err("not a QP-info record (wrong tag)".into());
    }
    match c.word("the status")? {
        1 => {
            let mut dests = Vec::with_capacity(ranks);
            for d in 0..ranks {
                let n = c.word(&format!("the info count for rank {d}"))?;
                // Every info takes at least its length word.
                if n > c.left() as u64 {
                    return Err(format!(
                        "{n} infos for rank {d}, {} words left in the record",
                        c.left()
                    ));
                }
                let infos = (0..n)
                    .map(|i| c.bytes(&format!("info {i} for rank {d}")))
                    .collect::<Result<Vec<_>, _>>()?;
                dests.push(infos);
            }
            if c.left() != 0 {
                return Err(format!("{} words after the last rank's infos", c.left()));
            }
            Ok(Ok(dests))
        }
        0 => {
            let why = c.bytes("the failure text")?;
            if c.left() != 0 {
                return Err(format!("{} words after the failure text", c.left()));
            }
            Ok(Err(String::from_utf8_lossy(&why).into_owned()))
        }
        s => Err(format!("unknown status {s}")),
    }
}

/// All-gathers this rank's `posted` infos (or its failure) and returns, per peer, the infos that
/// peer sent this rank, parsed, `nqps` of them. Any rank's failure, or a malformed record, fails
/// every rank: this rank's own failure as it happened, another's as [`EpError::Rendezvous`]
/// naming that rank.
fn exchange(
    group: &dyn Exchange,
    step: &str,
    posted: Result<Posted, EpError>,
    nqps: u32,
    peers: &dyn Fn(usize) -> bool,
) -> Result<Vec<Vec<ConnInfo>>, EpError> {
    let (rank, ranks) = (group.rank(), group.ranks());
    let sent: Result<Posted, String> = posted.as_ref().cloned().map_err(ToString::to_string);
    let all = group.all_gather(&encode(&sent))?;
    posted?;
    let bad = |what: String| EpError::Rendezvous { rank, what };
    if all.len() != ranks {
        return Err(bad(format!(
            "{step}: {} records for {ranks} ranks",
            all.len()
        )));
    }
    let mut from = Vec::with_capacity(ranks);
    for (r, words) in all.iter().enumerate() {
        let dests = match decode(words, ranks) {
            Err(why) => {
                return Err(bad(format!(
                    "{step}: rank {r}'s record is malformed: {why}"
                )))
            }
            Ok(Err(why)) => return Err(bad(format!("{step}: rank {r} failed: {why}"))),
            Ok(Ok(d)) => d,
        };
        let mine = &dests[rank];
        let want = if r == rank || !peers(r) {
            0
        } else {
            nqps as usize
        };
        if mine.len() != want {
            return Err(bad(format!(
                "{step}: rank {r} sent {} QP infos to this rank, expected {want}",
                mine.len()
            )));
        }
        let infos = mine.iter().cloned().map(ConnInfo).collect();
        from.push(infos);
    }
    Ok(from)
}

/// This rank's QPs to every peer (see the module docs): per rank, this rank's QP set to it and
/// the responders its set writes through (`None` for this rank). `cfg(r)` configures the QPs to
/// rank `r`; `local` is this rank's registered memory, registered on `nic` before this is
/// called (connection info may carry it). Three collectives of `group`; on return every rank's
/// responders have accepted, so any rank may post. `err(doing, e)` turns a transport failure
/// into the caller's error.
pub fn connect_mesh(
    nic: &dyn RankTransport,
    group: &dyn Exchange,
    local: &dyn Registration,
    nqps: u32,
    cfg: impl Fn(usize) -> QpGroupConfig,
    err: impl Fn(&str, TransportError) -> EpError,
) -> Result<Mesh, EpError> {
    connect_mesh_among(nic, group, local, nqps, &|_| true, cfg, err)
}

/// As [`connect_mesh`], with QPs only to the peers `peers(r)` names (`None` in
/// [`Mesh::sets`] for the others). `peers` must be symmetric (rank r names s exactly when s
/// names r; a mismatch fails every rank with the counts that disagree): internode connects
/// each rank to its rail peers only, so that no QP, proxy thread or GDR mirror exists for a
/// peer it reaches over NVLink. With 8 ranks on one GPU in mode `cpu`, the full mesh ran 56
/// proxy threads and 56 mirror pumps for the 8 rail QP groups used (an H200 run on
/// 2026-12-02 hung on the CUDA driver's lock).
pub fn connect_mesh_among(
    nic: &dyn RankTransport,
    group: &dyn Exchange,
    local: &dyn Registration,
    nqps: u32,
    peers: &dyn Fn(usize) -> bool,
    cfg: impl Fn(usize) -> QpGroupConfig,
    err: impl Fn(&str, TransportError) -> EpError,
) -> Result<Mesh, EpError> {
    let (rank, ranks) = (group.rank(), group.ranks());
    // 1. Responder QPs for every peer; their infos to that peer.
    let mut responders: Vec<Option<Box<dyn Responder>>> = (0..ranks).map(|_| None).collect();
    let mut posted: Posted = vec![Vec::new(); ranks];
    let made = (0..ranks)
        .filter(|&r| r != rank && peers(r))
        .try_for_each(|r| {
            let (infos, p) = nic
                .respond(r as u32, nqps)
                .map_err(|e| err(&format!("responder QPs for rank {r}"), e))?;
            posted[r] = infos.into_iter().map(|c| c.0).collect();
            responders[r] = Some(p);
            Ok(())
        });
    let remote = exchange(
        group,
        "responder QP infos",
        made.map(|()| posted),
        nqps,
        peers,
    )?;

    // 2. This rank's QPs, connected to the peers' responders; their infos back.
    let mut sets: Vec<Option<Box<dyn QpSet>>> = (0..ranks).map(|_| None).collect();
    let mut posted: Posted = vec![Vec::new(); ranks];
    let built = (0..ranks)
        .filter(|&r| r != rank && peers(r))
        .try_for_each(|r| {
            let doing = format!("connecting QPs to rank {r}");
            let g = nic
                .connect(&remote[r], local, &cfg(r))
                .map_err(|e| err(&doing, e))?;
            let infos = g.conn_infos().map_err(|e| err(&doing, e))?;
            posted[r] = infos.into_iter().map(|c| c.0).collect();
            sets[r] = Some(g);
            Ok(())
        });
    let initiators = exchange(group, "QP infos", built.map(|()| posted), nqps, peers)?;

    // 3. The responders accept the peers' QPs; then every rank says whether it could, so no
    // rank posts to a responder that is not ready yet (a real NIC would drop the packets and
    // retry), and a failure fails every rank at once.
    let accepted = responders
        .iter()
        .enumerate()
        .try_for_each(|(r, p)| match p {
            Some(p) => p
                .accept(&initiators[r])
                .map_err(|e| err(&format!("accepting the QPs of rank {r}"), e)),
            None => Ok(()),
        });
    let all = group.all_gather(&[u64::from(accepted.is_ok())])?;
    accepted?;
    if let Some(r) = all.iter().position(|v| v.first() != Some(&1)) {
        return Err(EpError::Rendezvous {
            rank,
            what: format!("rank {r} failed to accept this rank's QPs"),
        });
    }
    Ok(Mesh { sets, responders })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn posted() -> Posted {
        vec![
            vec![],
            vec![vec![1, 2, 3], vec![], (0..17).collect()],
            vec![(0..8).collect()],
        ]
    }

    #[test]
    fn records_round_trip() {
        let p = posted();
        assert_eq!(decode(&encode(&Ok(p.clone())), 3), Ok(Ok(p)));
        let e = Err("no passive QPs: out of memory".to_string());
        assert_eq!(decode(&encode(&e), 3), Ok(e));
    }

    #[test]
    fn malformed_records_are_refused() {
        let w = encode(&Ok(posted()));
        // Cut anywhere: never a panic, always an error.
        for n in 0..w.len() {
            assert!(decode(&w[..n], 3).is_err(), "cut at {n}");
        }
        let mut long = w.clone();
        long.push(0);
        assert!(decode(&long, 3).unwrap_err().contains("after the last"));
        // Fewer ranks than the record holds: trailing words.
        assert!(decode(&w, 2).is_err());
        let mut tag = w.clone();
        tag[0] ^= 1;
        assert!(decode(&tag, 3).unwrap_err().contains("tag"));
        let mut status = w.clone();
        status[1] = 7;
        assert!(decode(&status, 3).unwrap_err().contains("status"));
        // A count or a length beyond the record.
        let mut count = w.clone();
        count[2] = u64::MAX;
        assert!(decode(&count, 3).unwrap_err().contains("infos for rank 0"));
        let mut len = w.clone();
        len[4] = u64::MAX;
        assert!(decode(&len, 3).unwrap_err().contains("bytes announced"));
    }
}
