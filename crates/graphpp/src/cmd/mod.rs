//! The subcommands, plus [`emit`], the one way they write to standard output.

pub mod compare;
pub mod graph;
pub mod schedule;
pub mod train;
pub mod verify;

use std::io::Write;

/// Writes `text` to standard output. A closed pipe (`graphpp … | head`) ends the output quietly
/// instead of panicking; other write errors are returned.
pub fn emit(text: &str) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|_| out.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        other => Ok(other?),
    }
}
