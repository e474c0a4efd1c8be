import ProxyCore

/// How a scan of a whole input ended.
private enum ChunkedResult: Equatable {
    /// The body ended `end` bytes into the input.
    case done(end: Int, dataBytes: UInt64)
    case failed(HTTPParseError.Code)
    /// The input ended inside the body.
    case needMore(dataBytes: UInt64, pendingData: UInt64)
}

public func fuzzChunked(_ data: UnsafeBufferPointer<UInt8>) {
    let input = Array(data)
    let whole = scanChunked(input, split: .whole, skipByHand: false)
    for (split, skip) in [(Split.mixed(salt: 1), false), (.tiny(salt: 2), false), (.mixed(salt: 3), true)] {
        let other = scanChunked(input, split: split, skipByHand: skip)
        invariant(
            other == whole,
            "chunked scan depends on how the input is split (\(split), skipData by hand: \(skip)):\n  whole: \(whole)\n  split: \(other)"
        )
    }
    // A reader that decodes the body: scanFraming up to the data, then the data taken by hand.
    for split in [Split.whole, .mixed(salt: 4), .tiny(salt: 5)] {
        let decoded = scanDecoding(input, split: split)
        invariant(
            decoded == whole,
            "scanFraming and skipData disagree with scan (\(split)):\n  scan:        \(whole)\n  scanFraming: \(decoded)"
        )
    }
    // What a forwarder passes on (BodyProgress): the same bytes however the input arrives, the body's own
    // bytes less the dropped trailer lines, and no framing or routing field left in the trailer section.
    let forwardedWhole = forward(input, split: .whole)
    for split in [Split.mixed(salt: 6), .tiny(salt: 7)] {
        let other = forward(input, split: split)
        invariant(
            other == forwardedWhole, "BodyProgress depends on the split: \(other.count) vs \(forwardedWhole.count)")
    }
    if case .done(let end, _) = whole, let passed = forwardedWhole.passed {
        invariant(passed.count <= end, "more bytes passed than the body has")
        var reparsed = ChunkedScanner()
        invariant(reparsed.scan(passed) == .done(consumed: passed.count), "the forwarded body does not scan whole")
        invariant(reparsed.droppedTrailers.isEmpty, "a forbidden trailer was forwarded")
    }
    if case .done(let end, let dataBytes) = whole {
        invariant(dataBytes <= UInt64(end), "more data bytes than bytes consumed")
        // The body is exactly the bytes up to `end`: scanning just those ends at the same place.
        invariant(
            scanChunked(Array(input[..<end]), split: .whole, skipByHand: false) == whole,
            "the body alone scans differently")
    }
}

/// Scans `input` in the pieces `split` gives. With `skipByHand`, part of each run of chunk data is passed
/// over with `skipData` first, the way a forwarder that moves data without looking at it would.
private func scanChunked(_ input: [UInt8], split: Split, skipByHand: Bool) -> ChunkedResult {
    var scanner = ChunkedScanner()
    for piece in split.pieces(of: input) {
        var offset = piece.lowerBound
        if skipByHand && scanner.pendingData > 0 {
            let available = piece.upperBound - offset
            let skip = Int(min(scanner.pendingData, UInt64(available))) / 2
            let before = scanner.pendingData
            scanner.skipData(skip)
            invariant(
                before - scanner.pendingData == UInt64(skip) || scanner.pendingData == 0,
                "skipData(\(skip)) took another amount")
            offset += skip
        }
        let given = piece.upperBound - offset
        switch input.withRawBytes(offset..<piece.upperBound, { scanner.scan($0) }) {
        case .needMore:
            invariant(!scanner.isFinished, "needMore from a finished scanner")
        case .done(let consumed):
            invariant(consumed >= 1 && consumed <= given, "consumed \(consumed) of the \(given) bytes given")
            invariant(scanner.isFinished && scanner.pendingData == 0, "done, but the scanner is not finished")
            return .done(end: offset + consumed, dataBytes: scanner.dataBytes)
        case .failed(let error):
            invariant(error.code == .badChunk, "chunked body failed with \(error.code)")
            // A failed scanner stays failed.
            guard case .failed = scanner.scan(Array("0\r\n\r\n".utf8)) else {
                invariant(false, "the scanner recovered from an error")
                return .failed(error.code)
            }
            return .failed(error.code)
        }
    }
    invariant(!scanner.isFinished, "finished without saying done")
    return .needMore(dataBytes: scanner.dataBytes, pendingData: scanner.pendingData)
}

/// Reads `input` the way a decoding reader does: `scanFraming` while there is no chunk data pending, which
/// must stop exactly where data starts or the body ends, then `skipData` for the data bytes.
private func scanDecoding(_ input: [UInt8], split: Split) -> ChunkedResult {
    var scanner = ChunkedScanner()
    for piece in split.pieces(of: input) {
        var offset = piece.lowerBound
        while offset < piece.upperBound {
            if scanner.pendingData > 0 {
                let take = Int(min(scanner.pendingData, UInt64(piece.upperBound - offset)))
                scanner.skipData(take)
                offset += take
                continue
            }
            let given = piece.upperBound - offset
            let (taken, outcome) = input.withRawBytes(offset..<piece.upperBound) { scanner.scanFraming($0) }
            invariant(taken >= 1 && taken <= given, "scanFraming took \(taken) of \(given) bytes")
            switch outcome {
            case .needMore:
                invariant(taken == given || scanner.pendingData > 0, "scanFraming stopped before data or the end")
                invariant(!scanner.isFinished, "needMore from a finished scanner")
                offset += taken
            case .done(let consumed):
                invariant(consumed == taken && scanner.isFinished, "scanFraming done after \(consumed) of \(taken)")
                return .done(end: offset + taken, dataBytes: scanner.dataBytes)
            case .failed(let error):
                invariant(error.code == .badChunk, "chunked body failed with \(error.code)")
                return .failed(error.code)
            }
        }
    }
    invariant(!scanner.isFinished, "finished without saying done")
    return .needMore(dataBytes: scanner.dataBytes, pendingData: scanner.pendingData)
}

/// The bytes a forwarder passes on for `input` arriving in the pieces `split` gives, and the bytes it dropped;
/// `passed` is nil on a framing error.
private struct Forwarded: Equatable {
    var passed: [UInt8]?
    var dropped = 0
    var count: Int { passed?.count ?? -1 }
}

private func forward(_ input: [UInt8], split: Split) -> Forwarded {
    var progress = BodyProgress(.chunked)
    var buffer: [UInt8] = []
    var result = Forwarded(passed: [])
    var spans: [BodySpan] = []
    for piece in split.pieces(of: input) {
        buffer += input[piece]
        spans.removeAll()
        if progress.take(from: buffer, at: 0, into: &spans) != nil { return Forwarded(passed: nil) }
        var offset = 0
        for span in spans {
            switch span {
            case .pass(let count):
                invariant(count > 0 && offset + count <= buffer.count, "pass \(count) beyond the buffer")
                result.passed! += buffer[offset..<offset + count]
                offset += count
            case .drop(let count):
                invariant(count > 0 && offset + count <= buffer.count, "drop \(count) beyond the buffer")
                result.dropped += count
                offset += count
            }
        }
        buffer.removeFirst(offset)
        if progress.isComplete { break }
    }
    return result
}
