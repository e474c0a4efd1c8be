import ProxyCore

/// Fields an intercepted request never sends upstream, whatever the client or Connection say: hop-by-hop
/// fields (RFC 9110 §7.6.1), the proxy's credentials, Host (the URL carries it), the framing (the transfer
/// sets its own) and Expect (the proxy answers 100 itself).
private let neverUpstream: Set<[UInt8]> = Set(
    [
        "connection", "proxy-connection", "keep-alive", "te", "upgrade", "proxy-authorization", "host",
        "content-length", "transfer-encoding", "expect",
    ].map(bytes))

/// Fields the proxy never passes from an upstream response to the client (RFC 9110 §7.6.1).
private let hopByHopResponse: Set<[UInt8]> = Set(
    ["connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade", "te", "trailer"].map(bytes))

/// Authorities the harness tries a request against when its own Host does not decide it.
private let someOrigins: [(scheme: String, authority: String)] = [
    ("https", "api.example.com:443"), ("https", "git.example.com:8443"), ("http", "127.0.0.1:8000"),
    ("http", "[::1]:8080"), ("http", "localhost:80"),
]

private let responseMethods = ["GET", "HEAD", "POST", "DELETE"]

/// `HTTP/` at the start: a response head for `interceptedResponseHead`; anything else: request heads for
/// `interceptedRequest`.
public func fuzzInterceptSemantics(_ data: UnsafeBufferPointer<UInt8>) {
    let input = Array(data)
    if input.starts(at: 0, with: bytes("HTTP/")) {
        fuzzInterceptedResponse(input)
    } else {
        fuzzInterceptedRequests(input)
    }
}

// MARK: - Requests

private func fuzzInterceptedRequests(_ input: [UInt8]) {
    var random = InputRandom(input, salt: 0x31)
    for found in feedHeads(input, kind: .request, limits: HTTPHeadLimits(), split: .whole, maxMessages: 4).heads {
        let head = found.head
        // Mostly an origin the request names itself (its Host, or its absolute target), so that the checks
        // past the Host comparison run; sometimes a fixed one, which it rarely matches.
        var candidates: [(scheme: String, origin: HostPort)] = []
        for scheme in ["https", "http"] {
            let port = scheme == "https" ? 443 : 80
            for index in head.indices(named: "host") {
                if case .success(let host) = HostPort.parse(head.value(at: index)[...], defaultPort: port) {
                    candidates.append((scheme, host))
                }
            }
        }
        if case .success(let url) = AbsoluteURL.parse(head.target) { candidates.append((url.scheme, url.authority)) }
        let fixed = someOrigins[random.next(in: 0...(someOrigins.count - 1))]
        if case .success(let authority) = HostPort.parse(fixed.authority[...], defaultPort: nil) {
            candidates.append((fixed.scheme, authority))
        }
        let (scheme, origin) = candidates[random.next(in: 0...(candidates.count - 1))]
        let replace = random.nextBool()
        var protected = OriginConfig(scheme: scheme, authority: origin)
        protected.clientAuthorization = replace ? .replace : .keep
        protected.browserRequests = random.next(in: 0...3) == 0 ? .allow : .refuse
        // Sometimes the request's own Origin is an allowed one, so that the admitting path runs too.
        if random.nextBool(), let index = head.indices(named: "origin").first,
            let allowed = WebOrigin.parse(head.valueBytes(at: index))
        {
            protected.allowedRequestOrigins = [allowed]
        }
        switch MessageSemantics.interceptedRequest(head, for: protected) {
        case .success(let request):
            checkInterceptedRequest(
                request, head: head, scheme: scheme, origin: origin, attached: replace || !request.clientAuthorization)
            checkBrowserRequestAdmitted(head, protected)
        case .failure(let refusal):
            checkRefusal(refusal, head: head, scheme: scheme, origin: origin, protected: protected)
        }
    }
}

/// A request admitted under `browser_requests = refuse` is a tool's, the origin's own page's, the user's own
/// navigation, or an allowed web app's: what each field says, read here on the wire's bytes.
private func checkBrowserRequestAdmitted(_ head: HTTPHead, _ protected: OriginConfig) {
    guard protected.browserRequests == .refuse else { return }
    let own = WebOrigin(scheme: protected.scheme, authority: protected.authority)
    let admitted = [own] + protected.allowedRequestOrigins
    let origins = head.indices(named: "origin")
    let sites = head.indices(named: "sec-fetch-site")
    invariant(origins.count <= 1 && sites.count <= 1, "admitted a request with repeated Origin or Sec-Fetch-Site")
    var initiator: WebOrigin? = nil
    if let index = origins.first {
        let parsed = WebOrigin.parse(head.value(at: index).utf8)
        invariant(parsed.map(admitted.contains) == true, "admitted Origin \(head.value(at: index).debugDescription)")
        initiator = parsed
    } else if let index = head.indices(named: "referer").first, head.indices(named: "referer").count == 1 {
        initiator = WebOrigin.ofURL(head.value(at: index).utf8)
    }
    if let index = sites.first {
        let site = head.value(at: index).lowercased()
        invariant(
            site == "same-origin" || site == "none" || initiator.map(admitted.contains) == true,
            "admitted Sec-Fetch-Site \(site.debugDescription) from \(initiator?.description ?? "nowhere")")
    }
}

/// An accepted intercepted request names exactly the origin, and sends upstream every end-to-end field of
/// the client in order and nothing else.
func checkInterceptedRequest(
    _ request: InterceptedRequest, head: HTTPHead, scheme: String, origin: HostPort, attached: Bool
) {
    invariant(request.method == head.method && head.method != "CONNECT", "intercepted method \(request.method)")
    if head.target.utf8.first == UInt8(ascii: "/") {
        invariant(request.target == head.target, "origin-form target changed to \(request.target.debugDescription)")
    } else if head.target == "*" {
        invariant(head.method == "OPTIONS" && request.target == "*", "asterisk-form for \(head.method)")
    } else {
        guard case .success(let url) = AbsoluteURL.parse(head.target) else {
            return invariant(false, "accepted the target \(head.target.debugDescription)")
        }
        invariant(
            url.scheme == scheme && url.authority == origin, "accepted \(url.scheme)://\(url.authority) for \(origin)")
        invariant(request.target == url.pathAndQuery, "absolute target became \(request.target.debugDescription)")
    }
    let hosts = head.indices(named: "host")
    // HTTP/1.0 has no Host requirement (the tunnel names the authority); HTTP/1.1 needs exactly one.
    invariant(
        hosts.count == 1 || (hosts.isEmpty && head.version == .http1_0), "accepted \(hosts.count) Host fields")
    if let host = hosts.first {
        let parsed = HostPort.parse(head.value(at: host)[...], defaultPort: scheme == "https" ? 443 : 80)
        invariant(
            (try? parsed.get()) == origin, "accepted Host \(head.value(at: host).debugDescription) for \(origin)")
    }
    invariant(
        request.clientAuthorization == !head.indices(named: "authorization").isEmpty, "clientAuthorization is wrong")

    // Exactly the client's end-to-end fields, in order, byte for byte.
    let options = Set(rawListElements(head, "connection"))
    var expected: [(name: String, value: [UInt8])] = []
    for index in head.fields.indices {
        let name = asciiLowercased(head.bytes[head.fields[index].name])
        if neverUpstream.contains(name) || options.contains(name) { continue }
        if attached && name == bytes("authorization") { continue }
        expected.append((head.name(at: index), Array(head.valueBytes(at: index))))
    }
    invariant(
        request.upstreamFields.map(\.name) == expected.map(\.name)
            && request.upstreamFields.map(\.value) == expected.map(\.value),
        "upstream fields \(request.upstreamFields.map(\.name)), expected \(expected.map(\.name))")
    for field in request.upstreamFields {
        let name = asciiLowercased(bytes(field.name))
        invariant(!neverUpstream.contains(name), "\(field.name) sent upstream")
        invariant(!(attached && name == bytes("authorization")), "the client's Authorization sent with the token")
    }

    invariant(
        request.keepAlive == (head.version == .http1_1 && !options.contains(bytes("close"))),
        "keepAlive \(request.keepAlive) disagrees with Connection on the wire")
    invariant(
        request.upgrade == (options.contains(bytes("upgrade")) && !head.indices(named: "upgrade").isEmpty),
        "upgrade \(request.upgrade) disagrees with the wire")
    invariant(
        request.expectsContinue
            == (request.framing != .none && rawListElements(head, "expect").contains(bytes("100-continue"))),
        "expectsContinue \(request.expectsContinue)")
    if case .success(let semantics) = MessageSemantics.request(head) {
        invariant(
            semantics.framing == request.framing, "framing \(request.framing), forwarding says \(semantics.framing)")
    }
    if request.framing == .untilClose { invariant(false, "an intercepted request framed until close") }

    // What goes upstream is a valid request with the framing the proxy chose.
    var wire = Array("\(request.method) \(request.target) HTTP/1.1\r\nHost: \(origin.description)\r\n".utf8)
    for field in request.upstreamFields { wire += Array("\(field.name): ".utf8) + field.value + Array("\r\n".utf8) }
    switch request.framing {
    case .chunked: wire += Array("Transfer-Encoding: chunked\r\n".utf8)
    case .contentLength(let length): wire += Array("Content-Length: \(length)\r\n".utf8)
    case .none, .untilClose: break
    }
    wire += Array("\r\n".utf8)
    var parser = HTTPHeadParser(kind: .request, limits: generousLimits)
    guard case .complete(let upstream, let consumed) = parser.parse(wire) else {
        return invariant(
            false, "the upstream request does not parse: \(text(Array(wire.prefix(300))).debugDescription)")
    }
    invariant(consumed == wire.count, "the upstream request has trailing bytes")
    switch MessageSemantics.request(upstream) {
    case .success(let again):
        invariant(again.framing == request.framing, "the upstream request has framing \(again.framing)")
    case .failure(let error):
        invariant(false, "the upstream request is invalid: \(error)")
    }
}

/// A refused request gets a response that parses, and a 421 never for a request that names the origin.
private func checkRefusal(
    _ refusal: InterceptRefusal, head: HTTPHead, scheme: String, origin: HostPort, protected: OriginConfig
) {
    let response = refusal.answer.response
    if case .browserRequest(_, let close) = refusal {
        // The connection goes on when nothing of the request is left unread.
        let keepAlive = head.version == .http1_1 && !rawListElements(head, "connection").contains(bytes("close"))
        if !close {
            invariant(keepAlive, "a browser refusal keeps a connection the client asked to close")
            if case .success(let semantics) = MessageSemantics.request(head) {
                invariant(semantics.framing == .none, "a browser refusal keeps a connection with an unread body")
            }
        }
    } else {
        invariant(response.close, "a refused intercepted request keeps the connection")
    }
    var parser = HTTPHeadParser(kind: .response, limits: generousLimits)
    guard case .complete(let parsed, _) = parser.parse(response.serialized()) else {
        return invariant(false, "the refusal \(response.status) does not parse")
    }
    invariant(parsed.status == response.status, "refusal status")
    switch refusal {
    case .misdirected:
        invariant(response.status == 421, "misdirected answered \(response.status)")
        let hosts = head.indices(named: "host")
        let targetMatches: Bool
        if case .success(let url) = AbsoluteURL.parse(head.target) {
            targetMatches = url.scheme == scheme && url.authority == origin
        } else {
            targetMatches = true
        }
        if hosts.count == 1, targetMatches,
            case .success(let host) = HostPort.parse(
                head.value(at: hosts[0])[...], defaultPort: scheme == "https" ? 443 : 80)
        {
            invariant(host != origin, "misdirected, but Host and target name the origin \(origin)")
        }
    case .unsupported:
        invariant(response.status == 501, "unsupported answered \(response.status)")
    case .badRequest(let error):
        invariant(response.status == error.status, "bad request answered \(response.status)")
    case .browserRequest(let refused, _):
        invariant(response.status == 403, "a browser refusal answered \(response.status)")
        invariant(protected.browserRequests == .refuse, "refused a browser request under browser_requests = allow")
        invariant(
            !(head.indices(named: "origin").isEmpty && head.indices(named: "sec-fetch-site").isEmpty),
            "refused a tool's request (no Origin, no Sec-Fetch-Site) as a browser's: \(refused.details)")
    case .credentialRefused:
        invariant(response.status == 403, "a credential refusal answered \(response.status)")
        invariant(protected.clientAuthorization == .refuse, "a client credential refused without refuse")
    case .placeholderRefused(let refusal, _):
        invariant(response.status == 403, "a placeholder refusal answered \(response.status)")
        invariant(
            protected.placeholders.entries.contains { $0.origin == refusal.origin && $0.origin != protected.url },
            "refused for the placeholder of \(refusal.origin), not another origin's placeholder of the table")
    }
}

// MARK: - Responses

/// The origin every response harness exchange belongs to.
private let responseOrigin: OriginConfig = {
    var origin = OriginConfig(scheme: "https", authority: HostPort(host: "api.example.com", port: 443, kind: .name))
    origin.provider = "corp"
    // The harness's request without a token brings its own Authorization, to be kept (replace is the default).
    origin.clientAuthorization = .keep
    return origin
}()

/// Lines of a response head as libcurl hands them to the header callback: each with its terminator.
private func headerLines(_ input: [UInt8]) -> [[UInt8]] {
    var lines: [[UInt8]] = []
    var start = 0
    for index in input.indices where input[index] == 0x0A {
        lines.append(Array(input[start...index]))
        start = index + 1
    }
    if start < input.count { lines.append(Array(input[start...]) + [0x0D, 0x0A]) }
    return lines
}

/// The intercept path's response side, end to end in ProxyCore: header lines into a `ProtectedExchange`
/// (which parses them with `HTTPHeadParser` and checks them with `MessageSemantics.response`), then the
/// head an HTTP/1.1 client gets. Whatever the origin sends, the client gets one well-framed head, or a 502.
private func fuzzInterceptedResponse(_ input: [UInt8]) {
    var random = InputRandom(input, salt: 0x32)
    let method = responseMethods[random.next(in: 0...(responseMethods.count - 1))]
    let attach = random.nextBool()
    var head = "\(method) /resource HTTP/1.1\r\nHost: api.example.com\r\n"
    if !attach { head += "Authorization: Bearer client-own\r\n" }
    var parser = HTTPHeadParser(kind: .request)
    guard case .complete(let requestHead, _) = parser.parse(Array((head + "\r\n").utf8)),
        case .success(let request) = MessageSemantics.interceptedRequest(requestHead, for: responseOrigin)
    else { return invariant(false, "the harness request does not parse") }
    func sending() -> ProtectedExchange {
        var exchange = ProtectedExchange(
            request: request, origin: responseOrigin,
            settings: ProtectedExchange.Settings(
                replaySpool: 1 << 20, connectTimeout: 1_000, idleTimeout: 1_000,
                responseHeadLimits: HTTPHeadLimits()),
            knownNonce: nil)
        var outputs: [ProtectedExchange.Output] = []
        exchange.start(&outputs)
        if attach { exchange.tokens(.success(TokenGrant(generation: 1)), &outputs) }
        invariant(outputs.contains { if case .send = $0 { true } else { false } }, "the exchange did not send")
        return exchange
    }
    // The proxy's own client reads the head once (`ResponseReader`) and hands it over whole; a head it cannot
    // read ends the transfer with the failure (`OriginExchange`).
    var exchange = sending()
    var outputs: [ProtectedExchange.Output] = []
    var reader = ResponseReader(requestMethod: method)
    var read: [ResponseReader.Output] = []
    _ = input.withUnsafeBytes { reader.read($0, &read) }
    var failure: (UpstreamFailure, detail: String)?
    for output in read {
        switch output {
        case .head(let received): exchange.upstreamResponseHead(received, &outputs)
        case .failed(let error): failure = failure ?? (OriginExchange.failure(error), "\(error)")
        default: break
        }
    }
    exchange.transferFinished(failure, &outputs)

    var delivered: UpstreamResponse?
    var answered: ProxyAnswer?
    for output in outputs {
        switch output {
        case .deliverHead(let response):
            invariant(delivered == nil && answered == nil, "two response heads for one request")
            delivered = response
        case .respond(let answer):
            invariant(delivered == nil && answered == nil, "an answer after a response head")
            answered = answer
        case .send, .refreshTokens, .getTokens:
            // A 401 with a token attached: refreshed and replayed, not the client's business.
            invariant(attach, "a retry without a token attached")
        default:
            break
        }
    }
    if let answered {
        invariant(answered.status == 502, "the proxy answered \(answered.status) for an upstream head")
    }
    guard let delivered else { return }
    let close = random.nextBool()
    let (out, framing) = MessageSemantics.interceptedResponseHead(delivered, requestMethod: method, close: close)
    let status = delivered.head.status
    let noBody = status < 200 || status == 204 || status == 304 || method == "HEAD"
    invariant(noBody == (framing == .none), "framing \(framing) for a \(status) to \(method)")

    var clientParser = HTTPHeadParser(kind: .response, limits: generousLimits)
    guard case .complete(let sent, let consumed) = clientParser.parse(out) else {
        return invariant(
            false, "the head for the client does not parse: \(text(Array(out.prefix(300))).debugDescription)")
    }
    invariant(consumed == out.count, "the head for the client has trailing bytes")
    invariant(sent.status == status && sent.version == .http1_1, "status line \(sent.status) \(sent.version)")
    invariant(!out.indices.dropFirst().contains { out[$0] == 0x0A && out[$0 - 1] != 0x0D }, "a bare LF")

    // Framing: exactly one, the one announced.
    let lengths = sent.indices(named: "content-length")
    let codings = sent.indices(named: "transfer-encoding")
    switch framing {
    case .chunked:
        invariant(
            codings.count == 1 && sent.value(at: codings[0]) == "chunked" && lengths.isEmpty,
            "chunked framing with \(codings.count) Transfer-Encoding and \(lengths.count) Content-Length fields")
    case .contentLength(let length):
        invariant(codings.isEmpty, "Content-Length framing with a Transfer-Encoding")
        invariant(
            lengths.count == 1 && sent.value(at: lengths[0]) == String(length),
            "Content-Length framing of \(length) with Content-Length \(lengths.map { sent.value(at: $0) })")
    case .none:
        invariant(codings.isEmpty, "no body, but a Transfer-Encoding")
    }
    switch MessageSemantics.response(sent, requestMethod: method, upgradeRequested: false) {
    case .success(let semantics):
        let expected: BodyFraming
        switch framing {
        case .none: expected = .none
        case .chunked: expected = .chunked
        case .contentLength(let length): expected = length == 0 ? .none : .contentLength(length)
        }
        invariant(semantics.framing == expected, "the client reads \(semantics.framing), the proxy sends \(framing)")
        invariant(semantics.serverCloses == close, "the client thinks the connection closes: \(semantics.serverCloses)")
    case .failure(let error):
        invariant(false, "the head for the client is invalid: \(error)")
    }

    // Every end-to-end field of the origin's head, in order and byte for byte, then the proxy's own.
    let upstream = delivered.head
    var options = Set<[UInt8]>()
    for element in upstream.listElements(named: "connection") { options.insert(bytes(element)) }
    let framingFields: Set<[UInt8]> = [bytes("content-length"), bytes("transfer-encoding"), bytes("connection")]
    let proxyFields: Set<[UInt8]> = [bytes("proxy-status")]
    let expectedFields = upstream.fields.indices.filter { index in
        let name = asciiLowercased(upstream.bytes[upstream.fields[index].name])
        return !hopByHopResponse.contains(name) && !options.contains(name) && !framingFields.contains(name)
            && !proxyFields.contains(name)
    }
    let sentFields = sent.fields.indices.filter { index in
        let name = asciiLowercased(sent.bytes[sent.fields[index].name])
        return !framingFields.contains(name) && !proxyFields.contains(name)
    }
    invariant(
        sentFields.map { sent.name(at: $0) } == expectedFields.map { upstream.name(at: $0) }
            && sentFields.map { Array(sent.valueBytes(at: $0)) }
                == expectedFields.map {
                    Array(upstream.valueBytes(at: $0))
                },
        "fields for the client \(sentFields.map { sent.name(at: $0) }), expected \(expectedFields.map { upstream.name(at: $0) })"
    )
    let connections = sent.indices(named: "connection")
    invariant(
        connections.count == (close ? 1 : 0) && connections.allSatisfy { sent.value(at: $0) == "close" },
        "Connection fields \(connections.map { sent.value(at: $0) }) with close \(close)")
}
