//! Bounding text that crosses a boundary: a guest's refusal, a tool's
//! output or a peer's message may be of any size, and what carries it (a
//! frame, an Event, a log line) has a limit. A leaf: every floor uses it.

/// `message` cut to at most `max` bytes, on a character boundary, marked.
pub fn bounded(mut message: String, max: usize) -> String {
    if message.len() > max {
        let mut cut = max.saturating_sub(40);
        while !message.is_char_boundary(cut) {
            cut -= 1;
        }
        let dropped = message.len() - cut;
        message.truncate(cut);
        message.push_str(&format!("… ({dropped} more bytes cut)"));
    }
    message
}
