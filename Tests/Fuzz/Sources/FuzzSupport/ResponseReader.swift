import ProxyCore

private let readerMethods = ["GET", "HEAD"]

/// What a reader reported, with body ranges turned into the bytes they cover (consecutive bodies merged).
private enum Reported: Equatable {
    case head([UInt8])
    case body([UInt8])
    case trailers([UInt8])
    case end(reusable: Bool)
    case failed(HTTPParseError.Code)
}

/// Reads `input` as an origin's bytes, cut into pieces by `split`, then the origin's close when `close`.
private func readResponse(
    _ input: [UInt8], method: String, split: Split, close: Bool
) -> (
    reported: [Reported], taken: Int
) {
    var reader = ResponseReader(requestMethod: method)
    var reported: [Reported] = []
    var taken = 0
    var outputs: [ResponseReader.Output] = []
    for piece in split.pieces(of: input) {
        outputs.removeAll(keepingCapacity: true)
        let bytes = Array(input[piece])
        let count = bytes.withUnsafeBytes { reader.read($0, &outputs) }
        invariant(count >= 0 && count <= bytes.count, "took \(count) of \(bytes.count) bytes")
        taken += count
        for output in outputs {
            if case .body(let range) = output {
                invariant(
                    range.lowerBound >= 0 && range.upperBound <= count, "body \(range) outside the \(count) bytes taken"
                )
            }
            record(output, bytes, &reported)
        }
        if count < bytes.count {
            invariant(reader.isFinished, "bytes left untaken while the response goes on")
            break
        }
    }
    if close {
        outputs.removeAll()
        reader.closed(&outputs)
        for output in outputs { record(output, [], &reported) }
    }
    return (reported, taken)
}

private func record(_ output: ResponseReader.Output, _ bytes: [UInt8], _ reported: inout [Reported]) {
    let event: Reported
    switch output {
    case .head(let head): event = .head(head.bytes)
    case .body(let range): event = .body(Array(bytes[range]))
    case .trailers(let fields):
        // Rendered as field lines, so that reports compare whichever way they came.
        event = .trailers(fields.flatMap { $0.name + Array(": ".utf8) + $0.value + [0x0D, 0x0A] })
    case .end(let reusable): event = .end(reusable: reusable)
    case .failed(let error): event = .failed(error.code)
    case .switched:
        // The reader here reads for requests that asked for no upgrade: a 101 fails, it never switches.
        invariant(false, "switched protocols without an upgrade request")
        return
    }
    if case .body(let more) = event, case .body(let body)? = reported.last {
        reported[reported.count - 1] = .body(body + more)
    } else if case .body(let more) = event, more.isEmpty {
        return
    } else {
        reported.append(event)
    }
}

/// The reader's reports do not depend on how the bytes arrive; nothing follows an end or a failure; a body
/// never exceeds what the head's Content-Length says; the final head comes before any body.
public func fuzzResponseReader(_ data: UnsafeBufferPointer<UInt8>) {
    let input = Array(data)
    var random = InputRandom(input, salt: 0x5EAD)
    let method = readerMethods[random.next(in: 0...(readerMethods.count - 1))]
    let close = random.nextBool()
    let whole = readResponse(input, method: method, split: .whole, close: close)
    for split in [Split.mixed(salt: 1), .tiny(salt: 2)] {
        let other = readResponse(input, method: method, split: split, close: close)
        invariant(other.reported == whole.reported, "the reports depend on the split (\(split))")
        if case .end? = whole.reported.last {
            // Where the response ended (after a failure the count means nothing: the connection is closed).
            invariant(other.taken == whole.taken, "the end of the response depends on the split (\(split))")
        }
    }
    var ended = false
    var sawHead = false
    for (index, event) in whole.reported.enumerated() {
        invariant(!ended, "a report after the end or a failure")
        switch event {
        case .head: sawHead = true
        case .body, .trailers: invariant(sawHead, "a body before any head")
        case .end, .failed: ended = true
        }
        if case .end = event { invariant(index == whole.reported.count - 1, "a report after the end") }
    }
    if method == "HEAD" {
        invariant(!whole.reported.contains { if case .body = $0 { true } else { false } }, "a body to HEAD")
    }
    driveOriginExchange(input, method: method, reader: whole.reported, random: &random)
}

/// The own client's exchange on the same bytes with connection events between the pieces: at most one finish
/// and nothing but the connection's release after it; a write only on a connection; at most one resend, and
/// only of a request RetryPolicy allows; and, when nothing but bytes came, exactly the reader's reports.
private func driveOriginExchange(
    _ input: [UInt8], method: String, reader: [Reported], random: inout InputRandom
) {
    let bodies: [OriginExchange.Body] = [.none, .length(random.next(in: 0...9)), .chunked]
    let body = bodies[random.next(in: 0...2)]
    let request = OriginExchange.Request(
        method: method,
        url: AbsoluteURL(
            scheme: "https", authority: HostPort(host: "api.test", port: 443, kind: .name), pathAndQuery: "/"),
        fields: [], body: body, credential: [])
    let head = UpstreamRequest.http1Head(
        method: method, url: request.url, fields: [], body: body, credential: [])
    var exchange = OriginExchange(request: request, connectTimeout: 100, idleTimeout: 1000)
    var actions: [OriginExchange.Action] = []
    exchange.start(&actions)
    var reported: [Reported] = []
    var connected = false
    var asked = 1
    var finished = false
    var onlyBytes = true
    var writes = 0
    var readAsked: Int?
    var bodyWritten = 0
    // The request body as it went on the wire after the head (data bytes as "x"), for a chunked one.
    var wire: [UInt8] = []
    func apply(_ step: [OriginExchange.Action], _ bytes: [UInt8]) {
        for action in step {
            invariant(!finished || { if case .release = action { true } else { false } }(), "\(action) after the end")
            switch action {
            case .connect: asked += 1
            case .write(let bytes):
                invariant(connected, "a write without a connection")
                if bytes == head {
                    writes += 1
                    wire = []
                    bodyWritten = 0
                } else {
                    invariant(body == .chunked, "framing bytes for a body that is not chunked")
                    wire += bytes
                }
            case .readBody(let most):
                invariant(readAsked == nil && most > 0, "a second .readBody, or one for nothing")
                readAsked = most
            case .writeBody(let count):
                invariant(connected && count > 0, "body bytes without a connection")
                bodyWritten += count
                wire += [UInt8](repeating: UInt8(ascii: "x"), count: count)
                if case .length(let length) = body { invariant(bodyWritten <= length, "more body than its length") }
            case .deliverHead(let received): record(.head(received), bytes, &reported)
            case .deliverBody(let range): record(.body(range), bytes, &reported)
            case .deliverTrailers(let fields): record(.trailers(fields), bytes, &reported)
            case .release: connected = false
            case .finish: finished = true
            case .arm, .log: break
            case .submit, .rewindBody, .startTLS: invariant(false, "\(action) on an HTTP/1.1 connection")
            case .switchProtocols: invariant(false, "switched protocols without an upgrade request")
            }
        }
    }
    func event(_ event: OriginExchange.Event) {
        var step: [OriginExchange.Action] = []
        exchange.handle(event, &step)
        apply(step, [])
    }
    /// The owner answers an outstanding `.readBody`: some bytes, none yet (then more later), or the end.
    func answerBody() {
        guard let most = readAsked, !exchange.isFinished else { return }
        readAsked = nil
        switch random.next(in: 0...3) {
        case 0:
            event(.bodyPaused)
            event(.bodyResumed)
        case 1 where body == .chunked:
            event(.bodyEnded(trailers: random.nextBool() ? [H2Field("x-check", "1")] : []))
        default:
            event(.bodyRead(random.next(in: 1...max(1, min(most, 4)))))
        }
    }
    connected = true
    event(.connected(reused: random.nextBool()))
    for piece in Split.mixed(salt: 3).pieces(of: input) where !exchange.isFinished {
        if random.next(in: 0...15) == 0 {
            onlyBytes = false
            let events: [OriginExchange.Event] = [
                .closed, .broken(detail: "reset"), .timerFired(idle: 2000), .timerFired(idle: 1), .cancel,
            ]
            event(events[random.next(in: 0...(events.count - 1))])
            if !connected, !exchange.isFinished, asked > 1 {
                connected = true
                event(.connected(reused: false))
            }
            continue
        }
        answerBody()
        var step: [OriginExchange.Action] = []
        let bytes = Array(input[piece])
        let taken = bytes.withUnsafeBytes { exchange.received($0, &step) }
        invariant(taken >= 0 && taken <= bytes.count, "took \(taken) of \(bytes.count)")
        apply(step, bytes)
    }
    invariant(asked <= (RetryPolicy.mayResend(method: method, framing: .none) ? 2 : 1), "more than one resend")
    invariant(writes <= 2, "the head written more than twice")
    if body == .chunked {
        // What went out is chunked framing another reader accepts, up to where it stopped.
        var scanner = ChunkedScanner()
        var position = 0
        while position < wire.count {
            if scanner.pendingData > 0 {
                let take = Int(min(scanner.pendingData, UInt64(wire.count - position)))
                scanner.skipData(take)
                position += take
                continue
            }
            let (consumed, outcome) = wire[position...].withUnsafeBytes { scanner.scanFraming($0) }
            if case .failed(let error) = outcome { invariant(false, "the chunked body does not parse: \(error)") }
            position += consumed
            if case .done = outcome { break }
            if consumed == 0 { break }
        }
    }
    if onlyBytes {
        // The reader's reports up to its end (a close the exchange did not see is left out).
        let expected = reader.filter { if case .failed = $0 { false } else { true } }
        let got = reported
        let prefix = expected.prefix { if case .end = $0 { false } else { true } }
        invariant(
            got.starts(with: prefix) || got == expected, "the exchange handed over other than the reader reported")
    }
}
