//! Value parsers of the command line's count flags (`--ranks`, `--microbatches`, …), so that
//! `--ranks -1` reaches graphpp's own message instead of clap's "unexpected argument": each such
//! flag takes `allow_hyphen_values = true, value_parser = count::<usize>`. Ranges (`at least 1`,
//! `at most …`) are checked where the concept lives (the schedule, model or run config); a parser
//! only turns the text into a whole number. A rejected value exits with status 1 (see `main`).

/// Parses a count: a whole number `>= 0` that fits `T`.
///
/// # Errors
/// The problem in words (clap prefixes the flag and the value): a negative number, a number too
/// large for a count, or text that is no whole number.
pub fn count<T: TryFrom<u128>>(text: &str) -> Result<T, String> {
    let t = text.trim();
    if let Ok(n) = t.parse::<u128>() {
        return T::try_from(n).map_err(|_| "the number is too large".to_string());
    }
    if t.strip_prefix('-').is_some_and(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit())) {
        return Err("a count cannot be negative".into());
    }
    Err("expected a whole number >= 0".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_are_whole_numbers_at_least_zero() {
        assert_eq!(count::<usize>("4"), Ok(4));
        assert_eq!(count::<usize>("0"), Ok(0));
        assert_eq!(count::<usize>("-1").unwrap_err(), "a count cannot be negative");
        assert_eq!(count::<u64>("2.5").unwrap_err(), "expected a whole number >= 0");
        assert_eq!(count::<u64>("nan").unwrap_err(), "expected a whole number >= 0");
        assert_eq!(count::<u64>("99999999999999999999999").unwrap_err(), "the number is too large");
    }
}
