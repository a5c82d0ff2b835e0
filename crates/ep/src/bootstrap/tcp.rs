//! Ranks as processes: a star over TCP through rank 0.
//!
//! Rendezvous: rank 0 listens; every other rank connects (retrying until rank 0 is up) and the two
//! authenticate each other by challenge and response, the token never on the wire:
//!
//! 1. joining rank → rank 0: hello (its rank, the world size, whether it has a token, nonce `n_m`);
//! 2. rank 0 → joining rank: challenge (nonce `n_r`);
//! 3. joining rank → rank 0: proof, `HMAC(token, "joining rank proves" | hello | n_m | n_r)`;
//! 4. rank 0, once every rank has joined → each: welcome, `HMAC(token, "rank 0 answers" | …)`.
//!
//! Rank 0 turns away a process whose proof is wrong (another job, a stray process) and keeps
//! waiting for the real ranks; a joining rank refuses a rank 0 whose welcome is wrong (a process
//! that took the port first). Each handshake runs on its own thread, bounded by a few seconds, so
//! silent connections cannot hold up the rendezvous. Once authenticated, a world-size mismatch or
//! an impossible or duplicate rank fails the job. After the handshake every frame is sealed: an
//! HMAC tag under a key derived from the token and both nonces, over the direction, a frame
//! counter and the payload, so bytes changed, injected, replayed or reordered on the way fail the
//! collective with a named error. Frames are not encrypted: what the ranks exchange (addresses,
//! IPC handles, sizes) is readable by whoever sees the traffic.
//!
//! Collectives: each rank sends its part to rank 0, which gathers them in rank order and sends the
//! whole back. Messages carry the collective's sequence number and kind, so ranks that call
//! different collectives are caught. When rank 0 fails a collective it tells every rank why
//! before returning, so the whole job fails with the root cause rather than a cascade of timeouts.

use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::wire::{self, Msg, Op, Pending, RejectCode, WireError};
use super::{BootstrapError, Communicator, RankConfig};

/// How long rank 0 gives one accepted connection for its whole handshake (hello, then proof): the
/// real ranks answer at once, so a connection that stays silent is a stranger. Each handshake runs
/// on its own thread, so even a silent one stalls nobody else.
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
    /// Tags and checks every frame after the handshake.
    seal: wire::Seal,
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
    ///
    /// Rank 0 started by a [`Launcher`](super::Launcher) listens on the socket the launcher bound
    /// and passed down (`EP_LISTEN_FD`, which must be bound to `cfg.master_port`) instead of
    /// binding the port again.
    pub fn connect(cfg: &RankConfig) -> Result<Self, BootstrapError> {
        cfg.validate()?;
        if let Some(listener) = inherited_listener(cfg)? {
            return Self::with_listener(cfg, listener);
        }
        if cfg.rank == 0 && cfg.world_size > 1 {
            let addr = resolve(cfg, cfg.timeout)?;
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

    /// Joins the job the environment describes ([`RankConfig::from_env`]), as
    /// [`connect`](Self::connect).
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
        let deadline = ibgda_device::timeout::deadline_after(started, self.timeout);
        let mut parts = vec![Vec::new(); self.world_size];
        parts[0] = mine.to_vec();
        for i in 0..peers.len() {
            let peer = &mut peers[i];
            let peer_rank = peer.rank;
            let err = match wire::read_sealed(&mut peer.stream, &mut peer.seal, deadline) {
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
            if let Err(e) = wire::write_sealed(&mut peer.stream, &mut peer.seal, &reply, deadline) {
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
        let deadline = ibgda_device::timeout::deadline_after(started, self.timeout);
        let contrib = Msg::Contrib {
            seq,
            op,
            data: mine.to_vec(),
        };
        if let Err(e) = wire::write_sealed(
            &mut root.stream,
            &mut root.seal,
            &contrib.encode(),
            deadline,
        ) {
            return Err(wire_error(self.rank, step, root.describe(), e, started));
        }
        let root_name = root.describe();
        let describe = || root_name.clone();
        let with_grace = ibgda_device::timeout::deadline_after(deadline, grace(self.timeout));
        match wire::read_sealed(&mut root.stream, &mut root.seal, with_grace) {
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

/// Tells every rank that the group failed (best effort, bounded), in sealed frames: for ranks
/// past the rendezvous.
fn abort_all(peers: &mut [Peer], err: &BootstrapError) {
    let frame = Msg::Abort {
        reason: err.to_string(),
    }
    .encode();
    let deadline = ibgda_device::timeout::deadline_after(Instant::now(), ABORT_NOTICE);
    for p in peers {
        let _ = wire::write_sealed(&mut p.stream, &mut p.seal, &frame, deadline);
    }
}

/// As [`abort_all`] for ranks still in the rendezvous (waiting for their welcome), which read
/// unsealed frames.
fn abort_joining(peers: &mut [Peer], err: &BootstrapError) {
    let frame = Msg::Abort {
        reason: err.to_string(),
    }
    .encode();
    let deadline = ibgda_device::timeout::deadline_after(Instant::now(), ABORT_NOTICE);
    for p in peers {
        let _ = wire::write_frame(&mut p.stream, &frame, deadline);
    }
}

/// How long a name lookup (`MASTER_ADDR`) may take: the resolver's own timeouts are the system's
/// (`resolv.conf`), which can add up to minutes; the rendezvous must not.
const RESOLVE_BOUND: Duration = Duration::from_secs(10);

/// `MASTER_ADDR:port` as a socket address, within `bound` (and [`RESOLVE_BOUND`]). An IP literal
/// needs no lookup; a name is looked up on a helper thread, so a hung resolver costs this rank its
/// time bound, not its life (the thread ends when the resolver returns, and holds only the name).
fn resolve(cfg: &RankConfig, bound: Duration) -> Result<SocketAddr, BootstrapError> {
    let target = format!("{}:{}", cfg.master_addr, cfg.master_port);
    let io = |source| BootstrapError::Io {
        rank: cfg.rank,
        step: "rendezvous: resolving MASTER_ADDR".into(),
        peer: target.clone(),
        source,
    };
    let host = cfg.master_addr.trim().to_string();
    if let Ok(ip) = host.parse::<std::net::IpAddr>() {
        return Ok(SocketAddr::new(ip, cfg.master_port));
    }
    let port = cfg.master_port;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("ep-resolve".into())
        .spawn(move || {
            let r = (host.as_str(), port)
                .to_socket_addrs()
                .map(|mut addrs| addrs.next());
            let _ = tx.send(r);
        })
        .map_err(io)?;
    let bound = bound.min(RESOLVE_BOUND).max(Duration::from_millis(1));
    match rx.recv_timeout(bound) {
        Ok(Ok(Some(addr))) => Ok(addr),
        Ok(Ok(None)) => Err(io(std::io::Error::new(
            std::io::ErrorKind::NotFound,
            "the name resolves to no address",
        ))),
        Ok(Err(e)) => Err(io(e)),
        Err(_) => Err(io(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("the name lookup did not answer within {bound:?}"),
        ))),
    }
}

/// Labels of the two tags of a handshake: a tag made by one side is never valid for the other.
const ROOT_LABEL: &[u8] = b"ep bootstrap v2: rank 0 answers";
const MEMBER_LABEL: &[u8] = b"ep bootstrap v2: joining rank proves";
/// Label of the key that seals a stream's frames after its handshake.
const SESSION_LABEL: &[u8] = b"ep bootstrap v2: session key";

/// The tag one side of a handshake sends: HMAC-SHA256 under the job token of the label, both
/// nonces, the claimed rank and world size, and whether a token is in use. Fresh nonces from both
/// sides make a recorded tag useless for any other connection; the token never leaves the process.
fn proof(
    key: &[u8],
    label: &[u8],
    hello: &HelloFields,
    root_nonce: &wire::Nonce,
) -> super::token::Tag {
    super::token::tag(key, &proof_parts(label, hello, root_nonce).each())
}

fn proof_matches(
    key: &[u8],
    label: &[u8],
    hello: &HelloFields,
    root_nonce: &wire::Nonce,
    claimed: &super::token::Tag,
) -> bool {
    super::token::tag_matches(key, &proof_parts(label, hello, root_nonce).each(), claimed)
}

struct ProofParts<'a> {
    label: &'a [u8],
    hello: [u8; 9],
    member_nonce: &'a wire::Nonce,
    root_nonce: &'a wire::Nonce,
}

impl ProofParts<'_> {
    fn each(&self) -> [&[u8]; 5] {
        [
            self.label,
            &wire::MAGIC,
            &self.hello,
            self.member_nonce,
            self.root_nonce,
        ]
    }
}

fn proof_parts<'a>(
    label: &'a [u8],
    hello: &'a HelloFields,
    root_nonce: &'a wire::Nonce,
) -> ProofParts<'a> {
    let mut fixed = [0u8; 9];
    fixed[0] = u8::from(hello.authenticated);
    fixed[1..5].copy_from_slice(&hello.rank.to_le_bytes());
    fixed[5..9].copy_from_slice(&hello.world.to_le_bytes());
    ProofParts {
        label,
        hello: fixed,
        member_nonce: &hello.nonce,
        root_nonce,
    }
}

/// What a joining rank said in its hello.
#[derive(Debug, Clone, Copy)]
struct HelloFields {
    authenticated: bool,
    rank: u32,
    world: u32,
    nonce: wire::Nonce,
}

/// Most handshakes rank 0 runs at once. Each ends within [`HELLO_TIMEOUT`]; connections beyond
/// the cap are closed at once (a real rank retries), so a flood of silent connections costs a
/// bounded number of threads and cannot keep the real ranks out for longer than that.
const MAX_PENDING_HANDSHAKES: usize = 256;

/// The outcome of one handshake on rank 0's side.
enum Arrival {
    /// The peer proved it holds the token (or both sides run without one).
    Joined(Joined),
    /// Turned away (a stranger, a silent connection, not a bootstrap peer): why.
    TurnedAway(String),
}

/// A peer that completed its side of the handshake, and the nonce rank 0 used with it (rank 0's
/// tag in the welcome covers both nonces).
struct Joined {
    peer: Peer,
    hello: HelloFields,
    root_nonce: wire::Nonce,
}

/// Rank 0's side of one handshake, on its own thread: hello, challenge, proof. Every read and
/// write ends by `deadline`.
fn handshake_root(
    mut stream: TcpStream,
    addr: SocketAddr,
    key: &[u8],
    authenticated: bool,
    deadline: Instant,
) -> Arrival {
    let away = |why: String| Arrival::TurnedAway(format!("{addr}: {why}"));
    if let Err(e) = stream.set_nonblocking(false) {
        return away(e.to_string());
    }
    let _ = stream.set_nodelay(true);
    let hello = match wire::read_msg_max(&mut stream, deadline, wire::MAX_HANDSHAKE) {
        Ok(Msg::Hello {
            authenticated,
            rank,
            world,
            nonce,
        }) => HelloFields {
            authenticated,
            rank,
            world,
            nonce,
        },
        Ok(other) => return away(format!("sent {other:?} instead of a hello")),
        Err(WireError::Malformed(why)) => return away(why),
        Err(WireError::TimedOut { .. }) => return away("sent no hello in time".into()),
        Err(WireError::Closed) | Err(WireError::Io(_)) => {
            return away("closed before its hello".into())
        }
    };
    let peer = format!("{addr} (claiming rank {})", hello.rank);
    let reject = |stream: &mut TcpStream, text: String| {
        let msg = Msg::Reject {
            code: RejectCode::Token,
            value: 0,
            text: text.clone(),
        };
        let _ = wire::write_msg(stream, &msg, deadline);
        Arrival::TurnedAway(format!("{peer}: job token mismatch ({text})"))
    };
    if hello.authenticated != authenticated {
        return reject(
            &mut stream,
            token_detail(
                authenticated,
                hello.authenticated,
                "rank 0",
                "the joining process",
            ),
        );
    }
    let root_nonce: wire::Nonce = match super::token::random_bytes("a handshake nonce") {
        Ok(n) => n,
        Err(e) => return away(e.to_string()),
    };
    if let Err(e) = wire::write_msg(&mut stream, &Msg::Challenge { nonce: root_nonce }, deadline) {
        return away(format!("could not be sent its challenge: {e:?}"));
    }
    let tag = match wire::read_msg_max(&mut stream, deadline, wire::MAX_HANDSHAKE) {
        Ok(Msg::Proof { tag }) => tag,
        Ok(other) => return away(format!("sent {other:?} instead of its proof")),
        Err(WireError::Malformed(why)) => return away(why),
        Err(WireError::TimedOut { .. }) => return away("sent no proof in time".into()),
        Err(WireError::Closed) | Err(WireError::Io(_)) => {
            return away("closed before its proof".into())
        }
    };
    if !proof_matches(key, MEMBER_LABEL, &hello, &root_nonce, &tag) {
        return reject(
            &mut stream,
            "rank 0 and the joining process have different EP_JOB_TOKEN values: they belong to \
             different jobs (is another job using this port?)"
                .into(),
        );
    }
    Arrival::Joined(Joined {
        peer: Peer {
            rank: hello.rank as usize,
            stream,
            addr,
            seal: wire::Seal::new(proof(key, SESSION_LABEL, &hello, &root_nonce), true),
        },
        hello,
        root_nonce,
    })
}

/// Rank 0's side of the rendezvous: streams to ranks 1.., in rank order.
///
/// Connections are accepted on this thread and each handshake runs on a thread of its own, so a
/// connection that stays silent holds up nobody (it is dropped at [`HELLO_TIMEOUT`]); those threads
/// are not joined: each ends by its own deadline and owns only its socket.
fn accept_all(
    cfg: &RankConfig,
    listener: &TcpListener,
    started: Instant,
) -> Result<Vec<Peer>, BootstrapError> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::mpsc;
    use std::sync::Arc;

    const STEP: &str = "rendezvous";
    let deadline = ibgda_device::timeout::deadline_after(started, cfg.timeout);
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
    let key: Arc<[u8]> = cfg.key().into();
    let authenticated = cfg.token.is_some();
    let mut slots: Vec<Option<Joined>> = (0..world).map(|_| None).collect();
    let mut joined = 0;
    let mut turned_away: Vec<String> = Vec::new();
    let fail = |slots: &mut Vec<Option<Joined>>, err: BootstrapError| {
        let mut peers: Vec<Peer> = slots
            .iter_mut()
            .filter_map(Option::take)
            .map(|j| j.peer)
            .collect();
        abort_joining(&mut peers, &err);
        err
    };
    let (tx, rx) = mpsc::channel::<Arrival>();
    let pending = Arc::new(AtomicUsize::new(0));

    while joined < world - 1 {
        // Handshakes that finished.
        while let Ok(arrival) = rx.try_recv() {
            let j = match arrival {
                Arrival::TurnedAway(why) => {
                    tracing::warn!("rendezvous at {local}: turned away {why}");
                    note(&mut turned_away, why);
                    continue;
                }
                Arrival::Joined(j) => j,
            };
            if let Err(err) = admit(cfg, &mut slots, j) {
                return Err(fail(&mut slots, err));
            }
            joined += 1;
        }
        if joined == world - 1 {
            break;
        }
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
        let (stream, addr) = match listener.accept() {
            Ok(conn) => conn,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(ACCEPT_POLL);
                continue;
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(fail(&mut slots, io(local.clone(), e))),
        };
        if pending.load(Ordering::Acquire) >= MAX_PENDING_HANDSHAKES {
            note(
                &mut turned_away,
                format!(
                    "{addr}: closed at once, {MAX_PENDING_HANDSHAKES} handshakes already running"
                ),
            );
            continue;
        }
        let hello_deadline = deadline.min(ibgda_device::timeout::deadline_after(
            Instant::now(),
            HELLO_TIMEOUT,
        ));
        let (tx, key, pending2) = (tx.clone(), key.clone(), pending.clone());
        pending.fetch_add(1, Ordering::AcqRel);
        let spawned = std::thread::Builder::new()
            .name("ep-handshake".into())
            .spawn(move || {
                let a = handshake_root(stream, addr, &key, authenticated, hello_deadline);
                pending2.fetch_sub(1, Ordering::AcqRel);
                let _ = tx.send(a);
            });
        if let Err(e) = spawned {
            pending.fetch_sub(1, Ordering::AcqRel);
            note(
                &mut turned_away,
                format!("{addr}: no thread for its handshake: {e}"),
            );
        }
    }

    let mut peers = Vec::with_capacity(world - 1);
    let mut welcomes = Vec::with_capacity(world - 1);
    for j in slots.into_iter().flatten() {
        welcomes.push(Msg::Welcome {
            tag: proof(&key, ROOT_LABEL, &j.hello, &j.root_nonce),
        });
        peers.push(j.peer);
    }
    for i in 0..peers.len() {
        let p = &mut peers[i];
        if let Err(e) = wire::write_msg(&mut p.stream, &welcomes[i], deadline) {
            let err = wire_error(0, STEP, p.describe(), e, started);
            // Ranks before i have their welcome and read sealed frames; the rest do not.
            let (welcomed, waiting) = peers.split_at_mut(i);
            abort_all(welcomed, &err);
            abort_joining(waiting, &err);
            return Err(err);
        }
    }
    tracing::debug!("rendezvous at {local}: all {world} ranks joined");
    Ok(peers)
}

/// Turned-away connections kept for the timeout message; later ones are only counted, so a flood
/// of strangers costs no memory.
const MAX_TURNED_AWAY_NOTED: usize = 16;

fn note(turned_away: &mut Vec<String>, why: String) {
    match turned_away.len() {
        n if n < MAX_TURNED_AWAY_NOTED => turned_away.push(why),
        n if n == MAX_TURNED_AWAY_NOTED => turned_away.push("and more (not listed)".into()),
        _ => {}
    }
}

/// Takes an authenticated peer into its rank's slot, or fails the job: once a peer has proved it
/// holds the token it is a rank of this job, so a wrong world size, an impossible rank or a
/// duplicate is the job's misconfiguration (the peer is told why).
fn admit(
    cfg: &RankConfig,
    slots: &mut [Option<Joined>],
    mut j: Joined,
) -> Result<(), BootstrapError> {
    const STEP: &str = "rendezvous";
    let world = cfg.world_size;
    let (rank, their_world) = (j.hello.rank as usize, j.hello.world as usize);
    let addr = j.peer.addr;
    let peer = format!("{addr} (claiming rank {rank})");
    let reply_deadline = ibgda_device::timeout::deadline_after(Instant::now(), ABORT_NOTICE);
    let mut reject = |code: RejectCode, text: &str| {
        let msg = Msg::Reject {
            code,
            value: world as u32,
            text: text.to_string(),
        };
        let _ = wire::write_msg(&mut j.peer.stream, &msg, reply_deadline);
    };
    if their_world != world {
        reject(RejectCode::WorldSize, "world size mismatch");
        return Err(BootstrapError::WorldSizeMismatch {
            rank: 0,
            peer,
            ours: world,
            theirs: their_world,
        });
    }
    if rank == 0 || rank >= world {
        let text =
            format!("rank {rank} is impossible: rank 0 is the listener and world size is {world}");
        reject(RejectCode::BadRank, &text);
        return Err(BootstrapError::Protocol {
            rank: 0,
            step: STEP.into(),
            peer,
            detail: text,
        });
    }
    if let Some(first) = &slots[rank] {
        let text = format!(
            "rank {rank} joined twice: first from {}, again from {addr}",
            first.peer.addr
        );
        reject(RejectCode::Duplicate, &text);
        return Err(BootstrapError::Protocol {
            rank: 0,
            step: STEP.into(),
            peer,
            detail: text,
        });
    }
    j.peer.rank = rank;
    slots[rank] = Some(j);
    Ok(())
}

/// Says which side has no token, if one has none.
fn token_detail(ours: bool, theirs: bool, us: &str, them: &str) -> String {
    match (ours, theirs) {
        (false, true) => format!("{us} has no EP_JOB_TOKEN but {them} has one"),
        (true, false) => format!("{them} has no EP_JOB_TOKEN but {us} has one"),
        _ => format!(
            "{us} and {them} have different EP_JOB_TOKEN values: they belong to different jobs \
             (is another job using this port?)"
        ),
    }
}

/// One attempt of a joining rank's handshake that rank 0 cut short before it answered (it was
/// at its handshake cap, or restarting): worth another connection while time remains.
struct Retry(BootstrapError);

/// A non-zero rank's side of the rendezvous: the stream to rank 0, once it has welcomed us and
/// proved it holds the job's token.
fn join(cfg: &RankConfig, started: Instant) -> Result<Peer, BootstrapError> {
    const STEP: &str = "rendezvous";
    let deadline = ibgda_device::timeout::deadline_after(started, cfg.timeout);
    let target = format!("{}:{}", cfg.master_addr, cfg.master_port);
    let mut backoff = Duration::from_millis(5);
    loop {
        // Resolve on every attempt: a name may start resolving only once rank 0's host is up.
        let left = deadline.saturating_duration_since(Instant::now());
        let attempt = resolve(cfg, left).and_then(|addr| {
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
        let last = match attempt {
            Ok((stream, addr)) => match handshake_member(cfg, stream, addr, started, deadline) {
                Ok(peer) => return Ok(peer),
                Err(Ok(e)) => return Err(e),
                Err(Err(Retry(e))) => e,
            },
            Err(e) => e,
        };
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

/// A joining rank's handshake on a connected stream: `Err(Ok(_))` ends the rendezvous,
/// `Err(Err(_))` is worth another attempt.
fn handshake_member(
    cfg: &RankConfig,
    mut stream: TcpStream,
    addr: SocketAddr,
    started: Instant,
    deadline: Instant,
) -> Result<Peer, Result<BootstrapError, Retry>> {
    const STEP: &str = "rendezvous";
    let _ = stream.set_nodelay(true);
    let root = || format!("rank 0 at {addr}");
    let fatal = |e: WireError| Ok(wire_error(cfg.rank, STEP, root(), e, started));
    let nonce: wire::Nonce = super::token::random_bytes("a handshake nonce").map_err(Ok)?;
    let hello = HelloFields {
        authenticated: cfg.token.is_some(),
        rank: cfg.rank as u32,
        world: cfg.world_size as u32,
        nonce,
    };
    let msg = Msg::Hello {
        authenticated: hello.authenticated,
        rank: hello.rank,
        world: hello.world,
        nonce,
    };
    wire::write_msg(&mut stream, &msg, deadline).map_err(|e| match e {
        WireError::Closed => Err(Retry(wire_error(cfg.rank, STEP, root(), e, started))),
        e => fatal(e),
    })?;
    // The whole bound, not HELLO_TIMEOUT: the kernel completes a connection to a listening socket
    // before its owner accepts it, and a launched rank 0 may still be starting (loading CUDA)
    // while its inherited socket already queues the other ranks' connections.
    let root_nonce = match wire::read_msg_max(&mut stream, deadline, wire::MAX_HANDSHAKE) {
        Ok(Msg::Challenge { nonce }) => nonce,
        Ok(Msg::Reject { code, value, text }) => {
            return Err(Ok(rejected(cfg, &root(), code, value, text)))
        }
        Ok(other) => {
            return Err(Ok(BootstrapError::Protocol {
                rank: cfg.rank,
                step: STEP.into(),
                peer: root(),
                detail: format!("unexpected reply {other:?} to the hello"),
            }))
        }
        // Closed before answering: rank 0 is at its handshake cap, or a stale listener; again.
        Err(e @ WireError::Closed) => {
            return Err(Err(Retry(wire_error(cfg.rank, STEP, root(), e, started))))
        }
        Err(e) => return Err(fatal(e)),
    };
    let tag = proof(cfg.key(), MEMBER_LABEL, &hello, &root_nonce);
    wire::write_msg(&mut stream, &Msg::Proof { tag }, deadline).map_err(fatal)?;
    let grace = ibgda_device::timeout::deadline_after(deadline, grace(cfg.timeout));
    // Not authenticated until the welcome's tag checks out: a reply of bounded size.
    match wire::read_msg_max(&mut stream, grace, wire::MAX_UNAUTHENTICATED) {
        Ok(Msg::Welcome { tag }) => {
            if !proof_matches(cfg.key(), ROOT_LABEL, &hello, &root_nonce, &tag) {
                return Err(Ok(BootstrapError::TokenMismatch {
                    rank: cfg.rank,
                    step: STEP.into(),
                    peer: root(),
                    detail: "the process at rank 0's address did not prove it holds this job's \
                             EP_JOB_TOKEN: it belongs to another job, or it is posing as rank 0"
                        .into(),
                }));
            }
            Ok(Peer {
                rank: 0,
                stream,
                addr,
                seal: wire::Seal::new(proof(cfg.key(), SESSION_LABEL, &hello, &root_nonce), false),
            })
        }
        Ok(Msg::Reject { code, value, text }) => Err(Ok(rejected(cfg, &root(), code, value, text))),
        Ok(Msg::Abort { reason }) => Err(Ok(BootstrapError::Aborted {
            rank: cfg.rank,
            step: STEP.into(),
            reason,
        })),
        Ok(other) => Err(Ok(BootstrapError::Protocol {
            rank: cfg.rank,
            step: STEP.into(),
            peer: root(),
            detail: format!("unexpected reply {other:?}"),
        })),
        Err(WireError::TimedOut { .. }) => Err(Ok(BootstrapError::Timeout {
            rank: cfg.rank,
            step: STEP.into(),
            waited: started.elapsed(),
            detail: format!(
                "connected to {}, which did not complete the rendezvous (other ranks missing?)",
                root()
            ),
        })),
        Err(e) => Err(fatal(e)),
    }
}

/// The error of a joining rank that rank 0 turned away.
fn rejected(
    cfg: &RankConfig,
    root: &str,
    code: RejectCode,
    value: u32,
    text: String,
) -> BootstrapError {
    const STEP: &str = "rendezvous";
    match code {
        RejectCode::Token => BootstrapError::TokenMismatch {
            rank: cfg.rank,
            step: STEP.into(),
            peer: root.into(),
            detail: format!("rank 0 refused this process: {text}"),
        },
        RejectCode::WorldSize => BootstrapError::WorldSizeMismatch {
            rank: cfg.rank,
            peer: root.into(),
            ours: cfg.world_size,
            theirs: value as usize,
        },
        RejectCode::BadRank | RejectCode::Duplicate => BootstrapError::Protocol {
            rank: cfg.rank,
            step: STEP.into(),
            peer: root.into(),
            detail: format!("rank 0 refused this process: {text}"),
        },
    }
}

/// Sets or clears close-on-exec on `fd`. Async-signal-safe (one system call), so it may run
/// between fork and exec.
#[cfg(unix)]
pub(crate) fn set_cloexec(fd: std::ffi::c_int, on: bool) -> std::io::Result<()> {
    extern "C" {
        fn fcntl(fd: std::ffi::c_int, cmd: std::ffi::c_int, ...) -> std::ffi::c_int;
    }
    const F_SETFD: std::ffi::c_int = 2;
    const FD_CLOEXEC: std::ffi::c_int = 1;
    // SAFETY: fcntl(F_SETFD, flags) reads no memory of ours; the variadic argument is the int the
    // kernel expects, and a bad descriptor is an error, not undefined behaviour.
    if unsafe { fcntl(fd, F_SETFD, if on { FD_CLOEXEC } else { 0 }) } == -1 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Rank 0's listening socket inherited from the launcher (`EP_LISTEN_FD`), taken once per
/// process; `None` for other ranks, for a job of one, without the variable, or once taken. The
/// socket must be bound to `cfg.master_port`.
pub(crate) fn inherited_listener(cfg: &RankConfig) -> Result<Option<TcpListener>, BootstrapError> {
    use std::sync::atomic::{AtomicBool, Ordering};
    static TAKEN: AtomicBool = AtomicBool::new(false);
    const VAR: &str = super::vars::EP_LISTEN_FD;
    if cfg.rank != 0 || cfg.world_size == 1 {
        return Ok(None);
    }
    let Some(text) = std::env::var(VAR).ok().filter(|v| !v.trim().is_empty()) else {
        return Ok(None);
    };
    let invalid = |reason: String| BootstrapError::EnvInvalid {
        var: VAR,
        value: text.clone(),
        reason,
    };
    #[cfg(unix)]
    {
        use std::os::unix::io::FromRawFd as _;
        let fd: std::ffi::c_int = text
            .trim()
            .parse()
            .ok()
            .filter(|fd| *fd > 2)
            .ok_or_else(|| invalid("not a file descriptor above 2".into()))?;
        if TAKEN.swap(true, Ordering::SeqCst) {
            // An earlier communicator of this process took it (and may have closed it since):
            // bind the port as without a launcher.
            return Ok(None);
        }
        // Probing with F_SETFD both checks that the descriptor is open and keeps it from leaking
        // into processes this rank starts.
        set_cloexec(fd, true).map_err(|e| invalid(format!("not an open descriptor: {e}")))?;
        // SAFETY: the descriptor is open (just checked), was passed by the launcher to this
        // process alone for this use, and is taken once (TAKEN), so nothing else owns or closes it.
        let listener = unsafe { TcpListener::from_raw_fd(fd) };
        match listener.local_addr() {
            Ok(a) if a.port() == cfg.master_port => Ok(Some(listener)),
            Ok(a) => Err(invalid(format!(
                "the socket is bound to {a}, not to MASTER_PORT={}",
                cfg.master_port
            ))),
            Err(e) => Err(invalid(format!("not a bound TCP socket: {e}"))),
        }
    }
    #[cfg(not(unix))]
    {
        let _ = (&TAKEN, invalid);
        Ok(None)
    }
}
