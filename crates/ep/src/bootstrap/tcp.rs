//! Ranks as processes: a star over TCP through rank 0.
//!
//! Rendezvous: rank 0 listens; every other rank connects (retrying until rank 0 is up) and sends
//! a hello with the job token, its rank and the world size. Rank 0 turns away processes with
//! another token (and keeps waiting for the real ranks), fails the job on a world-size mismatch,
//! an impossible or duplicate rank, and welcomes everyone once all ranks have joined.
//!
//! Collectives: each rank sends its part to rank 0, which gathers them in rank order and sends the
//! whole back. Messages carry the collective's sequence number and kind, so ranks that call
//! different collectives are caught. When rank 0 fails a collective it tells every rank why
//! before returning, so the whole job fails with the root cause rather than a cascade of timeouts.

use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::wire::{self, Msg, Op, Pending, RejectCode, WireError};
use super::{BootstrapError, Communicator, JobToken, RankConfig};

/// How long rank 0 waits for the hello of a connection it accepted: the real ranks send it at
/// once, so a connection that stays silent is a stranger and must not stall the rendezvous.
const HELLO_TIMEOUT: Duration = Duration::from_secs(5);

/// Sleep between polls of the listening socket (std has no accept with a timeout).
const ACCEPT_POLL: Duration = Duration::from_millis(2);

/// Longest sleep between attempts to reach rank 0.
const MAX_CONNECT_BACKOFF: Duration = Duration::from_millis(200);

/// How long rank 0 spends telling the ranks that the group failed.
const ABORT_NOTICE: Duration = Duration::from_secs(1);

/// Extra time the other ranks wait on rank 0, beyond the step's bound, to hear rank 0's verdict
/// (which names the missing ranks) instead of timing out on their own with less to say.
fn grace(timeout: Duration) -> Duration {
    (timeout / 2).min(Duration::from_secs(2))
}

/// A rank of a job whose ranks are processes, talking over TCP (see the module docs).
///
/// ```no_run
/// use ep::bootstrap::{Communicator, TcpCommunicator};
///
/// // RANK, WORLD_SIZE, MASTER_PORT, EP_JOB_TOKEN… set by a launcher.
/// let comm = TcpCommunicator::from_env()?;
/// let ranks = comm.all_gather_bytes(&(comm.rank() as u32).to_le_bytes())?;
/// assert_eq!(ranks.len(), comm.world_size());
/// # Ok::<(), ep::bootstrap::BootstrapError>(())
/// ```
#[derive(Debug)]
pub struct TcpCommunicator {
    rank: usize,
    world_size: usize,
    local_rank: usize,
    timeout: Duration,
    inner: Mutex<Inner>,
}

#[derive(Debug)]
struct Inner {
    /// The number of the next collective.
    seq: u64,
    /// Why the group failed, once it has.
    failed: Option<String>,
    role: Role,
}

#[derive(Debug)]
enum Role {
    /// A job of one rank: nothing to talk to.
    Alone,
    /// Rank 0: one stream per other rank, in rank order.
    Root(Vec<Peer>),
    /// Any other rank: the stream to rank 0.
    Member(Peer),
}

#[derive(Debug)]
struct Peer {
    rank: usize,
    stream: TcpStream,
    addr: SocketAddr,
}

impl Peer {
    fn describe(&self) -> String {
        format!("rank {} at {}", self.rank, self.addr)
    }
}

impl TcpCommunicator {
    /// Joins the job described by `cfg`: rank 0 binds `master_addr:master_port` and waits for the
    /// others; the others connect to it. Returns once every rank has joined, or fails within
    /// `cfg.timeout` (other ranks: plus up to 2 s to hear rank 0's verdict).
    pub fn connect(cfg: &RankConfig) -> Result<Self, BootstrapError> {
        cfg.validate()?;
        if cfg.rank == 0 && cfg.world_size > 1 {
            let addr = resolve(cfg)?;
            let listener = TcpListener::bind(addr).map_err(|source| BootstrapError::Io {
                rank: 0,
                step: "rendezvous: binding the listening socket".into(),
                peer: addr.to_string(),
                source,
            })?;
            return Self::with_listener(cfg, listener);
        }
        let started = Instant::now();
        let role = if cfg.world_size == 1 {
            Role::Alone
        } else {
            Role::Member(join(cfg, started)?)
        };
        Ok(Self::new(cfg, role))
    }

    /// As [`connect`](Self::connect) for rank 0, listening on `listener`, already bound (for
    /// example to port 0, to let the OS pick a free port whose number the other ranks are then
    /// given). `cfg.master_port` is not used.
    pub fn with_listener(cfg: &RankConfig, listener: TcpListener) -> Result<Self, BootstrapError> {
        cfg.validate()?;
        if cfg.rank != 0 {
            return Err(BootstrapError::Config(format!(
                "only rank 0 listens, but this is rank {}",
                cfg.rank
            )));
        }
        let started = Instant::now();
        let role = if cfg.world_size == 1 {
            Role::Alone
        } else {
            Role::Root(accept_all(cfg, &listener, started)?)
        };
        Ok(Self::new(cfg, role))
    }

    /// Joins the job the environment describes ([`RankConfig::from_env`]).
    pub fn from_env() -> Result<Self, BootstrapError> {
        Self::connect(&RankConfig::from_env()?)
    }

    /// The time bound of each collective.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    fn new(cfg: &RankConfig, role: Role) -> Self {
        Self {
            rank: cfg.rank,
            world_size: cfg.world_size,
            local_rank: cfg.local_rank,
            timeout: cfg.timeout,
            inner: Mutex::new(Inner {
                seq: 0,
                failed: None,
                role,
            }),
        }
    }

    fn collective(&self, op: Op, mine: &[u8]) -> Result<Vec<Vec<u8>>, BootstrapError> {
        let mut inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        let seq = inner.seq;
        inner.seq += 1;
        let step = format!("{} #{seq}", op.name());
        if let Some(reason) = &inner.failed {
            return Err(BootstrapError::Aborted {
                rank: self.rank,
                step,
                reason: reason.clone(),
            });
        }
        let started = Instant::now();
        let result = match &mut inner.role {
            Role::Alone => Ok(vec![mine.to_vec()]),
            Role::Root(peers) => self.root_collective(peers, op, seq, &step, mine, started),
            Role::Member(root) => self.member_collective(root, op, seq, &step, mine, started),
        };
        if let Err(e) = &result {
            inner.failed = Some(e.to_string());
        }
        result
    }

    fn root_collective(
        &self,
        peers: &mut [Peer],
        op: Op,
        seq: u64,
        step: &str,
        mine: &[u8],
        started: Instant,
    ) -> Result<Vec<Vec<u8>>, BootstrapError> {
        let deadline = started + self.timeout;
        let mut parts = vec![Vec::new(); self.world_size];
        parts[0] = mine.to_vec();
        for i in 0..peers.len() {
            let peer = &mut peers[i];
            let peer_rank = peer.rank;
            let err = match wire::read_msg(&mut peer.stream, deadline) {
                Ok(Msg::Contrib {
                    seq: s,
                    op: o,
                    data,
                }) if s == seq && o == op => {
                    parts[peer.rank] = data;
                    continue;
                }
                Ok(Msg::Contrib { seq: s, op: o, .. }) => BootstrapError::Protocol {
                    rank: 0,
                    step: step.into(),
                    peer: peer.describe(),
                    detail: format!(
                        "rank {} called {} #{s} where rank 0 called {step}: every rank must call \
                         the same collectives in the same order",
                        peer.rank,
                        o.name()
                    ),
                },
                Ok(other) => BootstrapError::Protocol {
                    rank: 0,
                    step: step.into(),
                    peer: peer.describe(),
                    detail: format!("unexpected message {other:?}"),
                },
                Err(WireError::TimedOut { partial }) => {
                    let mut missing = vec![peer_rank];
                    let mut closed = Vec::new();
                    for p in &peers[i + 1..] {
                        match wire::pending(&p.stream) {
                            Pending::Data => {}
                            Pending::Nothing => missing.push(p.rank),
                            Pending::Closed => closed.push(p.rank),
                        }
                    }
                    let mut detail = format!(
                        "ranks {missing:?} of {} did not send their part to rank 0",
                        self.world_size
                    );
                    if partial {
                        detail += &format!(" (rank {peer_rank} sent part of it)");
                    }
                    if !closed.is_empty() {
                        detail += &format!("; ranks {closed:?} closed their connections");
                    }
                    BootstrapError::Timeout {
                        rank: 0,
                        step: step.into(),
                        waited: started.elapsed(),
                        detail,
                    }
                }
                Err(e) => wire_error(0, step, peer.describe(), e, started),
            };
            abort_all(peers, &err);
            return Err(err);
        }
        let reply = Msg::Gathered {
            seq,
            op,
            parts: if op == Op::Barrier {
                Vec::new()
            } else {
                parts.clone()
            },
        }
        .encode();
        for i in 0..peers.len() {
            let peer = &mut peers[i];
            if let Err(e) = wire::write_frame(&mut peer.stream, &reply, deadline) {
                let err = wire_error(0, step, peer.describe(), e, started);
                abort_all(peers, &err);
                return Err(err);
            }
        }
        Ok(parts)
    }

    fn member_collective(
        &self,
        root: &mut Peer,
        op: Op,
        seq: u64,
        step: &str,
        mine: &[u8],
        started: Instant,
    ) -> Result<Vec<Vec<u8>>, BootstrapError> {
        let deadline = started + self.timeout;
        let contrib = Msg::Contrib {
            seq,
            op,
            data: mine.to_vec(),
        };
        if let Err(e) = wire::write_msg(&mut root.stream, &contrib, deadline) {
            return Err(wire_error(self.rank, step, root.describe(), e, started));
        }
        let root_name = root.describe();
        let describe = || root_name.clone();
        match wire::read_msg(&mut root.stream, deadline + grace(self.timeout)) {
            Ok(Msg::Gathered {
                seq: s,
                op: o,
                parts,
            }) if s == seq && o == op => match op {
                Op::Barrier => Ok(Vec::new()),
                Op::AllGather if parts.len() == self.world_size => Ok(parts),
                Op::AllGather => Err(BootstrapError::Protocol {
                    rank: self.rank,
                    step: step.into(),
                    peer: describe(),
                    detail: format!(
                        "{} parts gathered for a world of {}",
                        parts.len(),
                        self.world_size
                    ),
                }),
            },
            Ok(Msg::Abort { reason }) => Err(BootstrapError::Aborted {
                rank: self.rank,
                step: step.into(),
                reason,
            }),
            Ok(other) => Err(BootstrapError::Protocol {
                rank: self.rank,
                step: step.into(),
                peer: describe(),
                detail: format!("unexpected reply {other:?}"),
            }),
            Err(WireError::TimedOut { .. }) => Err(BootstrapError::Timeout {
                rank: self.rank,
                step: step.into(),
                waited: started.elapsed(),
                detail: format!(
                    "{} did not answer: some rank has not reached {step}, or rank 0 is stuck",
                    describe()
                ),
            }),
            Err(e) => Err(wire_error(self.rank, step, describe(), e, started)),
        }
    }
}

impl Communicator for TcpCommunicator {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn local_rank(&self) -> usize {
        self.local_rank
    }

    fn same_process(&self) -> bool {
        self.world_size == 1
    }

    fn all_gather_bytes(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>, BootstrapError> {
        self.collective(Op::AllGather, mine)
    }

    fn barrier(&self) -> Result<(), BootstrapError> {
        self.collective(Op::Barrier, &[]).map(drop)
    }
}

/// Turns a failed read or write into an error naming `rank`, `step` and `peer`.
fn wire_error(
    rank: usize,
    step: &str,
    peer: String,
    e: WireError,
    started: Instant,
) -> BootstrapError {
    match e {
        WireError::TimedOut { partial } => BootstrapError::Timeout {
            rank,
            step: step.into(),
            waited: started.elapsed(),
            detail: format!(
                "{peer} did not take or send a message in time{}",
                if partial { " (part of it moved)" } else { "" }
            ),
        },
        WireError::Closed => BootstrapError::Disconnected {
            rank,
            step: step.into(),
            peer,
        },
        WireError::Io(source) => BootstrapError::Io {
            rank,
            step: step.into(),
            peer,
            source,
        },
        WireError::Malformed(detail) => BootstrapError::Protocol {
            rank,
            step: step.into(),
            peer,
            detail,
        },
    }
}

/// Tells every rank that the group failed (best effort, bounded).
fn abort_all(peers: &mut [Peer], err: &BootstrapError) {
    let frame = Msg::Abort {
        reason: err.to_string(),
    }
    .encode();
    let deadline = Instant::now() + ABORT_NOTICE;
    for p in peers {
        let _ = wire::write_frame(&mut p.stream, &frame, deadline);
    }
}

fn resolve(cfg: &RankConfig) -> Result<SocketAddr, BootstrapError> {
    let target = format!("{}:{}", cfg.master_addr, cfg.master_port);
    let io = |source| BootstrapError::Io {
        rank: cfg.rank,
        step: "rendezvous: resolving MASTER_ADDR".into(),
        peer: target.clone(),
        source,
    };
    (cfg.master_addr.as_str(), cfg.master_port)
        .to_socket_addrs()
        .map_err(io)?
        .next()
        .ok_or_else(|| {
            io(std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "the name resolves to no address",
            ))
        })
}

/// Rank 0's side of the rendezvous: streams to ranks 1.., in rank order.
fn accept_all(
    cfg: &RankConfig,
    listener: &TcpListener,
    started: Instant,
) -> Result<Vec<Peer>, BootstrapError> {
    const STEP: &str = "rendezvous";
    let deadline = started + cfg.timeout;
    let local = listener
        .local_addr()
        .map(|a| a.to_string())
        .unwrap_or_else(|_| "?".into());
    let io = |peer: String, source| BootstrapError::Io {
        rank: 0,
        step: STEP.into(),
        peer,
        source,
    };
    listener
        .set_nonblocking(true)
        .map_err(|e| io(local.clone(), e))?;
    let world = cfg.world_size;
    let mut slots: Vec<Option<Peer>> = (0..world).map(|_| None).collect();
    let mut joined = 0;
    let mut turned_away: Vec<String> = Vec::new();
    let fail = |slots: &mut Vec<Option<Peer>>, err: BootstrapError| {
        let mut peers: Vec<Peer> = slots.iter_mut().filter_map(Option::take).collect();
        abort_all(&mut peers, &err);
        err
    };

    while joined < world - 1 {
        if Instant::now() >= deadline {
            let missing: Vec<usize> = (1..world).filter(|&r| slots[r].is_none()).collect();
            let present: Vec<usize> = (1..world).filter(|&r| slots[r].is_some()).collect();
            let mut detail = format!(
                "ranks {missing:?} of {world} did not join at {local} (joined: {present:?})"
            );
            if !turned_away.is_empty() {
                detail += &format!("; turned away: {}", turned_away.join("; "));
            }
            let err = BootstrapError::Timeout {
                rank: 0,
                step: STEP.into(),
                waited: started.elapsed(),
                detail,
            };
            return Err(fail(&mut slots, err));
        }
        let (mut stream, addr) = match listener.accept() {
            Ok(conn) => conn,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(ACCEPT_POLL);
                continue;
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(fail(&mut slots, io(local.clone(), e))),
        };
        // Accepted sockets do not inherit the listener's non-blocking mode on Linux, but be sure.
        if let Err(e) = stream.set_nonblocking(false) {
            turned_away.push(format!("{addr}: {e}"));
            continue;
        }
        let _ = stream.set_nodelay(true);
        let hello_deadline = deadline.min(Instant::now() + HELLO_TIMEOUT);
        let (token, rank, their_world) =
            match wire::read_msg_max(&mut stream, hello_deadline, wire::MAX_HELLO) {
                Ok(Msg::Hello { token, rank, world }) => (token, rank as usize, world as usize),
                Ok(other) => {
                    turned_away.push(format!("{addr}: sent {other:?} instead of a hello"));
                    continue;
                }
                Err(WireError::Malformed(why)) => {
                    tracing::warn!("rendezvous at {local}: turned away {addr}: {why}");
                    turned_away.push(format!("{addr}: {why}"));
                    continue;
                }
                Err(WireError::TimedOut { .. }) => {
                    turned_away.push(format!("{addr}: sent no hello"));
                    continue;
                }
                Err(WireError::Closed) | Err(WireError::Io(_)) => {
                    turned_away.push(format!("{addr}: closed before its hello"));
                    continue;
                }
            };
        let reply_deadline = Instant::now() + ABORT_NOTICE;
        let mut reject = |code: RejectCode, text: &str| {
            let msg = Msg::Reject {
                code,
                value: world as u32,
                text: text.to_string(),
            };
            let _ = wire::write_msg(&mut stream, &msg, reply_deadline);
        };
        let peer = format!("{addr} (claiming rank {rank})");
        if !token.matches(&cfg.token) {
            // A stranger: turn it away and keep waiting for the job's own ranks.
            let why = token_detail(&cfg.token, &token, "rank 0", "the joining process");
            reject(RejectCode::Token, &why);
            tracing::warn!("rendezvous at {local}: turned away {peer}: job token mismatch: {why}");
            turned_away.push(format!("{peer}: job token mismatch ({why})"));
            continue;
        }
        // The right token: a rank of this job, so a mismatch below is the job's misconfiguration.
        if their_world != world {
            reject(RejectCode::WorldSize, "world size mismatch");
            let err = BootstrapError::WorldSizeMismatch {
                rank: 0,
                peer,
                ours: world,
                theirs: their_world,
            };
            return Err(fail(&mut slots, err));
        }
        if rank == 0 || rank >= world {
            let text = format!(
                "rank {rank} is impossible: rank 0 is the listener and world size is {world}"
            );
            reject(RejectCode::BadRank, &text);
            let err = BootstrapError::Protocol {
                rank: 0,
                step: STEP.into(),
                peer,
                detail: text,
            };
            return Err(fail(&mut slots, err));
        }
        if let Some(first) = &slots[rank] {
            let text = format!(
                "rank {rank} joined twice: first from {}, again from {addr}",
                first.addr
            );
            reject(RejectCode::Duplicate, &text);
            let err = BootstrapError::Protocol {
                rank: 0,
                step: STEP.into(),
                peer,
                detail: text,
            };
            return Err(fail(&mut slots, err));
        }
        slots[rank] = Some(Peer { rank, stream, addr });
        joined += 1;
    }

    let mut peers: Vec<Peer> = slots.into_iter().flatten().collect();
    for i in 0..peers.len() {
        let p = &mut peers[i];
        if let Err(e) = wire::write_msg(&mut p.stream, &Msg::Welcome, deadline) {
            let err = wire_error(0, STEP, p.describe(), e, started);
            abort_all(&mut peers, &err);
            return Err(err);
        }
    }
    tracing::debug!("rendezvous at {local}: all {world} ranks joined");
    Ok(peers)
}

/// Says which side has no token, if one has none.
fn token_detail(ours: &JobToken, theirs: &JobToken, us: &str, them: &str) -> String {
    match (ours.is_unset(), theirs.is_unset()) {
        (true, false) => format!("{us} has no EP_JOB_TOKEN but {them} has one"),
        (false, true) => format!("{them} has no EP_JOB_TOKEN but {us} has one"),
        _ => format!(
            "{us} and {them} have different EP_JOB_TOKEN values: they belong to different jobs \
             (is another job using this port?)"
        ),
    }
}

/// A non-zero rank's side of the rendezvous: the stream to rank 0, once it has welcomed us.
fn join(cfg: &RankConfig, started: Instant) -> Result<Peer, BootstrapError> {
    const STEP: &str = "rendezvous";
    let deadline = started + cfg.timeout;
    let target = format!("{}:{}", cfg.master_addr, cfg.master_port);
    let mut backoff = Duration::from_millis(5);
    let (mut stream, addr) = loop {
        // Resolve on every attempt: a name may start resolving only once rank 0's host is up.
        let attempt = resolve(cfg).and_then(|addr| {
            let left = deadline.saturating_duration_since(Instant::now());
            let per_try = left.clamp(Duration::from_millis(1), Duration::from_secs(2));
            TcpStream::connect_timeout(&addr, per_try)
                .map(|s| (s, addr))
                .map_err(|source| BootstrapError::Io {
                    rank: cfg.rank,
                    step: STEP.into(),
                    peer: format!("rank 0 at {addr}"),
                    source,
                })
        });
        match attempt {
            Ok(conn) => break conn,
            Err(last) => {
                if Instant::now() + backoff >= deadline {
                    return Err(BootstrapError::Timeout {
                        rank: cfg.rank,
                        step: STEP.into(),
                        waited: started.elapsed(),
                        detail: format!(
                            "could not reach rank 0 at {target} (is it running, with the same \
                             MASTER_ADDR/MASTER_PORT?); last attempt: {last}"
                        ),
                    });
                }
                std::thread::sleep(backoff);
                backoff = (backoff * 2).min(MAX_CONNECT_BACKOFF);
            }
        }
    };
    let _ = stream.set_nodelay(true);
    let root = || format!("rank 0 at {addr}");
    let hello = Msg::Hello {
        token: cfg.token,
        rank: cfg.rank as u32,
        world: cfg.world_size as u32,
    };
    wire::write_msg(&mut stream, &hello, deadline)
        .map_err(|e| wire_error(cfg.rank, STEP, root(), e, started))?;
    match wire::read_msg(&mut stream, deadline + grace(cfg.timeout)) {
        Ok(Msg::Welcome) => Ok(Peer {
            rank: 0,
            stream,
            addr,
        }),
        Ok(Msg::Reject { code, value, text }) => Err(match code {
            RejectCode::Token => BootstrapError::TokenMismatch {
                rank: cfg.rank,
                step: STEP.into(),
                peer: root(),
                detail: format!("rank 0 refused this process: {text}"),
            },
            RejectCode::WorldSize => BootstrapError::WorldSizeMismatch {
                rank: cfg.rank,
                peer: root(),
                ours: cfg.world_size,
                theirs: value as usize,
            },
            RejectCode::BadRank | RejectCode::Duplicate => BootstrapError::Protocol {
                rank: cfg.rank,
                step: STEP.into(),
                peer: root(),
                detail: format!("rank 0 refused this process: {text}"),
            },
        }),
        Ok(Msg::Abort { reason }) => Err(BootstrapError::Aborted {
            rank: cfg.rank,
            step: STEP.into(),
            reason,
        }),
        Ok(other) => Err(BootstrapError::Protocol {
            rank: cfg.rank,
            step: STEP.into(),
            peer: root(),
            detail: format!("unexpected reply {other:?}"),
        }),
        Err(WireError::TimedOut { .. }) => Err(BootstrapError::Timeout {
            rank: cfg.rank,
            step: STEP.into(),
            waited: started.elapsed(),
            detail: format!(
                "connected to {}, which did not complete the rendezvous (other ranks missing?)",
                root()
            ),
        }),
        Err(e) => Err(wire_error(cfg.rank, STEP, root(), e, started)),
    }
}
