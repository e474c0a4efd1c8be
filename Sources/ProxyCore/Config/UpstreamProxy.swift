/// The corporate proxy that tunnels and requests go through (`upstream_proxy`).
public struct UpstreamProxy: Sendable, Equatable, CustomStringConvertible {
    public let address: HostPort
    /// Basic credentials for the upstream proxy; never logged.
    public let username: String?
    public let password: String?

    public init(address: HostPort, username: String? = nil, password: String? = nil) {
        self.address = address
        self.username = username
        self.password = password
    }

    /// The proxy's address without credentials, safe for logs.
    public var description: String { "http://\(address)" }

    /// The `Proxy-Authorization` value, when credentials are configured.
    public var authorization: String? {
        guard let username else { return nil }
        let raw = Array("\(username):\(password ?? "")".utf8)
        return "Basic " + Base64.encode(raw)
    }

    /// Our CONNECT request for a tunnel to `target` through this proxy (RFC 9110 §9.3.6), with
    /// `Proxy-Authorization` when credentials are configured: the one place it is written, for a client's tunnel
    /// and the proxy's own connections to origins alike.
    public func connectRequest(to target: HostPort) -> [UInt8] {
        var request = "CONNECT \(target) HTTP/1.1\r\nHost: \(target)\r\n"
        if let authorization { request += "Proxy-Authorization: \(authorization)\r\n" }
        request += "\r\n"
        return Array(request.utf8)
    }

    /// What this proxy's answer to our CONNECT means: nil when the tunnel is open (2xx), else why not.
    public func connectRefusal(status: Int) -> ProxyAnswer? {
        if (200..<300).contains(status) { return nil }
        if status == 407 { return .upstreamProxyCredentials(address, credentialsConfigured: username != nil) }
        return .upstreamProxyRefused(address, status: status)
    }

    /// Parses `http://[user:pass@]host:port`. The port defaults to 8080 (no default is standard for proxies;
    /// 8080 is what most use); percent-encoding in the credentials is decoded.
    public static func parse(_ text: String) -> Result<UpstreamProxy, ValueError> {
        guard text.lowercased().hasPrefix("http://") else {
            return .failure("expected http://[user:password@]host:port (only http:// proxies are supported)")
        }
        var rest = text.dropFirst("http://".count)
        if rest.hasSuffix("/") { rest = rest.dropLast() }
        var username: String? = nil
        var password: String? = nil
        if let at = rest.lastIndex(of: "@") {
            let userinfo = rest[..<at]
            rest = rest[rest.index(after: at)...]
            let parts = userinfo.split(separator: ":", maxSplits: 1, omittingEmptySubsequences: false)
            guard let user = percentDecode(parts[0]), !user.isEmpty else {
                return .failure("invalid user name in upstream proxy URL")
            }
            username = user
            if parts.count == 2 {
                guard let pass = percentDecode(parts[1]) else {
                    return .failure("invalid percent-encoding in upstream proxy password")
                }
                password = pass
            }
        }
        if rest.contains("/") { return .failure("an upstream proxy URL has no path; expected http://host:port") }
        switch HostPort.parse(rest, defaultPort: 8080) {
        case .failure(let error): return .failure("invalid host or port: \(error.reason)")
        case .success(let address):
            return .success(UpstreamProxy(address: address, username: username, password: password))
        }
    }

    static func percentDecode(_ text: Substring) -> String? {
        var bytes: [UInt8] = []
        var iterator = Array(text.utf8).makeIterator()
        while let byte = iterator.next() {
            if byte == UInt8(ascii: "%") {
                guard let high = iterator.next().flatMap(ASCII.hexValue),
                    let low = iterator.next().flatMap(ASCII.hexValue)
                else { return nil }
                bytes.append(high << 4 | low)
            } else {
                bytes.append(byte)
            }
        }
        return String(validating: bytes, as: UTF8.self)
    }
}

/// Hosts that bypass the upstream proxy (`no_upstream_proxy`), in the spirit of `NO_PROXY`:
/// `*` (everything), `example.com` (that host and its subdomains; a leading dot means the same),
/// an IP address or a CIDR range (for targets given as IP literals).
public struct BypassList: Sendable, Equatable {
    public private(set) var matchesAll = false
    public private(set) var domains: [String] = []
    public private(set) var ranges: [CIDR] = []

    public init() {}

    public static func parse(_ text: String) -> Result<BypassList, ValueError> {
        var list = BypassList()
        for raw in text.split(whereSeparator: { $0 == "," || $0 == " " || $0 == "\t" }) {
            let entry = raw.lowercased()
            if entry == "*" {
                list.matchesAll = true
            } else if let range = CIDR.parse(entry) {
                list.ranges.append(range)
            } else {
                var domain = Substring(entry)
                while domain.hasPrefix(".") || domain.hasPrefix("*.") {
                    domain = domain.hasPrefix("*.") ? domain.dropFirst(2) : domain.dropFirst()
                }
                if domain.hasSuffix(".") { domain = domain.dropLast() }
                guard !domain.isEmpty, domain.utf8.allSatisfy({ ASCII.isRegName($0) && $0 != UInt8(ascii: "%") })
                else {
                    return .failure(
                        "\"\(INIDocument.clip(String(raw)))\" is not a host name, domain, IP address or CIDR range")
                }
                list.domains.append(String(domain))
            }
        }
        return .success(list)
    }

    /// Whether requests to `host` go direct.
    public func matches(_ host: HostPort) -> Bool {
        if matchesAll { return true }
        switch host.kind {
        case .ipv4, .ipv6:
            guard let address = IPAddress.parse(host.host) else { return false }
            return ranges.contains { $0.contains(address) }
        case .name:
            return domains.contains { host.host == $0 || host.host.hasSuffix("." + $0) }
        }
    }
}
