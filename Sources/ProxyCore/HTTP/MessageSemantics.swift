/// How the body of a message is delimited (RFC 9112 §6.3).
public enum BodyFraming: Sendable, Equatable {
    case none
    case contentLength(UInt64)
    case chunked
    /// Responses only: the body ends when the server closes the connection.
    case untilClose
}

/// What a request asks the proxy to do, decided from its head alone.
public enum RequestTarget: Sendable, Equatable {
    /// `CONNECT host:port`: open a tunnel.
    case connect(HostPort)
    /// `GET http://host/path`: forward to the origin.
    case absolute(AbsoluteURL)
    /// `GET /path` or `OPTIONS *`: a request for the proxy itself, not a proxy request.
    case notProxyRequest
}

/// The result of checking a request head: its target, its framing and which field lines do not travel on.
public struct RequestSemantics: Sendable {
    public let target: RequestTarget
    public let framing: BodyFraming
    /// The client allows the connection to stay open after this exchange.
    public let keepAlive: Bool
    /// The client asked to switch protocols (`Upgrade`, e.g. WebSocket) and the upgrade travels on.
    public let upgrade: Bool
    /// Indices of field lines that must not be forwarded (hop-by-hop fields, proxy credentials, a Host
    /// that disagrees with the target).
    public let dropped: FieldIndexSet
    /// The Host value to add when the received one was missing or had to be replaced.
    public let replacementHost: String?
    /// Index of the Proxy-Authorization field, if any.
    public let proxyAuthorization: Int?
}

/// The result of checking a response head.
public struct ResponseSemantics: Sendable, Equatable {
    public let framing: BodyFraming
    /// A 1xx other than 101: forward it, then read the final response.
    public let isInterim: Bool
    /// A 101 to a request that asked for an upgrade: the connection becomes a tunnel.
    public let switchesProtocols: Bool
    /// The server will close, or its framing allows no reuse.
    public let serverCloses: Bool
    public let dropped: FieldIndexSet
}

extension MessageSemantics {
    /// Field names that are hop-by-hop whatever the Connection field says (RFC 9110 §7.6.1), plus the proxy's
    /// own credentials.
    static let alwaysHopByHop: [StaticString] = [
        "connection", "proxy-connection", "keep-alive", "te", "upgrade", "proxy-authorization",
    ]

    /// The lengths of the always-hop-by-hop names, as bits.
    static let hopByHopLengths: UInt64 = alwaysHopByHop.reduce(0) { $0 | 1 << UInt64($1.utf8CodeUnitCount) }

    /// The always-hop-by-hop field names as bytes: the one table trailers and HTTP/2 header blocks are
    /// checked against too.
    public static let hopByHopNames: Set<[UInt8]> = Set(
        alwaysHopByHop.map { name in name.withUTF8Buffer { Array($0) } })
}

/// Connection options that must never remove a field: dropping these would change the framing or the
/// target that this proxy checked ("Connection: Content-Length" is an old smuggling trick).
private let protectedFields: [StaticString] = ["content-length", "transfer-encoding", "host"]

public enum MessageSemantics {
    /// Whether `target` contains "://" (a scheme): compared byte by byte, since the standard library's
    /// generic `contains(_:)` for a subsequence costs about 17,000 instructions for a CONNECT target.
    static func hasSchemeSeparator(_ target: String) -> Bool {
        var previous: (UInt8, UInt8) = (0, 0)
        for byte in target.utf8 {
            if byte == UInt8(ascii: "/") && previous == (UInt8(ascii: ":"), UInt8(ascii: "/")) { return true }
            previous = (previous.1, byte)
        }
        return false
    }

    /// Checks a request head received by a forward proxy (RFC 9112 §3.2, §6.1, §6.3, §9.6; RFC 9110 §7.6.1).
    public static func request(_ head: HTTPHead) -> Result<RequestSemantics, HTTPParseError> {
        let target: RequestTarget
        if head.method == "CONNECT" {
            // RFC 9112 §3.2.3: authority-form, the port is required.
            if head.target.utf8.first == UInt8(ascii: "/") || Self.hasSchemeSeparator(head.target) {
                return .failure(HTTPParseError(.malformed, "CONNECT needs host:port as its target"))
            }
            switch HostPort.parse(head.target[...], defaultPort: nil) {
            case .failure(let error): return .failure(error)
            case .success(let authority): target = .connect(authority)
            }
        } else if head.target.utf8.first == UInt8(ascii: "/") || head.target == "*" {
            target = .notProxyRequest
        } else {
            switch AbsoluteURL.parse(head.target) {
            case .failure(let error): return .failure(error)
            case .success(let url): target = .absolute(url)
            }
        }

        // Host (RFC 9112 §3.2): at most one; required in HTTP/1.1 except for CONNECT, where the target is
        // the authority and some clients omit it.
        let hostIndices = head.indices(named: "host")
        if hostIndices.count > 1 {
            return .failure(HTTPParseError(.badFraming, "more than one Host header field"))
        }
        var dropped = FieldIndexSet()
        var replacementHost: String? = nil
        if case .absolute(let url) = target {
            if let hostIndex = hostIndices.first {
                // RFC 9112 §3.2.2: the target wins; keep the received bytes when they name the same authority.
                // RFC 9110 §7.2: a Host without a port names the scheme's default port, not the target's port.
                let schemePort = url.scheme == "https" ? 443 : 80
                let sent = HostPort.parse(head.value(at: hostIndex)[...], defaultPort: schemePort)
                if case .success(let authority) = sent, authority == url.authority {
                    // same authority: forwarded unchanged
                } else {
                    dropped.insert(hostIndex)
                    replacementHost = url.hostFieldValue
                }
            } else if head.version == .http1_1 {
                return .failure(HTTPParseError(.malformed, "HTTP/1.1 request without a Host header field"))
            } else {
                replacementHost = url.hostFieldValue
            }
        }

        let framing: BodyFraming
        switch requestFraming(head) {
        case .failure(let error): return .failure(error)
        case .success(let parsed): framing = parsed
        }
        if case .connect = target, framing != .none {
            return .failure(HTTPParseError(.badFraming, "CONNECT request with a body"))
        }

        let options = head.listElements(named: "connection")
        let wantsUpgrade = options.contains("upgrade") && head.firstIndex(named: "upgrade").count > 0
        var proxyAuthorization: Int? = nil
        for index in head.fields.indices {
            if head.field(index, isNamed: "proxy-authorization") {
                if proxyAuthorization != nil {
                    return .failure(HTTPParseError(.malformed, "more than one Proxy-Authorization header field"))
                }
                proxyAuthorization = index
            }
            if isHopByHop(head, index, options: options, keepUpgrade: wantsUpgrade) { dropped.insert(index) }
        }
        let keepAlive = head.version == .http1_1 && !options.contains("close")
        return .success(
            RequestSemantics(
                target: target,
                framing: framing,
                keepAlive: keepAlive,
                upgrade: wantsUpgrade,
                dropped: dropped,
                replacementHost: replacementHost,
                proxyAuthorization: proxyAuthorization
            ))
    }

    /// Request framing (RFC 9112 §6.3): Transfer-Encoding with chunked last, or one Content-Length, or none.
    static func requestFraming(_ head: HTTPHead) -> Result<BodyFraming, HTTPParseError> {
        let codings = head.listElements(named: "transfer-encoding")
        let hasTransferEncoding = head.firstIndex(named: "transfer-encoding").count > 0
        if hasTransferEncoding {
            if head.firstIndex(named: "content-length").count > 0 {
                return .failure(HTTPParseError(.badFraming, "both Transfer-Encoding and Content-Length"))
            }
            if head.version == .http1_0 {
                // RFC 9112 §6.1: Transfer-Encoding in an HTTP/1.0 message means the framing is faulty.
                return .failure(HTTPParseError(.badFraming, "Transfer-Encoding in an HTTP/1.0 request"))
            }
            guard codings.last == "chunked", codings.filter({ $0 == "chunked" }).count == 1 else {
                return .failure(HTTPParseError(.badFraming, "Transfer-Encoding must end with a single chunked"))
            }
            for coding in codings where !coding.utf8.allSatisfy({ ASCII.isTchar($0) }) {
                return .failure(HTTPParseError(.badFraming, "malformed Transfer-Encoding"))
            }
            return .success(.chunked)
        }
        switch contentLength(head) {
        case .failure(let error): return .failure(error)
        case .success(let length): return .success(length.map { $0 == 0 ? .none : .contentLength($0) } ?? .none)
        }
    }

    /// The Content-Length, when every value agrees (RFC 9110 §8.6, RFC 9112 §6.3 item 5); nil without one.
    static func contentLength(_ head: HTTPHead) -> Result<UInt64?, HTTPParseError> {
        var length: UInt64? = nil
        for index in head.fields.indices where head.field(index, isNamed: "content-length") {
            // Each comma-separated element in place (an empty one is an error too): no array of them.
            let value = head.valueBytes(at: index)
            var start = value.startIndex
            while true {
                let end = value[start...].firstIndex(of: UInt8(ascii: ",")) ?? value.endIndex
                var low = start
                var high = end
                while low < high && (value[low] == ASCII.space || value[low] == ASCII.tab) { low += 1 }
                while high > low && (value[high - 1] == ASCII.space || value[high - 1] == ASCII.tab) { high -= 1 }
                guard low < high, high - low <= 19 else {
                    return .failure(HTTPParseError(.badFraming, "invalid Content-Length"))
                }
                var parsed: UInt64 = 0
                for byte in value[low..<high] {
                    guard ASCII.isDigit(byte) else {
                        return .failure(HTTPParseError(.badFraming, "invalid Content-Length"))
                    }
                    parsed = parsed * 10 + UInt64(byte - 0x30)
                }
                // Lengths beyond 2^63 - 1: a next hop with signed 64-bit lengths would read another one.
                guard parsed <= UInt64(Int64.max) else {
                    return .failure(HTTPParseError(.badFraming, "Content-Length too large"))
                }
                if let length, length != parsed {
                    return .failure(HTTPParseError(.badFraming, "conflicting Content-Length values"))
                }
                length = parsed
                if end == value.endIndex { break }
                start = end + 1
            }
        }
        return .success(length)
    }

    static func isHopByHop(_ head: HTTPHead, _ index: Int, options: [String], keepUpgrade: Bool) -> Bool {
        // Most names have a length no name of the table has: one bit test instead of six comparisons.
        let length = head.fields[index].name.count
        if length < 64 && hopByHopLengths & (1 << UInt64(length)) != 0 {
            for name in alwaysHopByHop where head.field(index, isNamed: name) {
                if keepUpgrade && head.field(index, isNamed: "upgrade") { return false }
                return true
            }
        }
        if options.isEmpty { return false }
        let name = head.nameBytes(at: index)
        guard options.contains(where: { ASCII.equalsLowercase(name, bytes: $0.utf8) }) else { return false }
        return !protectedFields.contains { head.field(index, isNamed: $0) }
    }

    /// Checks a response head received by the proxy for a request with `requestMethod`
    /// (RFC 9112 §6.3, RFC 9110 §15.2).
    public static func response(
        _ head: HTTPHead, requestMethod: String, upgradeRequested: Bool
    ) -> Result<ResponseSemantics, HTTPParseError> {
        let options = head.listElements(named: "connection")
        let switches = head.status == 101
        if switches && !upgradeRequested {
            return .failure(HTTPParseError(.malformed, "101 Switching Protocols without an upgrade request"))
        }
        var dropped = FieldIndexSet()
        for index in head.fields.indices
        where isHopByHop(head, index, options: options, keepUpgrade: switches)
            && !head.field(index, isNamed: "proxy-authorization")
        {
            dropped.insert(index)
        }
        if switches {
            // The Connection field must reach the client for the upgrade to be recognised.
            dropped = dropped.filter { !head.field($0, isNamed: "connection") }
        }
        let interim = head.status < 200 && !switches
        let transferEncoded = head.firstIndex(named: "transfer-encoding").count > 0
        if transferEncoded {
            // RFC 9112 §6.3 item 3: Transfer-Encoding overrides Content-Length, which must not be forwarded, also
            // in a response without a body (to HEAD, 1xx, 204, 304).
            for index in head.indices(named: "content-length") { dropped.insert(index) }
        }
        let framing: BodyFraming
        if head.status < 200 || head.status == 204 || head.status == 304 || requestMethod == "HEAD" {
            framing = .none
        } else if transferEncoded {
            framing = head.listElements(named: "transfer-encoding").last == "chunked" ? .chunked : .untilClose
        } else {
            switch contentLength(head) {
            case .failure(let error): return .failure(error)
            case .success(let length): framing = length.map { .contentLength($0) } ?? .untilClose
            }
        }
        let serverCloses =
            options.contains("close") || framing == .untilClose || switches
            || (head.version == .http1_0 && !options.contains("keep-alive"))
        return .success(
            ResponseSemantics(
                framing: framing == .contentLength(0) ? .none : framing,
                isInterim: interim,
                switchesProtocols: switches,
                serverCloses: serverCloses,
                dropped: dropped
            ))
    }
}
