//! Bounded reads of the text files graphpp takes: schedules (CSV, JSON; the CLI's and the
//! Python package's `Schedule.load`), strategies, profiles and model configs. Each is read up to
//! [`MAX_TEXT_BYTES`]; a larger input — or a device with no end, such as `/dev/zero` — is
//! refused once that many bytes have been read, instead of being read whole into memory. (The
//! training corpus, `--data`, has its own bound from the machine's memory: the `graphpp`
//! crate's `data::read_text`.)

use std::io::Read;
use std::path::Path;

/// The most bytes a text input may have: 64 MiB, far above any real one (the CSV of a schedule
/// at p = 64, m = 1024 is under 3 MiB) and small enough to parse in memory.
pub const MAX_TEXT_BYTES: u64 = 64 << 20;

/// The UTF-8 text of `path`, read up to [`MAX_TEXT_BYTES`].
///
/// # Errors
/// The I/O error of opening or reading `path`; [`std::io::ErrorKind::FileTooLarge`] for a file
/// longer than the bound, [`std::io::ErrorKind::InvalidData`] for text that is not UTF-8 (each
/// message says which).
pub fn read_text(path: &Path) -> std::io::Result<String> {
    let mut bytes = Vec::new();
    std::fs::File::open(path)?.take(MAX_TEXT_BYTES + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > MAX_TEXT_BYTES {
        return Err(std::io::Error::new(
            std::io::ErrorKind::FileTooLarge,
            format!("longer than {} MiB, the most a text input may be", MAX_TEXT_BYTES >> 20),
        ));
    }
    String::from_utf8(bytes).map_err(|e| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("not UTF-8 text (byte offset {})", e.utf8_error().valid_up_to()),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_device_without_end_is_refused_at_the_bound() {
        let e = read_text(Path::new("/dev/zero")).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::FileTooLarge);
        assert!(e.to_string().contains("longer than 64 MiB"), "{e}");
    }

    #[test]
    fn text_reads_back_and_other_bytes_are_named() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("a.csv");
        std::fs::write(&p, "0F0,0B0\n").unwrap();
        assert_eq!(read_text(&p).unwrap(), "0F0,0B0\n");
        std::fs::write(&p, b"0F0\xff").unwrap();
        let e = read_text(&p).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidData);
        assert!(e.to_string().contains("byte offset 3"), "{e}");
    }
}
