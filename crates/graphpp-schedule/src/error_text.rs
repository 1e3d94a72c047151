//! One line for an error and its causes, as the CLI and the Python package print them.

/// `e`'s message and its causes (`source()` chain) joined by `: `, skipping a cause whose text
/// the line already holds (typed errors often print their source themselves).
pub fn with_causes(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let part = c.to_string();
        if !text.contains(&part) {
            text = format!("{text}: {part}");
        }
        cause = c.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A CSV cell's error names its cell, then why (its source), once.
    #[test]
    fn causes_follow_once() {
        let e = crate::Schedule::parse("0F0,0XX2\n").unwrap_err();
        let line = with_causes(&e);
        assert!(line.starts_with("bad CSV schedule: rank 0 (line 1), cell 2: "), "{line}");
        assert!(line.contains("unknown action kind `XX2`"), "{line}");
        assert_eq!(line.matches("cell 2").count(), 1, "{line}");
    }
}
