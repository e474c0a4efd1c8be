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
private let fallbackStatuses = [200, 201, 204, 206, 301, 304, 401, 403, 404, 500, 100, 101, 103]

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
        var asked: [Bool] = []
        let result = MessageSemantics.interceptedRequest(head, scheme: scheme, origin: origin) { hasOwn in
            asked.append(hasOwn)
            return replace || !hasOwn
        }
        switch result {
        case .success(let request):
            invariant(asked.count == 1, "attachToken asked \(asked.count) times")
            invariant(asked.first == request.clientAuthorization, "attachToken told another clientAuthorization")
            checkInterceptedRequest(
                request, head: head, scheme: scheme, origin: origin, attached: replace || !request.clientAuthorization)
        case .failure(let refusal):
            checkRefusal(refusal, head: head, scheme: scheme, origin: origin)
        }
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
private func checkRefusal(_ refusal: InterceptRefusal, head: HTTPHead, scheme: String, origin: HostPort) {
    let response = refusal.response
    invariant(response.close, "a refused intercepted request keeps the connection")
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
    }
}

// MARK: - Responses

/// A response head the way the header callback in ProxyIO collects it from libcurl: the status line, then
/// every line with a colon as name and OWS-trimmed value, up to the empty line.
private struct UpstreamHead {
    var status = 0
    var reason: [UInt8]? = nil
    var fields: [(name: String, value: [UInt8])] = []
    /// Whether an HTTP/1.1 server could have sent it: a three-digit status, a reason phrase and field lines
    /// that `HTTPHeadParser` accepts. Only then must the head the proxy builds be valid.
    var valid = true
}

private func upstreamHead(_ input: [UInt8], random: inout InputRandom) -> UpstreamHead {
    var head = UpstreamHead()
    var sawStatus = false
    // On the raw bytes, as libcurl hands them over: field values and the reason may carry any obs-text byte.
    for rawLine in input.split(separator: 0x0A, omittingEmptySubsequences: false) {
        var line = rawLine[...]
        while let last = line.last, last == 0x0A || last == 0x0D { line = line.dropLast() }
        if line.starts(with: "HTTP/".utf8) {
            let parts = line.split(separator: 0x20, maxSplits: 2, omittingEmptySubsequences: false)
            let digits = parts.count > 1 ? Array(parts[1]) : []
            head.status = Int(String(decoding: digits, as: UTF8.self)) ?? 0
            head.reason = parts.count > 2 && line.starts(with: "HTTP/1".utf8) ? Array(parts[2]) : nil
            head.fields = []
            head.valid = digits.count == 3 && digits.allSatisfy { $0 >= 0x30 && $0 <= 0x39 } && head.status >= 100
            if let reason = head.reason, !reason.allSatisfy(isFieldValueByte) { head.valid = false }
            sawStatus = true
            continue
        }
        if line.isEmpty { break }
        guard let colon = line.firstIndex(of: UInt8(ascii: ":")) else {
            head.valid = false
            continue
        }
        let name = line[..<colon]
        var value = line[(colon + 1)...]
        while let first = value.first, first == 0x20 || first == 0x09 { value = value.dropFirst() }
        while let last = value.last, last == 0x20 || last == 0x09 { value = value.dropLast() }
        head.fields.append((String(decoding: name, as: UTF8.self), Array(value)))
        if name.isEmpty || !name.allSatisfy(isTokenByte) || !value.allSatisfy(isFieldValueByte) {
            head.valid = false
        }
    }
    if !sawStatus {
        head.status = fallbackStatuses[random.next(in: 0...(fallbackStatuses.count - 1))]
    }
    return head
}

private func fuzzInterceptedResponse(_ input: [UInt8]) {
    var random = InputRandom(input, salt: 0x32)
    let upstream = upstreamHead(input, random: &random)
    let method = responseMethods[random.next(in: 0...(responseMethods.count - 1))]
    let close = random.nextBool()
    let extra: [(name: String, value: String)] =
        random.nextBool()
        ? [
            (
                "Proxy-Status",
                ProxyStatus(details: "step-up required: run proxyctl step-up", receivedStatus: 401).fieldValue
            )
        ]
        : []
    let (out, framing) = MessageSemantics.interceptedResponseHead(
        status: upstream.status, reason: upstream.reason, fields: upstream.fields, requestMethod: method,
        close: close, extra: extra)
    guard upstream.valid else { return }

    let noBody = upstream.status < 200 || upstream.status == 204 || upstream.status == 304 || method == "HEAD"
    invariant(noBody == (framing == .none), "framing \(framing) for a \(upstream.status) to \(method)")

    var parser = HTTPHeadParser(kind: .response, limits: generousLimits)
    guard case .complete(let head, let consumed) = parser.parse(out) else {
        return invariant(
            false, "the head for the client does not parse: \(text(Array(out.prefix(300))).debugDescription)")
    }
    invariant(consumed == out.count, "the head for the client has trailing bytes")
    invariant(head.status == upstream.status && head.version == .http1_1, "status line \(head.status) \(head.version)")

    // Framing: exactly one, the one announced.
    let lengths = head.indices(named: "content-length")
    let codings = head.indices(named: "transfer-encoding")
    switch framing {
    case .chunked:
        invariant(
            codings.count == 1 && head.value(at: codings[0]) == "chunked" && lengths.isEmpty,
            "chunked framing with \(codings.count) Transfer-Encoding and \(lengths.count) Content-Length fields")
    case .contentLength(let length):
        invariant(codings.isEmpty, "Content-Length framing with a Transfer-Encoding")
        invariant(
            lengths.count == 1 && head.value(at: lengths[0]) == String(length),
            "Content-Length framing of \(length) with Content-Length \(lengths.map { head.value(at: $0) })")
    case .none:
        invariant(codings.isEmpty, "no body, but a Transfer-Encoding")
    }
    switch MessageSemantics.response(head, requestMethod: method, upgradeRequested: upstream.status == 101) {
    case .success(let semantics):
        let expected: BodyFraming
        switch framing {
        case .none: expected = .none
        case .chunked: expected = .chunked
        case .contentLength(let length): expected = length == 0 ? .none : .contentLength(length)
        }
        invariant(semantics.framing == expected, "the client reads \(semantics.framing), the proxy sends \(framing)")
        invariant(
            semantics.serverCloses == close || semantics.framing == .untilClose || upstream.status == 101,
            "the client thinks the connection closes: \(semantics.serverCloses), the proxy: \(close)")
    case .failure(let error):
        invariant(false, "the head for the client is invalid: \(error)")
    }

    // Every end-to-end field of the upstream, in order, then the proxy's own.
    var options = Set<[UInt8]>()
    for (name, value) in upstream.fields where asciiLowercased(bytes(name)) == bytes("connection") {
        for element in value.split(separator: UInt8(ascii: ","), omittingEmptySubsequences: true) {
            var trimmed = element[...]
            while let first = trimmed.first, first == 0x20 || first == 0x09 { trimmed.removeFirst() }
            while let last = trimmed.last, last == 0x20 || last == 0x09 { trimmed.removeLast() }
            options.insert(asciiLowercased(trimmed))
        }
    }
    let framingFields: Set<[UInt8]> = [bytes("content-length"), bytes("transfer-encoding"), bytes("connection")]
    let extraNames = Set(extra.map { asciiLowercased(bytes($0.name)) })
    let expectedFields = upstream.fields.filter { field in
        let name = asciiLowercased(bytes(field.name))
        return !hopByHopResponse.contains(name) && !options.contains(name) && !framingFields.contains(name)
            && !extraNames.contains(name)
    }
    let sent = head.fields.indices.filter { index in
        let name = asciiLowercased(head.bytes[head.fields[index].name])
        return !framingFields.contains(name) && !extraNames.contains(name)
    }
    invariant(
        sent.map { head.name(at: $0) } == expectedFields.map(\.name)
            && sent.map { Array(head.valueBytes(at: $0)) } == expectedFields.map(\.value),
        "fields for the client \(sent.map { head.name(at: $0) }), expected \(expectedFields.map(\.name))")
    for (name, value) in extra {
        invariant(
            head.fields.indices.contains { head.name(at: $0) == name && head.value(at: $0) == value }, "\(name) lost")
    }
    let connections = head.indices(named: "connection")
    invariant(
        connections.count == (close ? 1 : 0) && connections.allSatisfy { head.value(at: $0) == "close" },
        "Connection fields \(connections.map { head.value(at: $0) }) with close \(close)")
}

private func isTokenByte(_ byte: UInt8) -> Bool {
    switch byte {
    case UInt8(ascii: "a")...UInt8(ascii: "z"), UInt8(ascii: "A")...UInt8(ascii: "Z"),
        UInt8(ascii: "0")...UInt8(ascii: "9"):
        return true
    default:
        return "!#$%&'*+-.^_`|~".utf8.contains(byte)
    }
}

private func isFieldValueByte(_ byte: UInt8) -> Bool { byte == 0x09 || (byte >= 0x20 && byte != 0x7F) }
