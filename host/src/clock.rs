//! The wall clock as the records spell it. A leaf: every floor uses it.

/// Now, RFC 3339 to the second (UTC): how records, Events and reports
/// carry a time.
pub fn now_rfc3339() -> String {
    humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string()
}
