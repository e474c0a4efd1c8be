/// Cutting URLs and request targets at their delimiters.
///
/// Always on the UTF-8 bytes: a delimiter followed by a combining mark ("?\u{301}") is one `Character` in
/// Swift, so `firstIndex(of: "?")`, `split(separator: "?")` and `hasPrefix("/")` would not see it, and a
/// query meant to stay out of a log line would be written whole.
public enum TargetText {
    /// The text before the first `delimiter` and the text after it (nil when there is none).
    public static func split(_ text: String, at delimiter: Character) -> (before: String, after: String?) {
        guard let byte = delimiter.asciiValue, let index = text.utf8.firstIndex(of: byte) else {
            return (text, nil)
        }
        let after = text.utf8.index(after: index)
        return (
            String(decoding: text.utf8[..<index], as: UTF8.self),
            String(decoding: text.utf8[after...], as: UTF8.self)
        )
    }

    /// The URL or target without its query (and fragment): queries can carry secrets.
    public static func withoutQuery(_ text: String) -> String {
        split(split(text, at: "#").before, at: "?").before
    }
}
