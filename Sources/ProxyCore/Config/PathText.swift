/// File paths as text, cut the way `NSString`'s path methods cut them. FoundationEssentials (what the release
/// links instead of the whole Foundation, to leave ICU out) has no `NSString`, and these two cuts are all the
/// project needs of it.
public enum PathText {
    /// The path without its last component: `/a/b` -> `/a`, `/a` -> `/`, `b` -> ``, `/a/b/` -> `/a`, `//` -> `/`.
    public static func parent(_ path: String) -> String {
        let trimmed = withoutTrailingSlashes(path)
        guard let slash = trimmed.lastIndex(of: "/") else { return "" }
        if slash == trimmed.startIndex { return "/" }
        return withoutTrailingSlashes(String(trimmed[..<slash]))
    }

    /// The last component: `/a/b` -> `b`, `/a/b/` -> `b`, `/` -> `/`, `b` -> `b`.
    public static func lastComponent(_ path: String) -> String {
        let trimmed = withoutTrailingSlashes(path)
        if trimmed == "/" { return "/" }
        guard let slash = trimmed.lastIndex(of: "/") else { return trimmed }
        return String(trimmed[trimmed.index(after: slash)...])
    }

    /// `path` without the slashes at its end, but `/` for a path of slashes only.
    private static func withoutTrailingSlashes(_ path: String) -> String {
        var end = path.endIndex
        while end > path.startIndex, path[path.index(before: end)] == "/" { end = path.index(before: end) }
        if end == path.startIndex { return path.isEmpty ? "" : "/" }
        return String(path[..<end])
    }
}
