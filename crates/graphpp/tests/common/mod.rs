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
