/// How targets, URLs and durations appear in log lines: never a query (queries carry secrets such as
/// `?code=` or `?access_token=`), only printable ASCII.
public enum LogText {
    /// The URL without its query.
    public static func url(_ url: AbsoluteURL) -> String {
        let (path, query) = TargetText.split(url.pathAndQuery, at: "?")
        return "\(url.scheme)://\(url.hostFieldValue)\(path)\(query == nil ? "" : "?...")"
    }

    /// A raw request target, cut at the query for the same reason, at most 200 characters.
    public static func target(_ target: String) -> String {
        let (path, query) = TargetText.split(target, at: "?")
        return ASCII.clip(path, limit: 200) + (query == nil ? "" : "?...")
    }

    /// "830ms", "2.05s".
    public static func duration(_ milliseconds: Int64) -> String {
        milliseconds < 1000
            ? "\(milliseconds)ms"
            : "\(milliseconds / 1000).\(String(milliseconds % 1000 / 10).leftPadding(to: 2))s"
    }

}

extension String {
    /// The string with leading zeros up to `width` characters ("7" -> "07").
    public func leftPadding(to width: Int) -> String {
        count >= width ? self : String(repeating: "0", count: width - count) + self
    }
}
