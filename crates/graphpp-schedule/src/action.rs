//! Schedule IR actions and their text form.
//!
//! The text form is PyTorch-compatible (`torch.distributed.pipelining`, `_Action.__repr__` /
//! `_Action.from_str`): `{stage}{KIND}{microbatch}` for per-microbatch actions (`0F1`, `2I1`, `1W0`,
//! `3B2`, `1SEND_F3`, `2RECV_B0`, `1WAIT_SEND_F3`), `{stage}{KIND}` for stage-level actions
//! (`0UNSHARD`, `0RESHARD`, `0REDUCE_GRAD`, `0WAIT_REDUCE_GRAD`) and `({f};{b})OVERLAP_F_B` for an
//! overlapped forward/backward pair. The WAIT_* kinds are PyTorch 2.15's completion waits of an
//! asynchronous send or gradient reduction (its lowered schedules hold one after every SEND and
//! REDUCE_GRAD).
//! Like PyTorch, whitespace around the text and around each half of an overlapped pair is ignored
//! (`(0F3; 3B1)OVERLAP_F_B`); unlike PyTorch, trailing junk (`2BW0`) is rejected (docs/ARCHITECTURE.md,
//! "Schedule IR").

use std::fmt;
use std::str::FromStr;

/// Index of a pipeline stage (`0..S`).
pub type StageId = usize;
/// Index of a microbatch (`0..m`).
pub type MicrobatchId = usize;

/// A compute kind on one (stage, microbatch).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ComputeKind {
    /// Forward.
    F,
    /// Full backward (input and weight gradients together).
    B,
    /// Backward for the stage input only (dI; "B" in the zero-bubble papers).
    I,
    /// Backward for the weights only (dW), runs after the matching `I`.
    W,
}

/// A point-to-point communication kind on one (stage, microbatch).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum CommKind {
    /// Send the forward output of `stage` to the rank holding `stage + 1`.
    SendF,
    /// Receive the forward input of `stage` from the rank holding `stage - 1`.
    RecvF,
    /// Send the input gradient of `stage` to the rank holding `stage - 1`.
    SendB,
    /// Receive the output gradient of `stage` from the rank holding `stage + 1`.
    RecvB,
    /// Wait until the `SendF` of the same (stage, microbatch) has completed, i.e. the rank holding
    /// `stage + 1` has received it (PyTorch's `WAIT_SEND_F`: the send buffer may be reused).
    WaitSendF,
    /// Wait until the `SendB` of the same (stage, microbatch) has been received by the rank
    /// holding `stage - 1` (PyTorch's `WAIT_SEND_B`).
    WaitSendB,
}

impl CommKind {
    /// The SEND a WAIT_SEND waits for; `None` for the four transfers themselves.
    pub fn waits_for(self) -> Option<CommKind> {
        match self {
            CommKind::WaitSendF => Some(CommKind::SendF),
            CommKind::WaitSendB => Some(CommKind::SendB),
            _ => None,
        }
    }
}

/// A stage-level action (no microbatch): FSDP parameter and gradient handling.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum StageOpKind {
    /// All-gather the stage's sharded parameters.
    Unshard,
    /// Free the stage's unsharded parameters.
    Reshard,
    /// Reduce-scatter the stage's accumulated gradients.
    ReduceGrad,
    /// Wait until the stage's REDUCE_GRAD has completed (PyTorch's `WAIT_REDUCE_GRAD`).
    WaitReduceGrad,
}

/// One (stage, microbatch) pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Task {
    /// Stage index.
    pub stage: StageId,
    /// Microbatch index.
    pub mb: MicrobatchId,
}

impl Task {
    /// Shorthand constructor.
    pub fn new(stage: StageId, mb: MicrobatchId) -> Self {
        Task { stage, mb }
    }
}

/// One action of a rank's program.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Action {
    /// F, B, I or W of one (stage, microbatch).
    Compute {
        /// What runs.
        kind: ComputeKind,
        /// On which (stage, microbatch).
        task: Task,
    },
    /// Forward of `f` and full backward of `b` as one multiplexed graph (DualPipe's F&B).
    Overlap {
        /// The forward half.
        f: Task,
        /// The full-backward half.
        b: Task,
    },
    /// SEND/RECV of an activation or a gradient, or the wait for a SEND's completion.
    Comm {
        /// Which transfer.
        kind: CommKind,
        /// The (stage, microbatch) whose tensor moves (see [`CommKind`]).
        task: Task,
    },
    /// UNSHARD / RESHARD / REDUCE_GRAD / WAIT_REDUCE_GRAD of a stage.
    StageOp {
        /// Which operation.
        kind: StageOpKind,
        /// On which stage.
        stage: StageId,
    },
}

impl Action {
    /// A compute action.
    pub fn compute(kind: ComputeKind, stage: StageId, mb: MicrobatchId) -> Self {
        Action::Compute { kind, task: Task::new(stage, mb) }
    }
    /// `{stage}F{mb}`.
    pub fn f(stage: StageId, mb: MicrobatchId) -> Self {
        Self::compute(ComputeKind::F, stage, mb)
    }
    /// `{stage}B{mb}`.
    pub fn b(stage: StageId, mb: MicrobatchId) -> Self {
        Self::compute(ComputeKind::B, stage, mb)
    }
    /// `{stage}I{mb}`.
    pub fn i(stage: StageId, mb: MicrobatchId) -> Self {
        Self::compute(ComputeKind::I, stage, mb)
    }
    /// `{stage}W{mb}`.
    pub fn w(stage: StageId, mb: MicrobatchId) -> Self {
        Self::compute(ComputeKind::W, stage, mb)
    }
    /// `({f})` overlapped with `({b})`: `(0F7;7B3)OVERLAP_F_B`.
    pub fn overlap(f: Task, b: Task) -> Self {
        Action::Overlap { f, b }
    }
    /// A SEND/RECV action.
    pub fn comm(kind: CommKind, stage: StageId, mb: MicrobatchId) -> Self {
        Action::Comm { kind, task: Task::new(stage, mb) }
    }
    /// A stage-level action.
    pub fn stage_op(kind: StageOpKind, stage: StageId) -> Self {
        Action::StageOp { kind, stage }
    }

    /// True for F/B/I/W and OVERLAP_F_B (the actions of a compute-only schedule).
    pub fn is_compute(&self) -> bool {
        matches!(self, Action::Compute { .. } | Action::Overlap { .. })
    }

    /// The compute (kind, task) pairs this action performs: one for F/B/I/W, two (F then B) for
    /// OVERLAP_F_B, none for communication and stage-level actions.
    pub fn computes(&self) -> impl Iterator<Item = (ComputeKind, Task)> {
        let (a, b) = match *self {
            Action::Compute { kind, task } => (Some((kind, task)), None),
            Action::Overlap { f, b } => (Some((ComputeKind::F, f)), Some((ComputeKind::B, b))),
            _ => (None, None),
        };
        a.into_iter().chain(b)
    }

    /// Every stage this action touches.
    pub fn stages(&self) -> impl Iterator<Item = StageId> {
        let (a, b) = match *self {
            Action::Compute { task, .. } | Action::Comm { task, .. } => (task.stage, None),
            Action::Overlap { f, b } => (f.stage, Some(b.stage)),
            Action::StageOp { stage, .. } => (stage, None),
        };
        std::iter::once(a).chain(b)
    }
}

impl fmt::Display for ComputeKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ComputeKind::F => "F",
            ComputeKind::B => "B",
            ComputeKind::I => "I",
            ComputeKind::W => "W",
        })
    }
}

impl fmt::Display for CommKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CommKind::SendF => "SEND_F",
            CommKind::RecvF => "RECV_F",
            CommKind::SendB => "SEND_B",
            CommKind::RecvB => "RECV_B",
            CommKind::WaitSendF => "WAIT_SEND_F",
            CommKind::WaitSendB => "WAIT_SEND_B",
        })
    }
}

impl fmt::Display for StageOpKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            StageOpKind::Unshard => "UNSHARD",
            StageOpKind::Reshard => "RESHARD",
            StageOpKind::ReduceGrad => "REDUCE_GRAD",
            StageOpKind::WaitReduceGrad => "WAIT_REDUCE_GRAD",
        })
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Action::Compute { kind, task } => write!(f, "{}{}{}", task.stage, kind, task.mb),
            Action::Overlap { f: fw, b } => {
                write!(f, "({}F{};{}B{})OVERLAP_F_B", fw.stage, fw.mb, b.stage, b.mb)
            }
            Action::Comm { kind, task } => write!(f, "{}{}{}", task.stage, kind, task.mb),
            Action::StageOp { kind, stage } => write!(f, "{stage}{kind}"),
        }
    }
}

/// Why an action's text did not parse; `column` is the 1-based character offset inside the text.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("column {column}: {message} in action `{text}`")]
pub struct ActionParseError {
    /// The whole text that was being parsed.
    pub text: String,
    /// 1-based column (character) where the problem starts.
    pub column: usize,
    /// What is wrong.
    pub message: String,
}

/// Kinds that carry a microbatch, longest first so that `SEND_F` wins over `F`.
const MB_KINDS: [&str; 10] =
    ["WAIT_SEND_F", "WAIT_SEND_B", "SEND_F", "RECV_F", "SEND_B", "RECV_B", "F", "B", "I", "W"];
const STAGE_KINDS: [&str; 4] = ["UNSHARD", "RESHARD", "REDUCE_GRAD", "WAIT_REDUCE_GRAD"];
const OVERLAP_SUFFIX: &str = ")OVERLAP_F_B";

struct Cursor<'a> {
    text: &'a str,
    pos: usize,
    base: usize,
}

impl<'a> Cursor<'a> {
    fn err(&self, at: usize, message: impl Into<String>) -> ActionParseError {
        ActionParseError { text: self.text.to_string(), column: self.base + at + 1, message: message.into() }
    }
    fn rest(&self) -> &'a str {
        &self.text[self.pos..]
    }
    fn number(&mut self, what: &str) -> Result<usize, ActionParseError> {
        let digits = self.rest().bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 {
            return Err(self.err(self.pos, format!("expected a {what} number")));
        }
        let s = &self.rest()[..digits];
        let n = s.parse().map_err(|_| self.err(self.pos, format!("{what} number `{s}` is too large")))?;
        self.pos += digits;
        Ok(n)
    }
}

fn parse_simple(text: &str, base: usize) -> Result<Action, ActionParseError> {
    let mut c = Cursor { text, pos: 0, base };
    let stage = c.number("stage")?;
    let rest = c.rest();
    if let Some(kind) = STAGE_KINDS.iter().find(|k| rest.starts_with(**k)) {
        c.pos += kind.len();
        if !c.rest().is_empty() {
            return Err(c.err(c.pos, format!("trailing text `{}`", c.rest())));
        }
        let kind = match *kind {
            "UNSHARD" => StageOpKind::Unshard,
            "RESHARD" => StageOpKind::Reshard,
            "REDUCE_GRAD" => StageOpKind::ReduceGrad,
            _ => StageOpKind::WaitReduceGrad,
        };
        return Ok(Action::StageOp { kind, stage });
    }
    let Some(kind) = MB_KINDS.iter().find(|k| rest.starts_with(**k)) else {
        return Err(c.err(c.pos, format!("unknown action kind `{rest}`")));
    };
    c.pos += kind.len();
    let mb = c.number("microbatch")?;
    if !c.rest().is_empty() {
        return Err(c.err(c.pos, format!("trailing text `{}`", c.rest())));
    }
    let task = Task { stage, mb };
    Ok(match *kind {
        "F" => Action::Compute { kind: ComputeKind::F, task },
        "B" => Action::Compute { kind: ComputeKind::B, task },
        "I" => Action::Compute { kind: ComputeKind::I, task },
        "W" => Action::Compute { kind: ComputeKind::W, task },
        "SEND_F" => Action::Comm { kind: CommKind::SendF, task },
        "RECV_F" => Action::Comm { kind: CommKind::RecvF, task },
        "SEND_B" => Action::Comm { kind: CommKind::SendB, task },
        "RECV_B" => Action::Comm { kind: CommKind::RecvB, task },
        "WAIT_SEND_F" => Action::Comm { kind: CommKind::WaitSendF, task },
        _ => Action::Comm { kind: CommKind::WaitSendB, task },
    })
}

fn parse_overlap(text: &str) -> Result<Action, ActionParseError> {
    let err =
        |col: usize, m: &str| ActionParseError { text: text.to_string(), column: col + 1, message: m.into() };
    let Some(end) = text.find(')') else {
        return Err(err(0, "unclosed `(`"));
    };
    if &text[end..] != OVERLAP_SUFFIX {
        return Err(err(end, "expected `)OVERLAP_F_B` after an overlapped pair"));
    }
    let inner = &text[1..end];
    let Some(semi) = inner.find(';') else {
        return Err(err(1, "expected `;` between the forward and the backward of OVERLAP_F_B"));
    };
    // Whitespace around each half is allowed, as PyTorch strips it: `(0F3; 3B1)OVERLAP_F_B`.
    let half = |part: &str, base: usize| {
        let lead = part.len() - part.trim_start().len();
        parse_simple(part.trim(), base + lead).map_err(|e| ActionParseError { text: text.into(), ..e })
    };
    let first = half(&inner[..semi], 1)?;
    let second = half(&inner[semi + 1..], semi + 2)?;
    match (first, second) {
        (
            Action::Compute { kind: ComputeKind::F, task: f },
            Action::Compute { kind: ComputeKind::B, task: b },
        ) => Ok(Action::Overlap { f, b }),
        _ => Err(err(1, "OVERLAP_F_B pairs a forward (F) with a full backward (B), in that order")),
    }
}

impl FromStr for Action {
    type Err = ActionParseError;

    /// Parses the text form (surrounding whitespace allowed); see the module docs.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let lead = s.len() - s.trim_start().len();
        let t = s.trim();
        let shift = |e: ActionParseError| ActionParseError { column: e.column + lead, ..e };
        if t.starts_with('(') {
            parse_overlap(t).map_err(shift)
        } else {
            parse_simple(t, 0).map_err(shift)
        }
    }
}

impl serde::Serialize for Action {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for Action {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_every_kind() {
        for t in [
            "0F1",
            "2I1",
            "1W0",
            "3B2",
            "1SEND_F3",
            "2RECV_B0",
            "4SEND_B12",
            "5RECV_F7",
            "0UNSHARD",
            "0RESHARD",
            "10REDUCE_GRAD",
            "4WAIT_SEND_F0",
            "2WAIT_SEND_B11",
            "5WAIT_REDUCE_GRAD",
            "(0F7;7B3)OVERLAP_F_B",
        ] {
            let a: Action = t.parse().unwrap();
            assert_eq!(a.to_string(), t);
        }
    }

    #[test]
    fn parses_to_the_right_fields() {
        assert_eq!("12W34".parse::<Action>().unwrap(), Action::w(12, 34));
        assert_eq!(
            "(1F6;6B2)OVERLAP_F_B".parse::<Action>().unwrap(),
            Action::overlap(Task::new(1, 6), Task::new(6, 2))
        );
        assert_eq!("3SEND_B2".parse::<Action>().unwrap(), Action::comm(CommKind::SendB, 3, 2));
        assert_eq!("4WAIT_SEND_F0".parse::<Action>().unwrap(), Action::comm(CommKind::WaitSendF, 4, 0));
        assert_eq!("1WAIT_SEND_B7".parse::<Action>().unwrap(), Action::comm(CommKind::WaitSendB, 1, 7));
        assert_eq!(
            "5WAIT_REDUCE_GRAD".parse::<Action>().unwrap(),
            Action::stage_op(StageOpKind::WaitReduceGrad, 5)
        );
    }

    #[test]
    fn rejects_trailing_junk_with_column() {
        let e = "2BW0".parse::<Action>().unwrap_err();
        assert_eq!(e.column, 3);
        assert!(e.message.contains("microbatch"), "{e}");
        let e = "0UNSHARD1".parse::<Action>().unwrap_err();
        assert_eq!(e.column, 9);
        let e = "0F1x".parse::<Action>().unwrap_err();
        assert_eq!(e.column, 4);
    }

    #[test]
    fn overlap_halves_may_have_spaces_around_them() {
        let want = Action::overlap(Task::new(0, 3), Task::new(3, 1));
        for t in ["(0F3; 3B1)OVERLAP_F_B", "( 0F3 ;3B1 )OVERLAP_F_B", " (0F3;\t3B1)OVERLAP_F_B "] {
            assert_eq!(t.parse::<Action>().unwrap(), want, "{t}");
        }
        // Columns still point into the original text: `x` is the 8th character.
        let e = "(0F3; 3Bx)OVERLAP_F_B".parse::<Action>().unwrap_err();
        assert_eq!(e.column, 9, "{e}");
        assert!(e.message.contains("microbatch"), "{e}");
        // Spaces inside a half, or before OVERLAP_F_B, stay errors (PyTorch rejects them too).
        assert_eq!("(0 F3;3B1)OVERLAP_F_B".parse::<Action>().unwrap_err().column, 3);
        assert!("(0F3;3B1) OVERLAP_F_B".parse::<Action>().is_err());
    }

    #[test]
    fn rejects_malformed() {
        for (t, col) in [
            ("F1", 1),
            ("0X1", 2),
            ("0F", 3),
            ("(0F1;1W2)OVERLAP_F_B", 2),
            ("(0F1;1B2", 1),
            ("(0F1;1B2)X", 9),
        ] {
            let e = t.parse::<Action>().unwrap_err();
            assert_eq!(e.column, col, "{t}: {e}");
        }
    }
}
