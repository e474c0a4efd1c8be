/// How targets, URLs and durations appear in log lines: never a query (queries carry secrets such as
/// `?code=` or `?access_token=`), only printable ASCII.
public enum LogText {
    /// The URL without its query.
    public static func url(_ url: AbsoluteURL) -> String {
        var line = LogLineBuilder(capacity: url.pathAndQuery.utf8.count + 32)
        line.append(url: url)
        return line.text
    }

    /// A raw request target, cut at the query for the same reason, at most 200 characters.
    public static func target(_ target: String) -> String {
        var line = LogLineBuilder(capacity: min(target.utf8.count, 200) + 8)
        line.append(target: target)
        return line.text
    }

    /// "830ms", "2.05s".
    public static func duration(_ milliseconds: Int64) -> String {
        var line = LogLineBuilder(capacity: 16)
        line.append(duration: milliseconds)
        return line.text
    }
}

/// A log line's text built as bytes, once: interpolating it into a String grew and copied the string at every
/// piece (a tenth of a forwarded request's instructions went to the access-log line).
public struct LogLineBuilder {
    public private(set) var bytes: [UInt8] = []

    public init(capacity: Int = 160) {
        bytes.reserveCapacity(capacity)
    }

    public var text: String { String(decoding: bytes, as: UTF8.self) }

    public mutating func append(string text: String) {
        bytes.append(utf8: text)
    }

    /// A literal's bytes (a copy of a buffer: cheaper than a String's UTF-8 view).
    public mutating func append(_ literal: StaticString) {
        literal.withUTF8Buffer { bytes.append(contentsOf: $0) }
    }

    /// The decimal digits of `value` (and a minus sign).
    public mutating func append(_ value: some BinaryInteger) {
        if value < 0 { bytes.append(UInt8(ascii: "-")) }
        var magnitude = UInt64(value.magnitude)
        withUnsafeTemporaryAllocation(of: UInt8.self, capacity: 20) { digits in
            var start = digits.count
            repeat {
                start -= 1
                digits[start] = UInt8(ascii: "0") + UInt8(magnitude % 10)
                magnitude /= 10
            } while magnitude > 0
            bytes.append(contentsOf: UnsafeBufferPointer(rebasing: digits[start...]))
        }
    }

    /// `scheme://host[:port]/path`, the query replaced by `?...` (`LogText.url`).
    public mutating func append(url: AbsoluteURL) {
        append(string: url.scheme)
        append("://")
        if url.authority.kind == .ipv6 {
            bytes.append(UInt8(ascii: "["))
            append(string: url.authority.host)
            bytes.append(UInt8(ascii: "]"))
        } else {
            append(string: url.authority.host)
        }
        if !url.hasDefaultPort {
            bytes.append(ASCII.colon)
            append(url.authority.port)
        }
        let path = url.pathAndQuery.utf8
        if let query = path.firstIndex(of: UInt8(ascii: "?")) {
            bytes.append(contentsOf: path[..<query])
            append("?...")
        } else {
            bytes.append(contentsOf: path)
        }
    }

    /// A raw request target as `LogText.target` shows it: cut at the query (`?...`), at most 200 characters
    /// (then `...`), each one not printable ASCII as `?`. Read as UTF-8: a scalar beyond ASCII is one `?` for its
    /// lead byte, its continuation bytes skipped.
    public mutating func append(target: String) {
        var target = target
        var clipped = false
        let query = target.withUTF8 { utf8 -> Bool in
            var count = 0
            for byte in utf8 {
                if byte == UInt8(ascii: "?") { return true }
                if clipped || byte & 0xC0 == 0x80 { continue }
                if count == 200 {
                    clipped = true
                    continue
                }
                bytes.append(byte >= 0x20 && byte < 0x7F ? byte : UInt8(ascii: "?"))
                count += 1
            }
            return false
        }
        if clipped { append("...") }
        if query { append("?...") }
    }

    /// "830ms", "2.05s" (`LogText.duration`).
    public mutating func append(duration milliseconds: Int64) {
        if milliseconds < 1000 {
            append(milliseconds)
            append("ms")
            return
        }
        append(milliseconds / 1000)
        bytes.append(UInt8(ascii: "."))
        let hundredths = milliseconds % 1000 / 10
        if hundredths < 10 { bytes.append(UInt8(ascii: "0")) }
        append(hundredths)
        bytes.append(UInt8(ascii: "s"))
    }
}

extension String {
    /// The string with leading zeros up to `width` characters ("7" -> "07").
    public func leftPadding(to width: Int) -> String {
        count >= width ? self : String(repeating: "0", count: width - count) + self
    }
}
