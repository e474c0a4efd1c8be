import ProxyCore

private let requestMethods = ["GET", "HEAD", "POST", "CONNECT", "PUT"]

public func fuzzHTTPResponseHead(_ data: UnsafeBufferPointer<UInt8>) {
    let input = Array(data)
    let defaults = HTTPHeadLimits()
    let run = parseAllWays(input, kind: .response, limits: defaults, splits: [.mixed(salt: 1), .tiny(salt: 2)])
    let tight = tightLimits(input)
    let tightRun = parseAllWays(input, kind: .response, limits: tight, splits: [.mixed(salt: 3)])
    for found in tightRun.heads {
        checkHeadStructure(found, kind: .response, limits: tight, input: input)
    }
    // The request this answers, derived from the input.
    var random = InputRandom(input, salt: 0x22)
    let method = requestMethods[random.next(in: 0...(requestMethods.count - 1))]
    let upgradeRequested = random.nextBool()
    for found in run.heads {
        checkHeadStructure(found, kind: .response, limits: defaults, input: input)
        checkResponse(found.head, method: method, upgradeRequested: upgradeRequested)
    }
}

private func checkResponse(_ head: HTTPHead, method: String, upgradeRequested: Bool) {
    guard
        case .success(let semantics) = MessageSemantics.response(
            head, requestMethod: method, upgradeRequested: upgradeRequested)
    else { return }
    invariant(semantics.dropped.allSatisfy(head.fields.indices.contains), "dropped index out of range")
    invariant(semantics.switchesProtocols == (head.status == 101), "switchesProtocols for \(head.status)")
    invariant(!semantics.switchesProtocols || upgradeRequested, "switches protocols without an upgrade request")
    invariant(
        semantics.isInterim == ((100...199).contains(head.status) && head.status != 101),
        "isInterim for \(head.status)")
    if head.status < 200 || head.status == 204 || head.status == 304 || method == "HEAD" {
        invariant(semantics.framing == .none, "a \(head.status) response to \(method) with a body")
    }
    let codings = rawListElements(head, "transfer-encoding")
    switch semantics.framing {
    case .chunked:
        invariant(
            codings.last == bytes("chunked"),
            "chunked framing, but the last coding on the wire is \(codings.last.map(text) ?? "none")")
    case .contentLength(let length):
        invariant(length > 0, "Content-Length framing of zero bytes")
        invariant(head.indices(named: "transfer-encoding").isEmpty, "Content-Length framing with a Transfer-Encoding")
    case .untilClose:
        invariant(semantics.serverCloses, "framed until close, but the connection is kept")
    case .none:
        break
    }
    if !head.indices(named: "transfer-encoding").isEmpty {
        for index in head.indices(named: "content-length") {
            invariant(semantics.dropped.contains(index), "Content-Length forwarded next to Transfer-Encoding")
        }
    }
    let options = rawListElements(head, "connection")
    if options.contains(bytes("close")) {
        invariant(semantics.serverCloses, "Connection: close, but the connection is kept")
    }

    // What the proxy forwards is a response with the same framing.
    let forwarded = head.serialized(drop: { semantics.dropped.contains($0) })
    var parser = HTTPHeadParser(kind: .response, limits: generousLimits)
    guard case .complete(let sent, let consumed) = parser.parse(forwarded) else {
        return invariant(false, "the forwarded response head does not parse")
    }
    invariant(consumed == forwarded.count, "the forwarded response head has trailing bytes")
    invariant(sent.status == head.status && sent.version == head.version, "forwarded status line changed")
    invariant(
        sent.fields.count == head.fields.count - semantics.dropped.count,
        "forwarded \(sent.fields.count) fields of \(head.fields.count) with \(semantics.dropped.count) dropped")
    switch MessageSemantics.response(sent, requestMethod: method, upgradeRequested: upgradeRequested) {
    case .success(let again):
        invariant(
            again.framing == semantics.framing,
            "the forwarded response has framing \(again.framing), not \(semantics.framing)")
        invariant(
            again.isInterim == semantics.isInterim && again.switchesProtocols == semantics.switchesProtocols,
            "forwarded response changed kind")
    case .failure(let error):
        invariant(false, "the forwarded response head is invalid: \(error)")
    }
}
