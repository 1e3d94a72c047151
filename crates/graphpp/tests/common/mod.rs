//! Helpers the CLI tests share.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

/// `dir/corpus.txt`: two lines of Hamlet repeated `lines` times in all (about 44 bytes each),
/// text with learnable structure.
pub fn corpus(dir: &Path, lines: usize) -> PathBuf {
    let text_lines =
        ["To be, or not to be, that is the question:\n", "Whether 'tis nobler in the mind to suffer\n"];
    let text: String = (0..lines).map(|i| text_lines[i % 2]).collect();
    let path = dir.join("corpus.txt");
    std::fs::write(&path, text).unwrap();
    path
}

/// The `graphpp` binary of this build.
pub fn graphpp() -> std::process::Command {
    use assert_cmd::cargo::CommandCargoExt;
    std::process::Command::cargo_bin("graphpp").expect("binary builds")
}

/// Runs `cmd`, expecting exit status `code`; returns (stdout, stderr).
pub fn output(mut cmd: std::process::Command, code: i32) -> (String, String) {
    let out = cmd.output().unwrap();
    let (o, e) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    assert_eq!(out.status.code(), Some(code), "stdout:\n{o}\nstderr:\n{e}");
    (o, e)
}
