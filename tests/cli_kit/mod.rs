//! Checks shared by the tests that drive the `kda-pool` binary.

use std::process::Output;

/// A usage error as the CLI promises one: exit code 2, exactly one stderr line that starts with
/// "error" and names `needle`, no panic or backtrace, nothing on stdout.
pub fn assert_usage_error(o: &Output, needle: &str) {
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{needle:?}: stderr: {err}");
    assert_eq!(
        err.trim_end().lines().count(),
        1,
        "{needle:?}: one line expected: {err:?}"
    );
    assert!(err.starts_with("error"), "{err:?}");
    assert!(err.contains(needle), "{needle:?} not in {err:?}");
    assert!(
        !err.contains("panicked") && !err.contains("backtrace"),
        "{err:?}"
    );
    assert!(
        o.stdout.is_empty(),
        "{needle:?}: stdout: {}",
        String::from_utf8_lossy(&o.stdout)
    );
}
