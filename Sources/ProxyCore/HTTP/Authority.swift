/// A host and port, normalised for comparison: lower-case, no trailing dot, IPv6 without brackets.
public struct HostPort: Sendable, Hashable, CustomStringConvertible {
    public enum Kind: Sendable, Hashable { case name, ipv4, ipv6 }

    /// The host: a lower-case name without a trailing dot, dotted IPv4, or IPv6 without brackets.
    public let host: String
    public let port: Int
    public let kind: Kind

    public init(host: String, port: Int, kind: Kind) {
        self.host = host
        self.port = port
        self.kind = kind
    }

    /// `host:port`, with brackets around an IPv6 address: the form for CONNECT and Host.
    public var description: String { "\(hostForURL):\(port)" }

    /// The host as written in a URL or an authority.
    public var hostForURL: String { kind == .ipv6 ? "[\(host)]" : host }

    /// Parses `host[:port]` as found in CONNECT (RFC 9112 §3.2.3) or a URL's authority (RFC 3986 §3.2).
    ///
    /// Userinfo (`user@`), whitespace, control characters, an empty host or a port outside 1...65535 are
    /// errors. `defaultPort` is used when the port is absent; without one, the port is required.
    public static func parse(_ text: Substring, defaultPort: Int?) -> Result<HostPort, HTTPParseError> {
        parse(bytes: Array(text.utf8)[...], defaultPort: defaultPort)
    }

    /// `parse` over bytes already at hand (a URL's authority): no copies but the host's.
    static func parse(bytes: ArraySlice<UInt8>, defaultPort: Int?) -> Result<HostPort, HTTPParseError> {
        if bytes.contains(UInt8(ascii: "@")) {
            return .failure(HTTPParseError(.malformed, "userinfo is not allowed in an authority"))
        }
        var hostBytes: ArraySlice<UInt8>
        var rest: ArraySlice<UInt8>
        var kind: Kind
        if bytes.first == UInt8(ascii: "[") {
            guard let close = bytes.firstIndex(of: UInt8(ascii: "]")) else {
                return .failure(HTTPParseError(.malformed, "unterminated IPv6 address in authority"))
            }
            hostBytes = bytes[(bytes.startIndex + 1)..<close]
            rest = bytes[(close + 1)...]
            kind = .ipv6
            guard IPAddress.parseIPv6(hostBytes) != nil else {
                return .failure(HTTPParseError(.malformed, "invalid IPv6 address in authority"))
            }
        } else {
            let colon = bytes.lastIndex(of: ASCII.colon)
            hostBytes = bytes[..<(colon ?? bytes.endIndex)]
            rest = bytes[(colon ?? bytes.endIndex)...]
            kind = IPAddress.parseIPv4(hostBytes) != nil ? .ipv4 : .name
            for byte in hostBytes where !ASCII.isRegName(byte) {
                return .failure(HTTPParseError(.malformed, "invalid character in host name"))
            }
        }
        // Every trailing dot, so that a normalised host parses to itself ("a.." is "a", not "a."), and the kind
        // describes the host that is left ("1.2.3.4." is the address 1.2.3.4).
        while kind == .name && hostBytes.last == UInt8(ascii: ".") { hostBytes = hostBytes.dropLast() }
        if kind == .name && IPAddress.parseIPv4(hostBytes) != nil { kind = .ipv4 }
        guard !hostBytes.isEmpty else { return .failure(HTTPParseError(.malformed, "empty host in authority")) }
        if kind == .name && looksNumeric(hostBytes) {
            // inet_aton, and so getaddrinfo, reads "127.1", "0x7f.1" or "2130706433" as addresses: such a name
            // would slip past every check made on addresses (loop detection, bypass ranges).
            return .failure(
                HTTPParseError(.malformed, "ambiguous numeric host; write IPv4 addresses as four decimal numbers"))
        }
        var port: Int
        if rest.isEmpty {
            guard let defaultPort else { return .failure(HTTPParseError(.malformed, "port missing in authority")) }
            port = defaultPort
        } else {
            guard rest.first == ASCII.colon else {
                return .failure(HTTPParseError(.malformed, "malformed authority"))
            }
            let digits = rest.dropFirst()
            if digits.isEmpty, let defaultPort {
                port = defaultPort  // RFC 3986 §3.2.3: an empty port means the default one.
            } else {
                guard let parsed = parsePort(digits) else {
                    return .failure(HTTPParseError(.malformed, "invalid port in authority"))
                }
                port = parsed
            }
        }
        let host = String(unsafeUninitializedCapacity: hostBytes.count) { buffer in
            for (offset, byte) in hostBytes.enumerated() { buffer[offset] = ASCII.lower(byte) }
            return hostBytes.count
        }
        return .success(HostPort(host: host, port: port, kind: kind))
    }

    /// Whether every dot-separated label is a decimal, octal or hex number (the forms inet_aton accepts).
    /// Label by label in place, stopping at the first that is not a number (a host name's first label, as a
    /// rule): splitting into an array of labels first cost 1,700 instructions per call.
    static func looksNumeric(_ host: ArraySlice<UInt8>) -> Bool {
        var start = host.startIndex
        while true {
            let end = host[start...].firstIndex(of: UInt8(ascii: ".")) ?? host.endIndex
            let label = host[start..<end]
            let numeric: Bool
            if label.count > 2, label.first == UInt8(ascii: "0"), ASCII.lower(label[start + 1]) == UInt8(ascii: "x") {
                numeric = label.dropFirst(2).allSatisfy { ASCII.hexValue($0) != nil }
            } else {
                numeric = !label.isEmpty && label.allSatisfy(ASCII.isDigit)
            }
            guard numeric else { return false }
            if end == host.endIndex { return true }
            start = end + 1
        }
    }

    /// Whether `bytes` spells this authority as clients write it: the host as kept here (lower case, no
    /// trailing dot), then `:port`, or nothing when the port is `defaultPort`. Such bytes parse to this
    /// authority, so a Host field that matches needs no parse; false only means "parse and compare".
    func isSpelled(by bytes: ArraySlice<UInt8>, defaultPort: Int) -> Bool {
        guard kind != .ipv6 else { return false }
        var host = host
        return host.withUTF8 { name in
            guard bytes.count >= name.count, bytes.starts(with: name) else { return false }
            let rest = bytes.dropFirst(name.count)
            guard let colon = rest.first else { return port == defaultPort }
            return colon == ASCII.colon && HostPort.parsePort(rest.dropFirst()) == port
        }
    }

    static func parsePort(_ digits: some Collection<UInt8>) -> Int? {
        guard !digits.isEmpty, digits.count <= 5 else { return nil }
        var value = 0
        for byte in digits {
            guard ASCII.isDigit(byte) else { return nil }
            value = value * 10 + Int(byte - 0x30)
        }
        return (1...65535).contains(value) ? value : nil
    }
}

/// The parsed form of an absolute-form request target (RFC 9112 §3.2.2) or a configured URL.
public struct AbsoluteURL: Sendable, Equatable {
    /// Lower-case scheme.
    public let scheme: String
    public let authority: HostPort
    /// Path and query, exactly as sent; "/" when the URL had no path. This is the origin-form.
    public let pathAndQuery: String

    /// A URL from parts already checked: a lower-case scheme, a normalised authority (an `OriginConfig`'s), and
    /// an origin-form path and query.
    public init(scheme: String, authority: HostPort, pathAndQuery: String) {
        self.scheme = scheme
        self.authority = authority
        self.pathAndQuery = pathAndQuery
    }

    /// Parses `scheme://authority[path][?query]`. A fragment, userinfo or a scheme other than http and https
    /// are errors.
    public static func parse(_ text: String) -> Result<AbsoluteURL, HTTPParseError> {
        // Works on the UTF-8 bytes: this runs for every forwarded request.
        let bytes = Array(text.utf8)
        var schemeEnd = -1
        var index = 0
        while index + 2 < bytes.count {
            if bytes[index] == ASCII.colon && bytes[index + 1] == UInt8(ascii: "/")
                && bytes[index + 2] == UInt8(ascii: "/")
            {
                schemeEnd = index
                break
            }
            index += 1
        }
        guard schemeEnd >= 0 else {
            return .failure(HTTPParseError(.malformed, "request target is not an absolute URL"))
        }
        let schemeBytes = bytes[0..<schemeEnd]
        let scheme: String
        let defaultPort: Int
        if ASCII.equalsLowercase(schemeBytes, "http") {
            (scheme, defaultPort) = ("http", 80)
        } else if ASCII.equalsLowercase(schemeBytes, "https") {
            (scheme, defaultPort) = ("https", 443)
        } else {
            return .failure(HTTPParseError(.malformed, "unsupported URL scheme \"\(ASCII.printable(schemeBytes))\""))
        }
        let rest = bytes[(schemeEnd + 3)...]
        if rest.contains(UInt8(ascii: "#")) {
            return .failure(HTTPParseError(.malformed, "a request target must not contain a fragment"))
        }
        let authorityEnd = rest.firstIndex { $0 == UInt8(ascii: "/") || $0 == UInt8(ascii: "?") } ?? rest.endIndex
        switch HostPort.parse(bytes: rest[..<authorityEnd], defaultPort: defaultPort) {
        case .failure(let error):
            return .failure(error)
        case .success(let authority):
            var path = String(decoding: rest[authorityEnd...], as: UTF8.self)
            if path.isEmpty || path.utf8.first == UInt8(ascii: "?") { path = "/" + path }
            return .success(AbsoluteURL(scheme: scheme, authority: authority, pathAndQuery: path))
        }
    }

    /// The port is the scheme's default.
    public var hasDefaultPort: Bool {
        (scheme == "http" && authority.port == 80) || (scheme == "https" && authority.port == 443)
    }

    /// `host` or `host:port`: the value of a Host field for this URL (RFC 9110 §7.2).
    public var hostFieldValue: String {
        hasDefaultPort ? authority.hostForURL : authority.description
    }
}
