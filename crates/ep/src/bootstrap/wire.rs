//! The bootstrap's messages on a TCP stream: length-prefixed frames, every read and write bounded
//! by a deadline.
//!
//! Frame: `u32` little-endian payload length, then the payload, whose first byte is the kind.
//! A frame's length is checked against the limit of the step before anything is allocated, and
//! its payload buffer grows only as bytes arrive: a peer announcing a large frame and sending
//! nothing costs nothing.

use std::io::{self, Read as _, Write as _};
use std::net::TcpStream;
use std::time::Instant;

use super::token::Tag;

/// Opens every handshake message, so a connection from anything else is recognised and turned
/// away. Bumped with the handshake: a process of an older version is told it speaks another one.
pub(crate) const MAGIC: [u8; 8] = *b"EPBOOT02";

/// Bytes of a handshake nonce.
pub(crate) const NONCE_BYTES: usize = 32;

/// A handshake nonce: fresh random bytes per connection and side.
pub(crate) type Nonce = [u8; NONCE_BYTES];

/// No bootstrap message is larger: a length beyond it means the other side is not speaking this
/// protocol (or is broken), and reading on would only allocate garbage.
pub(crate) const MAX_FRAME: usize = 1 << 30;

/// A collective, as carried in its messages so that ranks calling different ones are caught.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Op {
    AllGather = 1,
    Barrier = 2,
}

impl Op {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Op::AllGather => "all_gather",
            Op::Barrier => "barrier",
        }
    }

    fn from_u8(v: u8) -> Option<Self> {
        match v {
            1 => Some(Op::AllGather),
            2 => Some(Op::Barrier),
            _ => None,
        }
    }
}

/// Why rank 0 turned a joining process away.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RejectCode {
    Token = 1,
    WorldSize = 2,
    BadRank = 3,
    Duplicate = 4,
}

impl RejectCode {
    fn from_u8(v: u8) -> Option<Self> {
        match v {
            1 => Some(RejectCode::Token),
            2 => Some(RejectCode::WorldSize),
            3 => Some(RejectCode::BadRank),
            4 => Some(RejectCode::Duplicate),
            _ => None,
        }
    }
}

/// One message.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Msg {
    /// Joining rank → rank 0: who it claims to be, whether it holds a token, its nonce.
    Hello {
        authenticated: bool,
        rank: u32,
        world: u32,
        nonce: Nonce,
    },
    /// Rank 0 → joining rank: rank 0's nonce.
    Challenge { nonce: Nonce },
    /// Joining rank → rank 0: its tag over the handshake (see `tcp::proof`).
    Proof { tag: Tag },
    /// Rank 0 → every rank, once all have joined: rank 0's own tag over the handshake.
    Welcome { tag: Tag },
    /// Rank 0 → a process it turns away; `value` is rank 0's world size for `WorldSize`.
    Reject {
        code: RejectCode,
        value: u32,
        text: String,
    },
    /// A rank's part of collective number `seq` → rank 0.
    Contrib { seq: u64, op: Op, data: Vec<u8> },
    /// Rank 0 → every rank: all parts of collective `seq` (none for a barrier).
    Gathered {
        seq: u64,
        op: Op,
        parts: Vec<Vec<u8>>,
    },
    /// Rank 0 → every rank: the group failed, for this reason.
    Abort { reason: String },
}

const K_HELLO: u8 = 1;
const K_WELCOME: u8 = 2;
const K_REJECT: u8 = 3;
const K_CONTRIB: u8 = 4;
const K_GATHERED: u8 = 5;
const K_ABORT: u8 = 6;
const K_CHALLENGE: u8 = 7;
const K_PROOF: u8 = 8;

/// Why a message could not be read or written.
#[derive(Debug)]
pub(crate) enum WireError {
    /// The deadline passed; `partial` when part of a frame had already moved.
    TimedOut { partial: bool },
    /// The other side closed the connection.
    Closed,
    /// The socket failed.
    Io(io::Error),
    /// The bytes are not a bootstrap message.
    Malformed(String),
}

impl Msg {
    /// The whole frame, length prefix included.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut p = vec![0u8; 4];
        match self {
            Msg::Hello {
                authenticated,
                rank,
                world,
                nonce,
            } => {
                p.push(K_HELLO);
                p.extend_from_slice(&MAGIC);
                p.push(u8::from(*authenticated));
                p.extend_from_slice(&rank.to_le_bytes());
                p.extend_from_slice(&world.to_le_bytes());
                p.extend_from_slice(nonce);
            }
            Msg::Challenge { nonce } => {
                p.push(K_CHALLENGE);
                p.extend_from_slice(&MAGIC);
                p.extend_from_slice(nonce);
            }
            Msg::Proof { tag } => {
                p.push(K_PROOF);
                p.extend_from_slice(&MAGIC);
                p.extend_from_slice(tag);
            }
            Msg::Welcome { tag } => {
                p.push(K_WELCOME);
                p.extend_from_slice(&MAGIC);
                p.extend_from_slice(tag);
            }
            Msg::Reject { code, value, text } => {
                p.push(K_REJECT);
                p.extend_from_slice(&MAGIC);
                p.push(*code as u8);
                p.extend_from_slice(&value.to_le_bytes());
                p.extend_from_slice(text.as_bytes());
            }
            Msg::Contrib { seq, op, data } => {
                p.push(K_CONTRIB);
                p.extend_from_slice(&seq.to_le_bytes());
                p.push(*op as u8);
                p.extend_from_slice(data);
            }
            Msg::Gathered { seq, op, parts } => {
                p.push(K_GATHERED);
                p.extend_from_slice(&seq.to_le_bytes());
                p.push(*op as u8);
                p.extend_from_slice(&(parts.len() as u32).to_le_bytes());
                for part in parts {
                    p.extend_from_slice(&(part.len() as u64).to_le_bytes());
                    p.extend_from_slice(part);
                }
            }
            Msg::Abort { reason } => {
                p.push(K_ABORT);
                p.extend_from_slice(reason.as_bytes());
            }
        }
        let len = (p.len() - 4) as u32;
        p[..4].copy_from_slice(&len.to_le_bytes());
        p
    }

    /// Parses one payload (the bytes after the length prefix).
    pub(crate) fn decode(payload: &[u8]) -> Result<Msg, WireError> {
        let mut r = Reader(payload);
        let kind = r.u8()?;
        let msg = match kind {
            K_HELLO | K_WELCOME | K_REJECT | K_CHALLENGE | K_PROOF => {
                let magic = r.take(MAGIC.len())?;
                if magic != MAGIC {
                    return Err(WireError::Malformed(if magic.starts_with(b"EPBOOT") {
                        format!(
                            "the peer speaks bootstrap protocol {:?}, this process {:?} (different \
                             versions of ep?)",
                            String::from_utf8_lossy(magic),
                            String::from_utf8_lossy(&MAGIC)
                        )
                    } else {
                        "not an ep bootstrap message (bad magic)".into()
                    }));
                }
                match kind {
                    K_HELLO => Msg::Hello {
                        authenticated: match r.u8()? {
                            0 => false,
                            1 => true,
                            v => {
                                return Err(WireError::Malformed(format!(
                                    "hello with authentication flag {v}"
                                )))
                            }
                        },
                        rank: r.u32()?,
                        world: r.u32()?,
                        nonce: r.array()?,
                    },
                    K_CHALLENGE => Msg::Challenge { nonce: r.array()? },
                    K_PROOF => Msg::Proof { tag: r.array()? },
                    K_WELCOME => Msg::Welcome { tag: r.array()? },
                    _ => Msg::Reject {
                        code: RejectCode::from_u8(r.u8()?)
                            .ok_or_else(|| WireError::Malformed("unknown rejection code".into()))?,
                        value: r.u32()?,
                        text: String::from_utf8_lossy(r.rest()).into_owned(),
                    },
                }
            }
            K_CONTRIB => Msg::Contrib {
                seq: r.u64()?,
                op: r.op()?,
                data: r.rest().to_vec(),
            },
            K_GATHERED => {
                let seq = r.u64()?;
                let op = r.op()?;
                let n = r.u32()? as usize;
                if n > super::MAX_WORLD_SIZE {
                    return Err(WireError::Malformed(format!(
                        "{n} parts in a gathered message"
                    )));
                }
                let mut parts = Vec::with_capacity(n);
                for _ in 0..n {
                    let len = usize::try_from(r.u64()?)
                        .map_err(|_| WireError::Malformed("part length overflows".into()))?;
                    parts.push(r.take(len)?.to_vec());
                }
                Msg::Gathered { seq, op, parts }
            }
            K_ABORT => Msg::Abort {
                reason: String::from_utf8_lossy(r.rest()).into_owned(),
            },
            other => {
                return Err(WireError::Malformed(format!(
                    "unknown message kind {other} (not an ep bootstrap peer?)"
                )))
            }
        };
        if !r.0.is_empty() {
            return Err(WireError::Malformed(format!(
                "{} trailing bytes after a message of kind {kind}",
                r.0.len()
            )));
        }
        Ok(msg)
    }
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        if self.0.len() < n {
            return Err(WireError::Malformed(format!(
                "message truncated: wanted {n} more bytes, {} left",
                self.0.len()
            )));
        }
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        Ok(head)
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N], WireError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8, WireError> {
        Ok(self.array::<1>()?[0])
    }
    fn u32(&mut self) -> Result<u32, WireError> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    fn u64(&mut self) -> Result<u64, WireError> {
        Ok(u64::from_le_bytes(self.array()?))
    }
    fn op(&mut self) -> Result<Op, WireError> {
        let v = self.u8()?;
        Op::from_u8(v).ok_or_else(|| WireError::Malformed(format!("unknown collective {v}")))
    }
    fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.0)
    }
}

fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

/// Fills `buf`, giving up at `deadline`. `moved` counts bytes of the current frame already read.
fn read_exact_by(
    s: &mut TcpStream,
    buf: &mut [u8],
    deadline: Instant,
    moved: &mut usize,
) -> Result<(), WireError> {
    let mut got = 0;
    while got < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(WireError::TimedOut {
                partial: *moved > 0,
            });
        }
        s.set_read_timeout(Some(left)).map_err(WireError::Io)?;
        match s.read(&mut buf[got..]) {
            Ok(0) => return Err(WireError::Closed),
            Ok(n) => {
                got += n;
                *moved += n;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if is_timeout(&e) => {
                return Err(WireError::TimedOut {
                    partial: *moved > 0,
                })
            }
            Err(e) if e.kind() == io::ErrorKind::ConnectionReset => return Err(WireError::Closed),
            Err(e) => return Err(WireError::Io(e)),
        }
    }
    Ok(())
}

/// The largest handshake message: what either side accepts from a peer not yet authenticated.
pub(crate) const MAX_HANDSHAKE: usize = 128;

/// The first allocation for a frame's payload; it doubles as more bytes arrive.
const READ_CHUNK: usize = 64 << 10;

/// The largest reply a joining rank reads before rank 0 has proved itself (a welcome, or a
/// rejection or abort with its reason).
pub(crate) const MAX_UNAUTHENTICATED: usize = 64 << 10;

/// Reads one message of at most `max` bytes, giving up at `deadline`.
pub(crate) fn read_msg_max(
    s: &mut TcpStream,
    deadline: Instant,
    max: usize,
) -> Result<Msg, WireError> {
    Msg::decode(&read_payload(s, deadline, max)?)
}

/// Reads one frame's payload of at most `max` bytes, giving up at `deadline`.
fn read_payload(s: &mut TcpStream, deadline: Instant, max: usize) -> Result<Vec<u8>, WireError> {
    let mut moved = 0;
    let mut len = [0u8; 4];
    read_exact_by(s, &mut len, deadline, &mut moved)?;
    let len = u32::from_le_bytes(len) as usize;
    if len == 0 || len > max {
        return Err(WireError::Malformed(format!(
            "frame length {len} outside 1..={max} (not an ep bootstrap peer?)"
        )));
    }
    // Grow the buffer as the bytes come, so the announced length is not allocated up front.
    let mut payload = Vec::with_capacity(len.min(READ_CHUNK));
    while payload.len() < len {
        let have = payload.len();
        let step = (len - have).min(READ_CHUNK.max(have));
        payload.resize(have + step, 0);
        read_exact_by(s, &mut payload[have..], deadline, &mut moved)?;
    }
    Ok(payload)
}

/// The integrity of one stream after its handshake: every frame carries an HMAC-SHA256 tag under
/// a key both sides derived from the job token and the handshake's nonces, over the direction, a
/// per-direction frame counter and the payload. A byte changed, a frame injected, dropped,
/// replayed or reordered by someone between the two ends fails the next read.
#[derive(Debug)]
pub(crate) struct Seal {
    key: Tag,
    /// 0 for frames rank 0 sends, 1 for frames the other rank sends.
    sends: u8,
    sent: u64,
    received: u64,
}

impl Seal {
    /// The seal of rank 0's end (`root`) or of the other rank's end of a stream, under `key`.
    pub(crate) fn new(key: Tag, root: bool) -> Self {
        Self {
            key,
            sends: u8::from(!root),
            sent: 0,
            received: 0,
        }
    }

    fn parts<'a>(dir: &'a [u8; 1], n: &'a [u8; 8], payload: &'a [u8]) -> [&'a [u8]; 4] {
        [b"ep bootstrap v2: frame", dir, n, payload]
    }
}

/// Writes an encoded frame (length prefix included) with its tag, giving up at `deadline`.
pub(crate) fn write_sealed(
    s: &mut TcpStream,
    seal: &mut Seal,
    frame: &[u8],
    deadline: Instant,
) -> Result<(), WireError> {
    let payload = &frame[4..];
    if payload.len() > MAX_FRAME {
        return Err(WireError::Malformed(format!(
            "message of {} bytes exceeds the {MAX_FRAME}-byte limit",
            payload.len()
        )));
    }
    let tag = super::token::tag(
        &seal.key,
        &Seal::parts(&[seal.sends], &seal.sent.to_le_bytes(), payload),
    );
    let mut out = Vec::with_capacity(frame.len() + tag.len());
    out.extend_from_slice(&((payload.len() + tag.len()) as u32).to_le_bytes());
    out.extend_from_slice(payload);
    out.extend_from_slice(&tag);
    write_bytes(s, &out, deadline)?;
    seal.sent += 1;
    Ok(())
}

/// Reads one sealed message, giving up at `deadline`; a tag that does not check out is
/// [`WireError::Malformed`].
pub(crate) fn read_sealed(
    s: &mut TcpStream,
    seal: &mut Seal,
    deadline: Instant,
) -> Result<Msg, WireError> {
    let raw = read_payload(s, deadline, MAX_FRAME + TAG_BYTES)?;
    if raw.len() <= TAG_BYTES {
        return Err(WireError::Malformed(format!(
            "sealed frame of {} bytes has no room for its tag",
            raw.len()
        )));
    }
    let (payload, tag) = raw.split_at(raw.len() - TAG_BYTES);
    let tag: Tag = tag.try_into().unwrap_or([0; TAG_BYTES]);
    let dir = [1 - seal.sends];
    if !super::token::tag_matches(
        &seal.key,
        &Seal::parts(&dir, &seal.received.to_le_bytes(), payload),
        &tag,
    ) {
        return Err(WireError::Malformed(format!(
            "frame #{} failed authentication: changed, injected, replayed or reordered between \
             the two ends",
            seal.received
        )));
    }
    seal.received += 1;
    Msg::decode(payload)
}

/// Bytes of a frame's tag.
const TAG_BYTES: usize = 32;

/// Writes an encoded frame, giving up at `deadline`.
pub(crate) fn write_frame(
    s: &mut TcpStream,
    frame: &[u8],
    deadline: Instant,
) -> Result<(), WireError> {
    if frame.len() - 4 > MAX_FRAME {
        return Err(WireError::Malformed(format!(
            "message of {} bytes exceeds the {MAX_FRAME}-byte limit",
            frame.len() - 4
        )));
    }
    write_bytes(s, frame, deadline)
}

/// Writes all of `frame`, giving up at `deadline`.
fn write_bytes(s: &mut TcpStream, frame: &[u8], deadline: Instant) -> Result<(), WireError> {
    let mut sent = 0;
    while sent < frame.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(WireError::TimedOut { partial: sent > 0 });
        }
        s.set_write_timeout(Some(left)).map_err(WireError::Io)?;
        match s.write(&frame[sent..]) {
            Ok(0) => return Err(WireError::Closed),
            Ok(n) => sent += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if is_timeout(&e) => return Err(WireError::TimedOut { partial: sent > 0 }),
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset
                ) =>
            {
                return Err(WireError::Closed)
            }
            Err(e) => return Err(WireError::Io(e)),
        }
    }
    Ok(())
}

/// Writes one message, giving up at `deadline`.
pub(crate) fn write_msg(s: &mut TcpStream, msg: &Msg, deadline: Instant) -> Result<(), WireError> {
    write_frame(s, &msg.encode(), deadline)
}

/// What a stream holds right now, without waiting: data, nothing yet, or end of stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pending {
    Data,
    Nothing,
    Closed,
}

pub(crate) fn pending(s: &TcpStream) -> Pending {
    if s.set_nonblocking(true).is_err() {
        return Pending::Closed;
    }
    let r = s.peek(&mut [0u8; 1]);
    let _ = s.set_nonblocking(false);
    match r {
        Ok(0) => Pending::Closed,
        Ok(_) => Pending::Data,
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => Pending::Nothing,
        Err(_) => Pending::Closed,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_message_round_trips() {
        let msgs = [
            Msg::Hello {
                authenticated: true,
                rank: 3,
                world: 8,
                nonce: [7; NONCE_BYTES],
            },
            Msg::Challenge { nonce: [8; 32] },
            Msg::Proof { tag: [9; 32] },
            Msg::Welcome { tag: [10; 32] },
            Msg::Reject {
                code: RejectCode::WorldSize,
                value: 4,
                text: "world size".into(),
            },
            Msg::Contrib {
                seq: 9,
                op: Op::AllGather,
                data: vec![1, 2, 3],
            },
            Msg::Gathered {
                seq: u64::MAX,
                op: Op::Barrier,
                parts: vec![vec![], vec![5; 100], vec![6]],
            },
            Msg::Abort {
                reason: "rank 2 timed out".into(),
            },
        ];
        for m in msgs {
            let frame = m.encode();
            let len = u32::from_le_bytes(frame[..4].try_into().unwrap()) as usize;
            assert_eq!(len, frame.len() - 4);
            assert_eq!(Msg::decode(&frame[4..]).unwrap(), m);
        }
    }

    #[test]
    fn handshake_messages_fit_the_handshake_limit() {
        for m in [
            Msg::Hello {
                authenticated: false,
                rank: u32::MAX,
                world: u32::MAX,
                nonce: [0xff; NONCE_BYTES],
            },
            Msg::Challenge { nonce: [0; 32] },
            Msg::Proof { tag: [0; 32] },
            Msg::Welcome { tag: [0; 32] },
        ] {
            assert!(m.encode().len() - 4 <= MAX_HANDSHAKE, "{m:?}");
        }
    }

    #[test]
    fn an_announced_length_is_capped_and_not_allocated_up_front() {
        use std::io::Write as _;
        use std::net::{TcpListener, TcpStream};
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut tx = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut rx, _) = l.accept().unwrap();
        let soon = || Instant::now() + std::time::Duration::from_secs(5);
        // Beyond the step's limit: refused after the 4 length bytes, before any payload.
        tx.write_all(&(MAX_HANDSHAKE as u32 + 1).to_le_bytes())
            .unwrap();
        match read_msg_max(&mut rx, soon(), MAX_HANDSHAKE) {
            Err(WireError::Malformed(m)) => assert!(m.contains("outside 1..=128"), "{m}"),
            other => panic!("{other:?}"),
        }
        // Within the limit (1 GiB) but never sent: the reader waits for bytes with a small
        // buffer and reports the close, instead of zeroing a GiB first.
        tx.write_all(&(MAX_FRAME as u32).to_le_bytes()).unwrap();
        tx.write_all(&[K_ABORT, b'x']).unwrap();
        drop(tx);
        let t = Instant::now();
        assert!(matches!(
            read_msg_max(&mut rx, soon(), MAX_FRAME),
            Err(WireError::Closed)
        ));
        assert!(
            t.elapsed() < std::time::Duration::from_secs(1),
            "{:?}",
            t.elapsed()
        );
    }

    #[test]
    fn sealed_frames_detect_tampering_replay_and_reordering() {
        use std::net::{TcpListener, TcpStream};
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut tx = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut rx, _) = l.accept().unwrap();
        let soon = || Instant::now() + std::time::Duration::from_secs(5);
        let (mut root, mut member) = (Seal::new([1; 32], true), Seal::new([1; 32], false));
        let msg = |seq| Msg::Contrib {
            seq,
            op: Op::AllGather,
            data: vec![7; 100],
        };
        // In order: fine.
        write_sealed(&mut tx, &mut member, &msg(0).encode(), soon()).unwrap();
        assert_eq!(read_sealed(&mut rx, &mut root, soon()).unwrap(), msg(0));
        // A captured frame replayed, or a frame tagged for the other direction.
        let mut replay = Seal::new([1; 32], false);
        write_sealed(&mut tx, &mut replay, &msg(0).encode(), soon()).unwrap();
        assert!(matches!(
            read_sealed(&mut rx, &mut root, soon()),
            Err(WireError::Malformed(_))
        ));
        let mut root = Seal::new([1; 32], true);
        let mut wrong_way = Seal::new([1; 32], true);
        write_sealed(&mut tx, &mut wrong_way, &msg(0).encode(), soon()).unwrap();
        assert!(matches!(
            read_sealed(&mut rx, &mut root, soon()),
            Err(WireError::Malformed(_))
        ));
        // One byte changed on the way.
        let mut root = Seal::new([1; 32], true);
        let payload = msg(1).encode();
        let tag = super::super::token::tag(
            &[1; 32],
            &Seal::parts(&[1], &0u64.to_le_bytes(), &payload[4..]),
        );
        let mut frame = ((payload.len() - 4 + TAG_BYTES) as u32)
            .to_le_bytes()
            .to_vec();
        frame.extend_from_slice(&payload[4..]);
        frame.extend_from_slice(&tag);
        let last_data = frame.len() - TAG_BYTES - 1;
        frame[last_data] ^= 1;
        write_bytes(&mut tx, &frame, soon()).unwrap();
        match read_sealed(&mut rx, &mut root, soon()) {
            Err(WireError::Malformed(m)) => assert!(m.contains("failed authentication"), "{m}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn garbage_is_malformed() {
        for bad in [
            &b"GET / HTTP/1.1"[..],
            &[K_HELLO, b'x', b'y'][..],
            &[K_CONTRIB, 0, 0][..],
            &[
                K_GATHERED, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 9, 0, 0, 0, 0, 0, 0, 0,
            ][..],
            &[K_WELCOME, b'E', b'P', b'B', b'O', b'O', b'T', b'0', b'2', 0][..],
            &[K_WELCOME, b'E', b'P', b'B', b'O', b'O', b'T', b'0', b'1'][..],
            &[
                K_HELLO, b'E', b'P', b'B', b'O', b'O', b'T', b'0', b'2', 2, 0, 0, 0, 0, 0, 0, 0, 0,
            ][..],
        ] {
            assert!(
                matches!(Msg::decode(bad), Err(WireError::Malformed(_))),
                "{bad:?}"
            );
        }
    }
}
