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
    case .trailers(let lines): event = .trailers(lines)
    case .end(let reusable): event = .end(reusable: reusable)
    case .failed(let error): event = .failed(error.code)
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
    let head = Array("\(method) / HTTP/1.1\r\nHost: api.test\r\n\r\n".utf8)
    var exchange = OriginExchange(
        method: method, url: "https://api.test/", head: head, connectTimeout: 100, idleTimeout: 1000)
    var actions: [OriginExchange.Action] = []
    exchange.start(&actions)
    var reported: [Reported] = []
    var connected = false
    var asked = 1
    var finished = false
    var onlyBytes = true
    var writes = 0
    func apply(_ step: [OriginExchange.Action], _ bytes: [UInt8]) {
        for action in step {
            invariant(!finished || { if case .release = action { true } else { false } }(), "\(action) after the end")
            switch action {
            case .connect: asked += 1
            case .write(let bytes):
                invariant(connected && bytes == head, "a write without a connection, or not the head")
                writes += 1
            case .deliverHead(let received): record(.head(received), bytes, &reported)
            case .deliverBody(let range): record(.body(range), bytes, &reported)
            case .deliverTrailers(let lines): record(.trailers(Array(lines.dropLast(2))), lines, &reported)
            case .release: connected = false
            case .finish: finished = true
            case .arm, .log: break
            }
        }
    }
    func event(_ event: OriginExchange.Event) {
        var step: [OriginExchange.Action] = []
        exchange.handle(event, &step)
        apply(step, [])
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
        var step: [OriginExchange.Action] = []
        let bytes = Array(input[piece])
        let taken = bytes.withUnsafeBytes { exchange.received($0, &step) }
        invariant(taken >= 0 && taken <= bytes.count, "took \(taken) of \(bytes.count)")
        apply(step, bytes)
    }
    invariant(asked <= (RetryPolicy.mayResend(method: method, framing: .none) ? 2 : 1), "more than one resend")
    invariant(writes <= 2, "the head written more than twice")
    if onlyBytes {
        // The reader's reports up to its end (a close the exchange did not see is left out).
        let expected = reader.filter { if case .failed = $0 { false } else { true } }
        let got = reported
        let prefix = expected.prefix { if case .end = $0 { false } else { true } }
        invariant(
            got.starts(with: prefix) || got == expected, "the exchange handed over other than the reader reported")
    }
}
