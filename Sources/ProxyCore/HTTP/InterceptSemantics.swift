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
    /// The client asked for a protocol upgrade (WebSocket): the request goes on a new connection of the proxy's
    /// own client, which becomes a tunnel after the origin's 101.
    public let upgrade: Bool
    /// `Expect: 100-continue` with a body: the proxy, which keeps the body before sending it, answers 100.
    public let expectsContinue: Bool
    /// The client accepts trailer fields after the response body (`TE: trailers`, RFC 9110 §10.1.4).
    public let acceptsTrailers: Bool
    /// A credential field held the origin's own placeholder (`placeholder_env`), for the audit log.
    public var placeholderUsed = false
    /// The protocols of the `Upgrade` fields (joined as one list) when `upgrade`: the proxy asks the origin for
    /// the same ones, Upgrade being hop-by-hop.
    public var upgradeProtocols: [UInt8] = []

    public init(
        method: String, target: String, framing: BodyFraming, keepAlive: Bool,
        upstreamFields: [(name: String, value: [UInt8])], clientAuthorization: Bool, upgrade: Bool,
        expectsContinue: Bool, acceptsTrailers: Bool
    ) {
        self.method = method
        self.target = target
        self.framing = framing
        self.keepAlive = keepAlive
        self.upstreamFields = upstreamFields
        self.clientAuthorization = clientAuthorization
        self.upgrade = upgrade
        self.expectsContinue = expectsContinue
        self.acceptsTrailers = acceptsTrailers
    }

    public static func == (lhs: Self, rhs: Self) -> Bool {
        lhs.method == rhs.method && lhs.target == rhs.target && lhs.framing == rhs.framing
            && lhs.keepAlive == rhs.keepAlive && lhs.upstreamFields.map(\.name) == rhs.upstreamFields.map(\.name)
            && lhs.upstreamFields.map(\.value) == rhs.upstreamFields.map(\.value)
            && lhs.clientAuthorization == rhs.clientAuthorization && lhs.upgrade == rhs.upgrade
            && lhs.expectsContinue == rhs.expectsContinue && lhs.acceptsTrailers == rhs.acceptsTrailers
            && lhs.placeholderUsed == rhs.placeholderUsed && lhs.upgradeProtocols == rhs.upgradeProtocols
    }
}

/// Why an intercepted request is answered by the proxy itself.
public enum InterceptRefusal: Error, Sendable, Equatable {
    case badRequest(HTTPParseError)
    /// Host (or absolute-form target) names another authority than the tunnel's: 421, no token.
    case misdirected(String)
    case unsupported(String)
    /// A web page of another origin made the request (`browser_requests = refuse`): 403, no token. `close`: the
    /// body, if any, was not read.
    case browserRequest(BrowserRefusal, close: Bool)
    /// A credential of the client's own with `client_credential = refuse`: 403, nothing sent. `close`: the body, if
    /// any, was not read.
    case credentialRefused(String, close: Bool)
    /// A placeholder of another origin, anywhere in the request: 403, nothing sent, and an audit line (a refused
    /// use of that origin's credential). `close` as above.
    case placeholderRefused(PlaceholderRefusal, close: Bool)

    public var answer: ProxyAnswer {
        switch self {
        case .badRequest(let error): .badRequest(error)
        case .misdirected(let reason): .misdirected(reason: reason)
        case .unsupported(let reason): .unsupported(reason: reason)
        case .browserRequest(let refusal, let close): .browserRequestRefused(refusal, close: close)
        case .credentialRefused(let reason, let close): .credentialRefused(reason: reason, close: close)
        case .placeholderRefused(let refusal, let close): .credentialRefused(reason: refusal.reason, close: close)
        }
    }

    /// The refusal of a request whose credential fields `scan` describes, if it is refused
    /// (`OriginConfig.credentialRefusal`): a placeholder of another origin, or the client's own credential under
    /// `client_credential = refuse`.
    static func credential(_ scan: CredentialScan, for protected: OriginConfig, close: Bool) -> InterceptRefusal? {
        guard let reason = protected.credentialRefusal(scan) else { return nil }
        if let foreign = scan.foreign {
            return .placeholderRefused(PlaceholderRefusal(reason: reason, owner: foreign), close: close)
        }
        return .credentialRefused(reason, close: close)
    }

    /// The refused use of another origin's credential this refusal is, for the audit log; nil for other refusals.
    public func refusedUse(origin: OriginConfig, method: String, target: String) -> RefusedCredentialUse? {
        guard case .placeholderRefused(let refusal, _) = self else { return nil }
        return RefusedCredentialUse(origin: origin.url, method: method, target: target, refusal: refusal)
    }
}

extension MessageSemantics {
    /// Checks a request for the protected origin `protected` (RFC 9112 §3.2, §6.3; RFC 9110 §7.2, §7.6.1).
    ///
    /// Fail closed: the Host field (and an absolute-form target) must name exactly the origin's authority,
    /// after normalising case, trailing dot and default port; otherwise the request is misdirected. A request a
    /// web page of another origin made is refused (`OriginConfig.browserRefusal`). Whether the token replaces the
    /// client's own Authorization is the origin's `client_authorization` (`OriginConfig.attachesToken`).
    public static func interceptedRequest(
        _ head: HTTPHead, for protected: OriginConfig
    ) -> Result<InterceptedRequest, InterceptRefusal> {
        let (scheme, origin) = (protected.scheme, protected.authority)
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
        let (host, hostCount) = head.firstIndex(named: "host")
        if hostCount == 0 && head.version == .http1_0 {
            // HTTP/1.0 has no Host requirement: the tunnel names the authority.
        } else if hostCount != 1 {
            return .failure(
                hostCount == 0
                    ? .badRequest(HTTPParseError(.malformed, "request without a Host header field"))
                    : .badRequest(HTTPParseError(.badFraming, "more than one Host header field")))
        }
        if let host, case let value = head.valueBytes(at: host), !origin.isSpelled(by: value, defaultPort: defaultPort)
        {
            switch HostPort.parse(bytes: value, defaultPort: defaultPort) {
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
        let upgrade = options.contains("upgrade") && head.firstIndex(named: "upgrade").count > 0
        // The credential fields the client sent (its own, or the origin's placeholder), and any placeholder of
        // another origin anywhere.
        let scan = protected.scanCredentials(target: head.target.utf8) { visit in
            for index in head.fields.indices {
                visit(head.bytes[head.fields[index].name], head.valueBytes(at: index))
            }
        }
        let clientAuthorization = scan.clientCredential
        let attach = protected.attachesToken(clientHasAuthorization: clientAuthorization)
        var fields: [(name: String, value: [UInt8])] = []
        fields.reserveCapacity(head.fields.count)
        // What the request says about the page that made it, if a browser made it (read in the same pass).
        var fetchSite: [ArraySlice<UInt8>] = []
        var initiator: [ArraySlice<UInt8>] = []
        var referer: [ArraySlice<UInt8>] = []
        for index in head.fields.indices {
            if head.field(index, isNamed: "sec-fetch-site") {
                fetchSite.append(head.valueBytes(at: index))
            } else if head.field(index, isNamed: "origin") {
                initiator.append(head.valueBytes(at: index))
            } else if head.field(index, isNamed: "referer") {
                referer.append(head.valueBytes(at: index))
            }
            // Hop-by-hop fields (the one table in MessageSemantics, with the Connection options), and what the
            // transfer sets itself: Host (the URL), the framing, Expect (the proxy answered 100 itself).
            if isHopByHop(head, index, options: options, keepUpgrade: false) || head.field(index, isNamed: "host")
                || head.field(index, isNamed: "content-length") || head.field(index, isNamed: "transfer-encoding")
                || head.field(index, isNamed: "expect")
            {
                continue
            }
            if attach && protected.isCredentialField(head.bytes[head.fields[index].name]) { continue }
            fields.append((head.name(at: index), Array(head.valueBytes(at: index))))
        }
        let keepAlive = head.version == .http1_1 && !options.contains("close")
        if let refusal = protected.browserRefusal(fetchSite: fetchSite, origin: initiator, referer: referer) {
            return .failure(.browserRequest(refusal, close: framing != .none || !keepAlive))
        }
        if let refusal = InterceptRefusal.credential(scan, for: protected, close: framing != .none || !keepAlive) {
            return .failure(refusal)
        }
        var request = InterceptedRequest(
            method: head.method, target: target, framing: framing,
            keepAlive: head.version == .http1_1 && !options.contains("close"), upstreamFields: fields,
            clientAuthorization: clientAuthorization, upgrade: upgrade,
            expectsContinue: framing != .none && head.listElements(named: "expect").contains("100-continue"),
            acceptsTrailers: head.listElements(named: "te").contains("trailers"))
        request.placeholderUsed = scan.placeholderUsed
        if upgrade {
            for index in head.indices(named: "upgrade") {
                if !request.upgradeProtocols.isEmpty { request.upgradeProtocols += Array(", ".utf8) }
                request.upgradeProtocols += head.valueBytes(at: index)
            }
        }
        return .success(request)
    }

    /// The response head to send an HTTP/1.1 client for an origin's response (which libcurl already
    /// de-chunked, or received over HTTP/2): the hop-by-hop fields `MessageSemantics.response` found removed,
    /// the framing chosen anew (the origin's Content-Length when it gave one, else chunked), the reason
    /// phrase and field values as the origin's bytes (obs-text need not be UTF-8), the proxy's
    /// `Proxy-Status` added when set.
    public static func interceptedResponseHead(
        _ response: UpstreamResponse, requestMethod: String, close: Bool
    ) -> (head: [UInt8], framing: ResponseFramingToClient) {
        let head = response.head
        let status = head.status
        let noBody = status < 200 || status == 204 || status == 304 || requestMethod == "HEAD"
        let framing: ResponseFramingToClient
        switch response.semantics.framing {
        // A response that may have a body but has none (Content-Length: 0) says so with its own length.
        case .none: framing = noBody ? .none : .contentLength(0)
        case .contentLength(let length): framing = .contentLength(length)
        case .chunked, .untilClose: framing = .chunked
        }
        var out: [UInt8] = []
        out.reserveCapacity(head.bytes.count + 64)
        out += "HTTP/1.1 ".utf8
        out.append(UInt8(ascii: "0") + UInt8(clamping: status / 100 % 10))
        out.append(UInt8(ascii: "0") + UInt8(clamping: status / 10 % 10))
        out.append(UInt8(ascii: "0") + UInt8(clamping: status % 10))
        out.append(ASCII.space)
        // The reason phrase: the status line after "HTTP/1.1 200 ".
        let reasonStart = head.startLine.lowerBound + 13
        if reasonStart < head.startLine.upperBound {
            out += head.bytes[reasonStart..<head.startLine.upperBound]
        } else {
            out += ProxyResponse.reasonPhrase(head.status).utf8
        }
        out += "\r\n".utf8
        func append(_ name: some Sequence<UInt8>, _ value: some Sequence<UInt8>) {
            out += name
            out.append(ASCII.colon)
            out.append(ASCII.space)
            out += value
            out.append(ASCII.cr)
            out.append(ASCII.lf)
        }
        // The field lines as received (as a forwarded head's are), but for the hop-by-hop ones and the
        // origin's framing, which is re-done here: a HEAD or 304 response keeps its Content-Length (it describes
        // the would-be body).
        head.appendFieldLines(to: &out) { index in
            response.semantics.dropped.contains(index) || head.field(index, isNamed: "transfer-encoding")
                || head.field(index, isNamed: "trailer")
                || (framing != .none && head.field(index, isNamed: "content-length"))
        }
        if let proxyStatus = response.proxyStatus { append("Proxy-Status".utf8, proxyStatus.fieldValue.utf8) }
        if case .contentLength(let length) = framing { append("Content-Length".utf8, String(length).utf8) }
        if framing == .chunked { append("Transfer-Encoding".utf8, "chunked".utf8) }
        if close { append("Connection".utf8, "close".utf8) }
        out += "\r\n".utf8
        return (out, framing)
    }
}

/// How the proxy frames a response body toward the client on an intercepted connection.
public enum ResponseFramingToClient: Sendable, Equatable {
    case none
    case contentLength(UInt64)
    case chunked
}
