/// Parsers for the value types of proxy.conf. Each returns nil on bad input; the caller names the key and
/// what was expected.
public enum ConfigValue {
    /// A non-negative decimal integer: ASCII digits only (no sign, no spaces), at most 18 of them.
    public static func digits(_ text: some StringProtocol) -> Int? {
        guard !text.isEmpty, text.utf8.count <= 18, text.utf8.allSatisfy({ $0 >= 0x30 && $0 <= 0x39 }) else {
            return nil
        }
        return Int(text)
    }

    /// `10s`, `500ms`, `5m`, `1h`, or a bare number of seconds. Returns milliseconds.
    public static func duration(_ text: String) -> Int? {
        let units: [(String, Int)] = [("ms", 1), ("s", 1000), ("m", 60_000), ("h", 3_600_000)]
        for (suffix, factor) in units where text.hasSuffix(suffix) {
            let number = text.dropLast(suffix.count).trimmingOWS()
            // "5ms" must not be read as "5m" followed by "s": the longer suffix is tried first.
            guard let value = digits(number), value <= Int.max / factor else { return nil }
            return value * factor
        }
        guard let seconds = digits(text), seconds <= Int.max / 1000 else { return nil }
        return seconds * 1000
    }

    /// `65536`, `64KiB`, `8MiB`, `1GiB` (also `k`, `K`, `M`, `G`). Returns bytes.
    public static func size(_ text: String) -> Int? {
        let units: [(String, Int)] = [
            ("KiB", 1 << 10), ("MiB", 1 << 20), ("GiB", 1 << 30), ("k", 1 << 10), ("K", 1 << 10),
            ("M", 1 << 20), ("G", 1 << 30), ("B", 1),
        ]
        for (suffix, factor) in units where text.hasSuffix(suffix) {
            let number = text.dropLast(suffix.count).trimmingOWS()
            guard let value = digits(number), value <= Int.max / factor else { return nil }
            return value * factor
        }
        guard let value = digits(text) else { return nil }
        return value
    }

    public static func bool(_ text: String) -> Bool? {
        switch text.lowercased() {
        case "true", "yes", "on", "1": true
        case "false", "no", "off", "0": false
        default: nil
        }
    }

    /// Renders milliseconds the way a person would write them in the file.
    public static func describeDuration(_ milliseconds: Int) -> String {
        if milliseconds % 3_600_000 == 0 && milliseconds > 0 { return "\(milliseconds / 3_600_000)h" }
        if milliseconds % 60_000 == 0 && milliseconds > 0 { return "\(milliseconds / 60_000)m" }
        if milliseconds % 1000 == 0 { return "\(milliseconds / 1000)s" }
        return "\(milliseconds)ms"
    }
}

/// A listening address: an IP literal (or `localhost`) and a port; port 0 picks a free one.
public struct ListenAddress: Sendable, Equatable, CustomStringConvertible {
    public let host: String
    public let port: Int
    public let isIPv6: Bool

    public init(host: String, port: Int, isIPv6: Bool) {
        self.host = host
        self.port = port
        self.isIPv6 = isIPv6
    }

    public static let `default` = ListenAddress(host: "127.0.0.1", port: 8080, isIPv6: false)

    public var description: String { isIPv6 ? "[\(host)]:\(port)" : "\(host):\(port)" }

    /// Whether only this machine can connect.
    public var isLoopback: Bool { IPAddress.parse(host)?.isLoopback ?? false }

    /// Parses `HOST:PORT` where HOST is an IPv4 or bracketed IPv6 literal, or `localhost`.
    public static func parse(_ text: String) -> ListenAddress? {
        if case .success(let address) = check(text) { return address }
        return nil
    }

    /// `parse`, with what is wrong: a port out of range is named as such (`127.0.0.1:80800`), anything else is
    /// not `HOST:PORT` with an IP address.
    public static func check(_ text: String) -> Result<ListenAddress, ValueError> {
        let shape: ValueError = "expected HOST:PORT with an IP address, such as 127.0.0.1:8080 or [::1]:8080"
        var host: Substring
        var portText: Substring
        var isIPv6 = false
        if text.hasPrefix("[") {
            guard let close = text.firstIndex(of: "]"), text[text.index(after: close)...].hasPrefix(":") else {
                return .failure(shape)
            }
            host = text[text.index(after: text.startIndex)..<close]
            portText = text[text.index(close, offsetBy: 2)...]
            isIPv6 = true
        } else {
            guard let colon = text.lastIndex(of: ":") else { return .failure(shape) }
            host = text[..<colon]
            portText = text[text.index(after: colon)...]
        }
        if host == "localhost" { host = "127.0.0.1" }
        guard let address = IPAddress.parse(host) else { return .failure(shape) }
        switch address {
        case .v4: if isIPv6 { return .failure(shape) }
        case .v6: if !isIPv6 { return .failure(shape) }
        }
        guard !portText.isEmpty, portText.utf8.allSatisfy({ $0 >= UInt8(ascii: "0") && $0 <= UInt8(ascii: "9") })
        else { return .failure(shape) }
        guard let port = ConfigValue.digits(portText), (0...65535).contains(port) else {
            return .failure("port \(portText) out of range (1-65535, or 0 for any free port)")
        }
        return .success(ListenAddress(host: String(host), port: port, isIPv6: isIPv6))
    }
}

/// A value that did not parse; the message says what was expected (never the value when it may be secret).
public struct ValueError: Error, Sendable, Equatable, ExpressibleByStringInterpolation, CustomStringConvertible {
    public let message: String
    public init(_ message: String) { self.message = message }
    public init(stringLiteral value: String) { message = value }
    public init(stringInterpolation: DefaultStringInterpolation) {
        message = String(stringInterpolation: stringInterpolation)
    }
    public var description: String { message }
}
