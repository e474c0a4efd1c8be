/// A request received for a protected origin (inside an intercepted tunnel, or an absolute-form request to
/// an `http://` origin), checked and turned into what goes upstream.
public struct InterceptedRequest: Sendable, Equatable {
    public let method: String
    /// The origin-form target (`/path?query`).
    public let target: String
    public let framing: BodyFraming
    public let keepAlive: Bool
    /// Field lines to send upstream: every received line except hop-by-hop fields, Host (the URL carries
    /// it), Content-Length and Transfer-Encoding (the transfer sets its own framing), Expect, and
    /// Authorization when the proxy attaches its own. Values are bytes: obs-text need not be UTF-8.
    public let upstreamFields: [(name: String, value: [UInt8])]
    /// The client sent its own Authorization field.
    public let clientAuthorization: Bool
    /// The client asked for a protocol upgrade (not supported on intercepted connections).
    public let upgrade: Bool
    /// `Expect: 100-continue` with a body: the proxy, which keeps the body before sending it, answers 100.
    public let expectsContinue: Bool

    public static func == (lhs: Self, rhs: Self) -> Bool {
        lhs.method == rhs.method && lhs.target == rhs.target && lhs.framing == rhs.framing
            && lhs.keepAlive == rhs.keepAlive && lhs.upstreamFields.map(\.name) == rhs.upstreamFields.map(\.name)
            && lhs.upstreamFields.map(\.value) == rhs.upstreamFields.map(\.value)
            && lhs.clientAuthorization == rhs.clientAuthorization && lhs.upgrade == rhs.upgrade
            && lhs.expectsContinue == rhs.expectsContinue
    }
}

/// Why an intercepted request is answered by the proxy itself.
public enum InterceptRefusal: Error, Sendable, Equatable {
    case badRequest(HTTPParseError)
    /// Host (or absolute-form target) names another authority than the tunnel's: 421, no token.
    case misdirected(String)
    case unsupported(String)

    public var response: ProxyResponse {
        switch self {
        case .badRequest(let error):
            return FrontDoor.reject(error)
        case .misdirected(let reason):
            return ProxyResponse(
                status: 421,
                proxyStatus: ProxyStatus(error: .httpRequestDenied, details: reason),
                message: "proxyctl: misdirected request: \(reason); no token was sent", close: true)
        case .unsupported(let reason):
            return ProxyResponse(
                status: 501, proxyStatus: ProxyStatus(error: .httpRequestError, details: reason),
                message: "proxyctl: \(reason)", close: true)
        }
    }
}

extension MessageSemantics {
    /// Checks a request for the protected origin `origin` (RFC 9112 §3.2, §6.3; RFC 9110 §7.2, §7.6.1).
    ///
    /// Fail closed: the Host field (and an absolute-form target) must name exactly the origin's authority,
    /// after normalising case, trailing dot and default port; otherwise the request is misdirected.
    public static func interceptedRequest(
        _ head: HTTPHead, scheme: String, origin: HostPort, attachToken: (_ clientHasAuthorization: Bool) -> Bool
    ) -> Result<InterceptedRequest, InterceptRefusal> {
        let defaultPort = scheme == "https" ? 443 : 80
        var target = head.target
        if head.method == "CONNECT" {
            return .failure(.unsupported("CONNECT inside a tunnel to a protected origin is not supported"))
        }
        if target.utf8.first != UInt8(ascii: "/") {
            if target == "*" && head.method == "OPTIONS" {
                // asterisk-form is fine: the server-wide OPTIONS.
            } else {
                switch AbsoluteURL.parse(target) {
                case .failure(let error): return .failure(.badRequest(error))
                case .success(let url):
                    guard url.scheme == scheme, url.authority == origin else {
                        return .failure(
                            .misdirected("the request names \(url.scheme)://\(url.authority), not this origin"))
                    }
                    target = url.pathAndQuery
                }
            }
        }
        let hosts = head.indices(named: "host")
        if hosts.isEmpty && head.version == .http1_0 {
            // HTTP/1.0 has no Host requirement: the tunnel names the authority.
        } else if hosts.count != 1 {
            return .failure(
                hosts.isEmpty
                    ? .badRequest(HTTPParseError(.malformed, "request without a Host header field"))
                    : .badRequest(HTTPParseError(.badFraming, "more than one Host header field")))
        }
        if let host = hosts.first {
            switch HostPort.parse(head.value(at: host)[...], defaultPort: defaultPort) {
            case .failure:
                return .failure(.misdirected("the Host field is not a valid authority"))
            case .success(let authority):
                guard authority == origin else {
                    return .failure(.misdirected("Host \(authority) does not match the tunnel's \(origin)"))
                }
            }
        }
        let framing: BodyFraming
        switch requestFraming(head) {
        case .failure(let error): return .failure(.badRequest(error))
        case .success(let parsed): framing = parsed
        }
        let options = head.listElements(named: "connection")
        let upgrade = options.contains("upgrade") && !head.indices(named: "upgrade").isEmpty
        let clientAuthorization = !head.indices(named: "authorization").isEmpty
        let attach = attachToken(clientAuthorization)
        var fields: [(name: String, value: [UInt8])] = []
        for index in head.fields.indices {
            if head.field(index, isNamed: "connection") || head.field(index, isNamed: "proxy-connection")
                || head.field(index, isNamed: "keep-alive") || head.field(index, isNamed: "te")
                || head.field(index, isNamed: "upgrade") || head.field(index, isNamed: "proxy-authorization")
                || head.field(index, isNamed: "host") || head.field(index, isNamed: "content-length")
                || head.field(index, isNamed: "transfer-encoding") || head.field(index, isNamed: "expect")
            {
                continue
            }
            if attach && head.field(index, isNamed: "authorization") { continue }
            if !options.isEmpty && options.contains(head.name(at: index).lowercased()) { continue }
            fields.append((head.name(at: index), Array(head.valueBytes(at: index))))
        }
        return .success(
            InterceptedRequest(
                method: head.method, target: target, framing: framing,
                keepAlive: head.version == .http1_1 && !options.contains("close"), upstreamFields: fields,
                clientAuthorization: clientAuthorization, upgrade: upgrade,
                expectsContinue: framing != .none && head.listElements(named: "expect").contains("100-continue")))
    }

    /// The response head to send the client for an upstream response (which libcurl already de-chunked, or
    /// received over HTTP/2): hop-by-hop fields removed, framing chosen anew. The reason phrase and field
    /// values are the origin's bytes (obs-text need not be UTF-8); `extra` holds the proxy's own fields.
    public static func interceptedResponseHead(
        status: Int, reason: [UInt8]?, fields: [(name: String, value: [UInt8])], requestMethod: String,
        close: Bool, extra: [(name: String, value: String)]
    ) -> (head: [UInt8], framing: ResponseFramingToClient) {
        let noBody = status < 200 || status == 204 || status == 304 || requestMethod == "HEAD"
        var length: UInt64? = nil
        var chunkedUpstream = false
        var options: [String] = []
        for (name, value) in fields {
            switch name.lowercased() {
            case "content-length": length = UInt64(String(decoding: value, as: UTF8.self).trimmingOWS())
            case "transfer-encoding": chunkedUpstream = true
            case "connection":
                // Bytes and ASCII case folding, as the client reads them (see `HTTPHead.listElements`).
                options += value.split(separator: UInt8(ascii: ",")).map {
                    String(decoding: $0.map(ASCII.lower), as: UTF8.self).trimmingOWS()
                }
            default: break
            }
        }
        let framing: ResponseFramingToClient
        if noBody {
            framing = .none
        } else if let length, !chunkedUpstream {
            framing = .contentLength(length)
        } else {
            framing = .chunked
        }
        var head: [UInt8] = []
        head.reserveCapacity(512)
        head += "HTTP/1.1 \(status) ".utf8
        if let reason, !reason.isEmpty {
            head += reason
        } else {
            head += ProxyResponse.reasonPhrase(status).utf8
        }
        head += "\r\n".utf8
        func append(_ name: String, _ value: some Sequence<UInt8>) {
            head += name.utf8
            head += ": ".utf8
            head += value
            head += "\r\n".utf8
        }
        for (name, value) in fields {
            let lowered = name.lowercased()
            if ["connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade", "te", "trailer"]
                .contains(lowered) || options.contains(lowered)
            {
                continue
            }
            // A HEAD or 304 response keeps its Content-Length (it describes the would-be body). A body's length is
            // written once below: duplicates, "+5", or a Connection option naming it must not reach the client.
            if lowered == "content-length" && framing != .none { continue }
            append(name, value)
        }
        for (name, value) in extra { append(name, value.utf8) }
        if case .contentLength(let length) = framing { append("Content-Length", String(length).utf8) }
        if framing == .chunked { append("Transfer-Encoding", "chunked".utf8) }
        if close { append("Connection", "close".utf8) }
        head += "\r\n".utf8
        return (head, framing)
    }
}

/// How the proxy frames a response body toward the client on an intercepted connection.
public enum ResponseFramingToClient: Sendable, Equatable {
    case none
    case contentLength(UInt64)
    case chunked
}
