//! The per-step record of a training run: kept in memory (for the run report) and, with
//! `--metrics PATH`, written as one JSON line per step. A resumed run cuts the file back to the
//! checkpoint's step first, so every step appears once however often the run was stopped.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// One optimizer step as logged.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepRecord {
    /// Step number, from 1.
    pub step: u64,
    /// Mean training loss of the step (nats per token).
    pub loss: f64,
    /// Learning rate used by the step.
    pub lr: f64,
    /// Global gradient L2 norm before clipping.
    pub grad_norm: f64,
    /// Wall time of the step, seconds.
    pub step_s: f64,
    /// Tokens per second of the step.
    pub tokens_per_s: f64,
    /// Seconds since this process began training.
    pub elapsed_s: f64,
    /// Validation loss (nats per token), at evaluation steps.
    pub val_loss: Option<f64>,
    /// Peak memory of each rank during the step, bytes (parameters, gradients, AdamW moments and
    /// the activation peak; see `graphpp_runtime::StepReport::peak_bytes`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_bytes: Option<Vec<u64>>,
    /// Resident training state of each rank, bytes (parameters, gradients, AdamW moments; with
    /// FSDP the shards; see `graphpp_runtime::StepReport::resident_bytes`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resident_bytes: Option<Vec<u64>>,
    /// Seconds each rank of the leader's process was blocked at the iteration boundary (the
    /// world-wide loss and gradient-norm reductions; see
    /// `graphpp_runtime::StepReport::boundary_wait_s`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boundary_wait_s: Option<Vec<f64>>,
    /// Achieved model FLOP/s of the step (`graphpp_models::flops_per_token` × tokens/s).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flops_per_s: Option<f64>,
    /// The MoE auxiliary balance loss of the step (a model with `aux_loss_alpha` > 0; see
    /// `graphpp_runtime::StepReport::aux_loss`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub aux_loss: Option<f64>,
    /// The multi-token-prediction cross-entropy of the step (a model with `mtp_loss_weight` > 0;
    /// see `graphpp_runtime::StepStats::mtp_loss`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mtp_loss: Option<f64>,
}

/// Errors of the metrics file, naming it.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    /// Reading or writing failed.
    #[error("--metrics {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A line of an existing file (kept on resume) is not a step record.
    #[error("--metrics {path}, line {line}: not a step record: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// Why.
        message: String,
    },
}

/// The run's step records, and the file they go to.
#[derive(Debug, Default)]
pub struct MetricsLog {
    records: Vec<StepRecord>,
    file: Option<(PathBuf, std::io::LineWriter<std::fs::File>)>,
}

impl MetricsLog {
    /// A log with no file.
    pub fn in_memory() -> Self {
        MetricsLog::default()
    }

    /// Opens `path` for a run that starts after step `resumed_at`: 0 truncates the file; a
    /// resumed run keeps (and loads) the records of steps `1..=resumed_at` and drops the later
    /// ones — those of the stopped run after its last checkpoint. Kept lines are written back as
    /// they were, byte for byte. A last line without its line end that does not parse is a
    /// write the stopped run did not finish (a full disk, a kill): it is dropped with a warning
    /// on standard error. The file is rewritten atomically before anything is appended.
    ///
    /// # Errors
    /// [`MetricsError::Io`] (cannot read or write), [`MetricsError::Parse`] (an existing line
    /// that is not a record, other than a torn last one).
    pub fn open(path: &Path, resumed_at: u64) -> Result<Self, MetricsError> {
        let io = |source| MetricsError::Io { path: path.to_path_buf(), source };
        let mut records = Vec::new();
        let mut kept = Vec::new();
        if resumed_at > 0 && path.exists() {
            let text = std::fs::read_to_string(path).map_err(io)?;
            let lines: Vec<&str> = text.lines().collect();
            let torn_last = !text.is_empty() && !text.ends_with('\n');
            for (i, line) in lines.iter().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
                let r: StepRecord = match serde_json::from_str(line) {
                    Ok(r) => r,
                    Err(_) if torn_last && i + 1 == lines.len() => {
                        eprintln!(
                            "warning: --metrics {}, line {}: an unfinished last line (the stopped run's last write) is dropped",
                            path.display(),
                            i + 1
                        );
                        continue;
                    }
                    Err(e) => {
                        return Err(MetricsError::Parse {
                            path: path.to_path_buf(),
                            line: i + 1,
                            message: e.to_string(),
                        })
                    }
                };
                if r.step <= resumed_at {
                    records.push(r);
                    writeln!(kept, "{line}").map_err(io)?;
                }
            }
        }
        crate::checkpoint::write_file_atomic(path, &kept).map_err(io)?;
        let file = std::fs::OpenOptions::new().append(true).open(path).map_err(io)?;
        Ok(MetricsLog { records, file: Some((path.to_path_buf(), std::io::LineWriter::new(file))) })
    }

    /// Appends a record (and writes its line).
    ///
    /// # Errors
    /// [`MetricsError::Io`].
    pub fn push(&mut self, r: StepRecord) -> Result<(), MetricsError> {
        if let Some((path, f)) = &mut self.file {
            let line = serde_json::to_string(&r).expect("a record serialises");
            writeln!(f, "{line}").map_err(|source| MetricsError::Io { path: path.clone(), source })?;
        }
        self.records.push(r);
        Ok(())
    }

    /// Every record: the kept ones of earlier runs, then this run's.
    pub fn records(&self) -> &[StepRecord] {
        &self.records
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(step: u64) -> StepRecord {
        StepRecord {
            step,
            loss: 5.0 - step as f64 / 10.0,
            lr: 1e-3,
            grad_norm: 0.5,
            step_s: 0.1,
            tokens_per_s: 100.0,
            elapsed_s: step as f64,
            val_loss: step.is_multiple_of(2).then_some(4.0),
            peak_bytes: None,
            flops_per_s: None,
            resident_bytes: None,
            boundary_wait_s: None,
            aux_loss: None,
            mtp_loss: None,
        }
    }

    #[test]
    fn a_resumed_log_keeps_each_step_once() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.jsonl");
        let mut log = MetricsLog::open(&path, 0).unwrap();
        for s in 1..=7 {
            log.push(rec(s)).unwrap();
        }
        drop(log);
        // Stopped after step 7, the last checkpoint at step 4: steps 5..7 run again.
        let mut log = MetricsLog::open(&path, 4).unwrap();
        assert_eq!(log.records().iter().map(|r| r.step).collect::<Vec<_>>(), [1, 2, 3, 4]);
        for s in 5..=8 {
            log.push(rec(s)).unwrap();
        }
        drop(log);
        let text = std::fs::read_to_string(&path).unwrap();
        let steps: Vec<u64> =
            text.lines().map(|l| serde_json::from_str::<StepRecord>(l).unwrap().step).collect();
        assert_eq!(steps, (1..=8).collect::<Vec<_>>());
        // A fresh run truncates.
        drop(MetricsLog::open(&path, 0).unwrap());
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "");
    }

    /// A resume keeps the earlier lines as they were written — their text, not a re-serialised
    /// record (that changed 34 of 130 lines by an ulp) — and a torn last line (a full disk
    /// during the stopped run) is dropped instead of blocking the resume.
    #[test]
    fn a_resume_keeps_lines_verbatim_and_drops_a_torn_last_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.jsonl");
        let one = r#"{"step":1,"loss":5.1000000000000005,"lr":0.001,"grad_norm":0.5,"step_s":0.1,"tokens_per_s":100.0,"elapsed_s":1.0}"#;
        let two = r#"{"step":2,"loss":4.9,"lr":1e-3,"grad_norm":0.50,"step_s":0.1,"tokens_per_s":100,"elapsed_s":2}"#;
        std::fs::write(&path, format!("{one}\n{two}\n{{\"step\":3,\"lo")).unwrap();
        let log = MetricsLog::open(&path, 2).unwrap();
        assert_eq!(log.records().iter().map(|r| r.step).collect::<Vec<_>>(), [1, 2]);
        drop(log);
        assert_eq!(std::fs::read_to_string(&path).unwrap(), format!("{one}\n{two}\n"));
        // A bad line that is not the last, or a last line that ends, is still an error.
        std::fs::write(&path, format!("{one}\n{{\"step\":3,\"lo\n")).unwrap();
        assert!(matches!(MetricsLog::open(&path, 3).unwrap_err(), MetricsError::Parse { line: 2, .. }));
    }

    #[test]
    fn a_bad_line_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.jsonl");
        std::fs::write(&path, format!("{}\nnot json\n", serde_json::to_string(&rec(1)).unwrap())).unwrap();
        let e = MetricsLog::open(&path, 3).unwrap_err();
        assert!(matches!(e, MetricsError::Parse { line: 2, .. }), "{e}");
    }
}
