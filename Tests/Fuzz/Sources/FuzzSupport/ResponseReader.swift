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
    case .head(let head): event = .head(head)
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
}
