/// The users allowed to use the proxy (`proxy_auth_file`) and the check of `Proxy-Authorization: Basic`
/// (RFC 9110 §11.7.1, RFC 7617).
public struct ProxyCredentials: Sendable, Equatable {
    /// user -> password bytes.
    private var users: [String: [UInt8]] = [:]

    public var count: Int { users.count }

    public init() {}

    /// Parses `user:password` lines; blank lines and `#` comments are skipped. Errors name the line but
    /// never echo a password.
    public static func parse(_ text: String, file: String) -> Result<ProxyCredentials, ConfigError> {
        var credentials = ProxyCredentials()
        // "\r\n" is one Character in Swift: split on it too, or a CRLF file is a single line.
        let lines = text.split(omittingEmptySubsequences: false, whereSeparator: { $0 == "\n" || $0 == "\r\n" })
        for (offset, raw) in lines.enumerated() {
            var line = Substring(raw)
            if line.last == "\r" { line = line.dropLast() }
            if line.trimmingOWS().isEmpty || line.hasPrefix("#") { continue }
            // The first colon byte, as `check` (RFC 7617) splits: ":" and a combining mark are one Character.
            guard let colon = line.utf8.firstIndex(of: UInt8(ascii: ":")), colon > line.startIndex else {
                return .failure(ConfigError(file: file, line: offset + 1, "expected user:password"))
            }
            let user = String(line[..<colon])
            let password = Array(line.utf8[line.utf8.index(after: colon)...])
            guard !password.isEmpty else {
                return .failure(ConfigError(file: file, line: offset + 1, "empty password for user \"\(user)\""))
            }
            if credentials.users[user] != nil {
                return .failure(ConfigError(file: file, line: offset + 1, "user \"\(user)\" listed twice"))
            }
            credentials.users[user] = password
        }
        if credentials.users.isEmpty {
            return .failure(ConfigError(file: file, line: nil, "no user:password lines; add at least one"))
        }
        return .success(credentials)
    }

    public enum Check: Sendable, Equatable {
        case allowed(user: String)
        case missing
        case invalid
    }

    /// Checks a `Proxy-Authorization` value. The comparison takes the same time wherever the bytes differ.
    public func check(_ value: String?) -> Check {
        guard let value else { return .missing }
        let parts = value.split(separator: " ", maxSplits: 1)
        guard parts.count == 2, parts[0].lowercased() == "basic",
            let decoded = Base64.decode(parts[1].trimmingOWS()),
            let colon = decoded.firstIndex(of: UInt8(ascii: ":"))
        else { return .invalid }
        let user = String(decoding: decoded[..<colon], as: UTF8.self)
        let given = Array(decoded[(colon + 1)...])
        guard let expected = users[user] else {
            _ = Self.constantTimeEqual(given, given)
            return .invalid
        }
        return Self.constantTimeEqual(given, expected) ? .allowed(user: user) : .invalid
    }

    static func constantTimeEqual(_ a: [UInt8], _ b: [UInt8]) -> Bool {
        // Not `UInt8(truncatingIfNeeded: a.count ^ b.count)`: lengths 256 apart would look equal, and a password
        // followed by 256 NUL bytes would pass.
        var difference: UInt8 = a.count == b.count ? 0 : 1
        for index in 0..<max(a.count, b.count) {
            let x = index < a.count ? a[index] : 0
            let y = index < b.count ? b[index] : 0
            difference |= x ^ y
        }
        return difference == 0
    }
}
