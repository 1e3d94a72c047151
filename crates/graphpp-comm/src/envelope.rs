//! What one rank process sends another: a point-to-point tensor, one contribution to a
//! collective, or an abort — and its byte form (docs/ARCHITECTURE.md "Runtime": Comm).
//!
//! ```text
//! offset  size   field
//! 0       2      magic b"GE"
//! 2       1      format version (1)
//! 3       1      kind: 0 message, 1 contribution, 2 abort
//! message:       tag kind u8 (0 activation, 1 gradient, 2 gather), stage u64, mb u64, tensor (wire form)
//! contribution:  op u8 (CollectiveOp code), seq u64, group name (u32 length + UTF-8),
//!                ranks (u32 count + u64 each), has-tensor u8, tensor (wire form) when 1
//! abort:         reason (u32 length + UTF-8)
//! ```
//!
//! Integers are little-endian; the tensor is [`super::wire`]'s form and runs to the end of the
//! buffer. A contribution to an all-to-all carries only the rows cut for the receiver; one to a
//! barrier carries no tensor.

use candle_core::Tensor;

use super::wire::{self, WireError};
use super::{CollectiveOp, CommError, Group, Tag};

/// First two bytes of every envelope.
pub const MAGIC: [u8; 2] = *b"GE";
/// The format version this build writes and reads.
pub const VERSION: u8 = 1;

/// Collective codes in the byte form, in [`CollectiveOp`] declaration order.
const OPS: [CollectiveOp; 5] = [
    CollectiveOp::AllReduce,
    CollectiveOp::AllGather,
    CollectiveOp::ReduceScatter,
    CollectiveOp::AllToAll,
    CollectiveOp::Barrier,
];

/// One message between rank processes.
#[derive(Clone, Debug)]
pub enum Envelope {
    /// A point-to-point tensor under `tag`.
    Message {
        /// Its tag.
        tag: Tag,
        /// The tensor.
        tensor: Tensor,
    },
    /// The sender's contribution to call number `seq` of `op` on `group`.
    Contribution {
        /// The collective.
        op: CollectiveOp,
        /// The group.
        group: Group,
        /// The call's sequence number on the group (counted by the sender).
        seq: u64,
        /// The tensor (for an all-to-all, the rows for the receiver); `None` for a barrier.
        tensor: Option<Tensor>,
    },
    /// The sender failed and tells every rank to stop.
    Abort {
        /// Its reason.
        reason: String,
    },
}

fn bad(message: impl Into<String>) -> CommError {
    WireError::Envelope { message: message.into() }.into()
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u32).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

impl Envelope {
    /// The byte form (see the module doc).
    ///
    /// # Errors
    /// [`CommError::Wire`] for a tensor the wire form cannot carry.
    pub fn encode(&self) -> Result<Vec<u8>, CommError> {
        let mut out = Vec::with_capacity(64);
        out.extend_from_slice(&MAGIC);
        out.push(VERSION);
        match self {
            Envelope::Message { tag, tensor } => {
                out.push(0);
                let (kind, a, b) = match *tag {
                    Tag::Activation { stage, mb } => (0, stage, mb),
                    Tag::Gradient { stage, mb } => (1, stage, mb),
                    Tag::Gather { what, item } => (2, usize::from(what), item),
                };
                out.push(kind);
                out.extend_from_slice(&(a as u64).to_le_bytes());
                out.extend_from_slice(&(b as u64).to_le_bytes());
                out.extend_from_slice(&wire::encode(tensor)?);
            }
            Envelope::Contribution { op, group, seq, tensor } => {
                out.push(1);
                // Every op is in OPS.
                out.push(OPS.iter().position(|o| o == op).unwrap_or(0) as u8);
                out.extend_from_slice(&seq.to_le_bytes());
                put_str(&mut out, group.name());
                out.extend_from_slice(&(group.size() as u32).to_le_bytes());
                for &r in group.ranks() {
                    out.extend_from_slice(&(r as u64).to_le_bytes());
                }
                match tensor {
                    Some(t) => {
                        out.push(1);
                        out.extend_from_slice(&wire::encode(t)?);
                    }
                    None => out.push(0),
                }
            }
            Envelope::Abort { reason } => {
                out.push(2);
                put_str(&mut out, reason);
            }
        }
        Ok(out)
    }

    /// The envelope whose byte form is `buf`.
    ///
    /// # Errors
    /// [`CommError::Wire`]: [`WireError::Envelope`] naming what is malformed (magic, version,
    /// kind, a truncated field, a bad group), or the tensor's own wire errors.
    pub fn decode(buf: &[u8]) -> Result<Envelope, CommError> {
        let mut r = Reader { buf, at: 0 };
        let magic = [r.u8()?, r.u8()?];
        if magic != MAGIC {
            return Err(bad(format!("starts with {magic:?}, expected {MAGIC:?} (\"GE\")")));
        }
        let version = r.u8()?;
        if version != VERSION {
            return Err(bad(format!("format version {version}; this build reads version {VERSION}")));
        }
        match r.u8()? {
            0 => {
                let kind = r.u8()?;
                let (a, b) = (r.usize()?, r.usize()?);
                let tag = match kind {
                    0 => Tag::Activation { stage: a, mb: b },
                    1 => Tag::Gradient { stage: a, mb: b },
                    2 => Tag::Gather {
                        what: u8::try_from(a).map_err(|_| bad(format!("gather code {a} is over 255")))?,
                        item: b,
                    },
                    k => return Err(bad(format!("unknown tag kind {k}"))),
                };
                Ok(Envelope::Message { tag, tensor: wire::decode(r.rest())? })
            }
            1 => {
                let code = r.u8()?;
                let op =
                    *OPS.get(code as usize).ok_or_else(|| bad(format!("unknown collective code {code}")))?;
                let seq = r.u64()?;
                let name = r.string()?;
                let n = r.u32()? as usize;
                if n > buf.len() / 8 {
                    return Err(bad(format!("group `{name}` claims {n} ranks in {} bytes", buf.len())));
                }
                let ranks = (0..n).map(|_| r.usize()).collect::<Result<Vec<_>, _>>()?;
                let group = Group::new(name, ranks)?;
                let tensor = match r.u8()? {
                    0 if r.rest().is_empty() => None,
                    0 => return Err(bad("bytes after a contribution without a tensor")),
                    1 => Some(wire::decode(r.rest())?),
                    f => return Err(bad(format!("has-tensor flag {f}"))),
                };
                Ok(Envelope::Contribution { op, group, seq, tensor })
            }
            2 => {
                let reason = r.string()?;
                if !r.rest().is_empty() {
                    return Err(bad("bytes after an abort's reason"));
                }
                Ok(Envelope::Abort { reason })
            }
            k => Err(bad(format!("unknown envelope kind {k}"))),
        }
    }
}

/// A cursor over a buffer; every read checks the length.
struct Reader<'a> {
    buf: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], CommError> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.buf.len());
        let end = end.ok_or_else(|| bad(format!("truncated: {n} bytes needed at offset {}", self.at)))?;
        let s = &self.buf[self.at..end];
        self.at = end;
        Ok(s)
    }

    fn u8(&mut self) -> Result<u8, CommError> {
        Ok(self.take(1)?[0])
    }

    fn u32(&mut self) -> Result<u32, CommError> {
        let mut a = [0u8; 4];
        a.copy_from_slice(self.take(4)?);
        Ok(u32::from_le_bytes(a))
    }

    fn u64(&mut self) -> Result<u64, CommError> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(a))
    }

    fn usize(&mut self) -> Result<usize, CommError> {
        let v = self.u64()?;
        usize::try_from(v).map_err(|_| bad(format!("value {v} out of range")))
    }

    fn string(&mut self) -> Result<String, CommError> {
        let n = self.u32()? as usize;
        String::from_utf8(self.take(n)?.to_vec()).map_err(|_| bad("a string is not UTF-8"))
    }

    fn rest(&mut self) -> &'a [u8] {
        let s = &self.buf[self.at..];
        self.at = self.buf.len();
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn roundtrip(e: &Envelope) -> Envelope {
        Envelope::decode(&e.encode().unwrap()).unwrap()
    }

    #[test]
    fn every_kind_round_trips() {
        let t = Tensor::new(&[[1f32, -2.5], [3.0, 4.0]], &Device::Cpu).unwrap();
        let tag = Tag::Gradient { stage: 3, mb: 7 };
        match roundtrip(&Envelope::Message { tag, tensor: t.clone() }) {
            Envelope::Message { tag: got, tensor } => {
                assert_eq!(got, tag);
                assert_eq!(tensor.to_vec2::<f32>().unwrap(), vec![vec![1.0, -2.5], vec![3.0, 4.0]]);
            }
            other => panic!("{other:?}"),
        }
        let group = Group::new("copies.x", vec![3, 0]).unwrap();
        for (op, tensor) in [(CollectiveOp::ReduceScatter, Some(t.clone())), (CollectiveOp::Barrier, None)] {
            match roundtrip(&Envelope::Contribution { op, group: group.clone(), seq: 41, tensor }) {
                Envelope::Contribution { op: o, group: g, seq, tensor } => {
                    assert_eq!((o, &g, seq), (op, &group, 41));
                    assert_eq!(
                        tensor.map(|t| t.dims().to_vec()),
                        (op != CollectiveOp::Barrier).then(|| vec![2, 2])
                    );
                }
                other => panic!("{other:?}"),
            }
        }
        match roundtrip(&Envelope::Abort { reason: "rank 2: NaN loss".into() }) {
            Envelope::Abort { reason } => assert_eq!(reason, "rank 2: NaN loss"),
            other => panic!("{other:?}"),
        }
    }

    fn envelope_err(buf: &[u8]) -> String {
        match Envelope::decode(buf) {
            Err(CommError::Wire(WireError::Envelope { message })) => message,
            other => panic!("expected an envelope error, got {other:?}"),
        }
    }

    #[test]
    fn malformed_envelopes_are_named() {
        let abort = Envelope::Abort { reason: "x".into() }.encode().unwrap();
        assert!(envelope_err(&abort[..abort.len() - 1]).contains("truncated"));
        let mut v = abort.clone();
        v[2] = 9;
        assert!(envelope_err(&v).contains("version 9"));
        let mut v = abort.clone();
        v[3] = 5;
        assert!(envelope_err(&v).contains("unknown envelope kind 5"));
        let mut v = abort.clone();
        v.push(0);
        assert!(envelope_err(&v).contains("after an abort"));
        assert!(envelope_err(b"GP\x01").contains("expected"));
        let g = Group::new("dp", vec![0, 1]).unwrap();
        let mut v = Envelope::Contribution { op: CollectiveOp::Barrier, group: g, seq: 0, tensor: None }
            .encode()
            .unwrap();
        v[4] = 17;
        assert!(envelope_err(&v).contains("unknown collective code 17"));
    }
}
