//! Stopping a training run on SIGINT / SIGTERM without losing work, as Megatron-LM's exit-signal
//! handler does (`--exit-signal-handler`): the first signal asks the run to stop at the end of
//! the current step (the run then writes a checkpoint and exits with 128 + the signal number:
//! 130 for SIGINT, 143 for SIGTERM); a second signal exits at once with the same status. Every
//! file a run writes is written atomically (temporary file, then rename), so exiting at any
//! point leaves only complete checkpoints.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use signal_hook::consts::{SIGINT, SIGTERM};

/// A signal that asked the run to stop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopSignal {
    /// SIGINT (Ctrl-C).
    Interrupt,
    /// SIGTERM (a cluster scheduler's preemption, `kill`).
    Terminate,
}

impl StopSignal {
    /// The signal's number.
    pub fn number(self) -> i32 {
        match self {
            StopSignal::Interrupt => SIGINT,
            StopSignal::Terminate => SIGTERM,
        }
    }

    /// The shell's exit status for a process ended by this signal: 128 + its number.
    pub fn exit_status(self) -> i32 {
        128 + self.number()
    }

    /// What a process stopped by a second signal says on standard error before it exits: that
    /// it did not finish the step or the checkpoint in progress, and that the checkpoints
    /// already in the folder are complete (each is written to a temporary file and renamed).
    pub fn second_signal_line(self) -> &'static [u8] {
        match self {
            StopSignal::Interrupt => {
                b"graphpp: a second stop signal (SIGINT): exiting at once (130); the step or checkpoint in progress is dropped, the checkpoints already written are complete\n"
            }
            StopSignal::Terminate => {
                b"graphpp: a second stop signal (SIGTERM): exiting at once (143); the step or checkpoint in progress is dropped, the checkpoints already written are complete\n"
            }
        }
    }

    /// `SIGINT` or `SIGTERM`.
    pub fn name(self) -> &'static str {
        match self {
            StopSignal::Interrupt => "SIGINT",
            StopSignal::Terminate => "SIGTERM",
        }
    }
}

/// Set by the signal handlers; read by the training loop after each step.
#[derive(Debug, Clone)]
pub struct StopRequest {
    /// The number of the first signal received, 0 before any.
    signal: Arc<AtomicUsize>,
}

impl StopRequest {
    /// Installs the handlers for SIGINT and SIGTERM: the first records the signal, the second
    /// writes one line to standard error ([`StopSignal::second_signal_line`]) and exits the
    /// process at once with status 128 + its number.
    ///
    /// # Errors
    /// The OS refused to install a handler.
    pub fn install() -> std::io::Result<StopRequest> {
        let seen = Arc::new(AtomicBool::new(false));
        let signal = Arc::new(AtomicUsize::new(0));
        for s in [StopSignal::Interrupt, StopSignal::Terminate] {
            // Handlers run in registration order: the exit checks the flag before it is set, so
            // only a second signal exits.
            let (status, line, first) = (s.exit_status(), s.second_signal_line(), seen.clone());
            let exit_on_second = move || {
                if first.load(Ordering::SeqCst) {
                    // SAFETY: write(2) and _exit(2) are async-signal-safe; `line` is 'static.
                    unsafe { libc::write(2, line.as_ptr().cast(), line.len()) };
                    signal_hook::low_level::exit(status);
                }
            };
            // SAFETY: the action only loads an atomic, writes and exits (async-signal-safe).
            unsafe { signal_hook::low_level::register(s.number(), exit_on_second) }?;
            signal_hook::flag::register_usize(s.number(), signal.clone(), s.number() as usize)?;
            signal_hook::flag::register(s.number(), seen.clone())?;
        }
        Ok(StopRequest { signal })
    }

    /// The first signal received so far, if any.
    pub fn requested(&self) -> Option<StopSignal> {
        match self.signal.load(Ordering::SeqCst) as i32 {
            SIGINT => Some(StopSignal::Interrupt),
            SIGTERM => Some(StopSignal::Terminate),
            _ => None,
        }
    }
}

/// A run that stopped early on a signal after saving its work; the binary exits with
/// [`StopSignal::exit_status`].
#[derive(Debug, thiserror::Error)]
#[error("stopped by {} after step {step}{}", signal.name(), saved_text(.saved))]
pub struct Interrupted {
    /// The signal.
    pub signal: StopSignal,
    /// The last step completed.
    pub step: u64,
    /// The checkpoint written for that step, if the run has a checkpoint folder.
    pub saved: Option<std::path::PathBuf>,
}

fn saved_text(saved: &Option<std::path::PathBuf>) -> String {
    match saved {
        Some(p) => format!("; checkpoint {} written (continue with --resume)", p.display()),
        None => "; no --checkpoint-dir, so nothing was saved".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_statuses_follow_the_shell_convention() {
        assert_eq!(StopSignal::Interrupt.exit_status(), 130);
        assert_eq!(StopSignal::Terminate.exit_status(), 143);
        let e = Interrupted { signal: StopSignal::Terminate, step: 7, saved: None };
        assert_eq!(
            e.to_string(),
            "stopped by SIGTERM after step 7; no --checkpoint-dir, so nothing was saved"
        );
    }

    #[test]
    fn a_raised_signal_is_recorded_not_fatal() {
        let stop = StopRequest::install().unwrap();
        assert_eq!(stop.requested(), None);
        signal_hook::low_level::raise(SIGINT).unwrap();
        assert_eq!(stop.requested(), Some(StopSignal::Interrupt));
    }
}
