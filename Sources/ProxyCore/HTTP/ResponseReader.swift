/// Reads one HTTP/1.1 response from a connection to an origin (RFC 9112 §6.3): its head (interim 1xx heads
/// too), then its body by the framing the head gives, de-chunked, then whether the connection can carry the
/// next request. Bytes in, outputs out; no I/O.
///
/// The first half of the proxy's own HTTP/1.1 upstream client (issue 14: libcurl formats every request field
/// byte by byte, docs/performance.md): the head is checked by the one `HTTPHeadParser` and
/// `MessageSemantics.response`, chunked framing by `ChunkedScanner`, so the client decides nothing of its own.
public struct ResponseReader: Sendable {
    public enum Output: Sendable, Equatable {
        /// A complete response head, parsed: an interim (1xx) one, or the final.
        case head(ReceivedHead)
        /// Body bytes at this range of the input just read (chunk framing left out).
        case body(Range<Int>)
        /// The trailer fields of a chunked body (`HTTPHeadParser.trailerFields`: lines that are not field lines
        /// dropped, within the head's limits), before its end.
        case trailers([H2Field])
        /// The response is complete; `reusable`: the connection may carry another request.
        case end(reusable: Bool)
        /// The response cannot be read on: the connection must be closed.
        case failed(HTTPParseError)
        /// The origin switched protocols (101 to an upgrade request, after its `.head`): the connection is no
        /// longer HTTP's; what follows the head (not taken) is the new protocol's.
        case switched
    }

    private enum Phase: Sendable, Equatable {
        case head
        case length(remaining: UInt64)
        case chunked
        case untilClose
        case done
        case failed
    }

    public let requestMethod: String
    /// The request asked to switch protocols (`Upgrade`): a 101 ends the reading.
    public let upgradeRequested: Bool
    private var parser: HTTPHeadParser
    private var phase = Phase.head
    private var chunks = ChunkedScanner()
    private var trailerSection: [UInt8] = []
    private var serverCloses = false

    public init(requestMethod: String, upgradeRequested: Bool = false, limits: HTTPHeadLimits = HTTPHeadLimits()) {
        self.requestMethod = requestMethod
        self.upgradeRequested = upgradeRequested
        parser = HTTPHeadParser(kind: .response, limits: limits)
    }

    /// Whether the response ended (completely, or failed).
    public var isFinished: Bool { phase == .done || phase == .failed }

    /// Reads from `input` and returns the bytes taken. Bytes after the end of the response are not taken (a
    /// connection that sent them is out of step: the caller does not reuse it), nor any after a failure.
    public mutating func read(_ input: UnsafeRawBufferPointer, _ out: inout [Output]) -> Int {
        var offset = 0
        while offset < input.count {
            switch phase {
            case .head:
                switch parser.parse(UnsafeRawBufferPointer(rebasing: input[offset...])) {
                case .needMore:
                    return input.count
                case .failed(let error):
                    return fail(error, at: offset, &out)
                case .complete(let head, let consumed):
                    offset += consumed
                    let checked = MessageSemantics.response(
                        head, requestMethod: requestMethod, upgradeRequested: upgradeRequested)
                    out.append(.head(ReceivedHead(head: head, semantics: try? checked.get())))
                    if let error = begin(checked, &out) { return fail(error, at: offset, &out) }
                    if case .success(let semantics) = checked, semantics.switchesProtocols {
                        phase = .done
                        out.append(.switched)
                        return offset
                    }
                }
            case .length(let remaining):
                let take = Int(min(remaining, UInt64(input.count - offset)))
                out.append(.body(offset..<offset + take))
                offset += take
                if remaining == UInt64(take) {
                    finish(&out)
                } else {
                    phase = .length(remaining: remaining - UInt64(take))
                }
            case .chunked:
                let pending = chunks.pendingData
                if pending > 0 {
                    let take = Int(min(pending, UInt64(input.count - offset)))
                    chunks.skipData(take)
                    out.append(.body(offset..<offset + take))
                    offset += take
                    continue
                }
                let before = chunks.position
                let (consumed, outcome) = chunks.scanFraming(UnsafeRawBufferPointer(rebasing: input[offset...]))
                if let start = chunks.trailerStart, start < before + UInt64(consumed) {
                    // Bytes of the trailer section (its lines, then the blank line that ends the body).
                    let from = offset + Int(start > before ? start - before : 0)
                    trailerSection.append(contentsOf: UnsafeRawBufferPointer(rebasing: input[from..<offset + consumed]))
                }
                offset += consumed
                switch outcome {
                case .needMore:
                    continue
                case .failed(let error):
                    return fail(error, at: offset, &out)
                case .done:
                    // The section ends with the blank line that ends the body: the lines are what comes before it.
                    if trailerSection.count > 2 {
                        let fields = HTTPHeadParser.trailerFields(
                            Array(trailerSection.dropLast(2)), limits: parser.limits)
                        if !fields.isEmpty { out.append(.trailers(fields)) }
                    }
                    trailerSection = []
                    finish(&out)
                }
            case .untilClose:
                out.append(.body(offset..<input.count))
                return input.count
            case .done, .failed:
                return offset
            }
        }
        return offset
    }

    /// The origin closed its sending side: the end of a body read until close, else a response cut short.
    public mutating func closed(_ out: inout [Output]) {
        switch phase {
        case .untilClose:
            phase = .done
            out.append(.end(reusable: false))
        case .done, .failed:
            break
        case .head where !parser.hasPartialHead:
            _ = fail(HTTPParseError(.malformed, "the origin closed the connection without a response"), at: 0, &out)
        default:
            _ = fail(
                HTTPParseError(.malformed, "the origin closed the connection before the response was complete"), at: 0,
                &out)
        }
    }

    /// The body's framing from a complete head; nil, or why the response is unusable.
    private mutating func begin(
        _ checked: Result<ResponseSemantics, HTTPParseError>, _ out: inout [Output]
    ) -> HTTPParseError? {
        let semantics: ResponseSemantics
        switch checked {
        case .failure(let error): return error
        case .success(let checked): semantics = checked
        }
        // The final response follows: read on (the parser starts over). After a 101, the new protocol does.
        if semantics.isInterim || semantics.switchesProtocols { return nil }
        serverCloses = semantics.serverCloses
        switch semantics.framing {
        case .none: finish(&out)
        case .contentLength(let length): phase = .length(remaining: length)
        case .chunked: phase = .chunked
        case .untilClose: phase = .untilClose
        }
        return nil
    }

    private mutating func finish(_ out: inout [Output]) {
        phase = .done
        out.append(.end(reusable: !serverCloses))
    }

    private mutating func fail(_ error: HTTPParseError, at offset: Int, _ out: inout [Output]) -> Int {
        phase = .failed
        out.append(.failed(error))
        return offset
    }
}

/// A response head as `ResponseReader` read it: its bytes parsed once, and its semantics
/// (`MessageSemantics.response`) when they hold; nil when the reader fails the response for them.
public struct ReceivedHead: Sendable, Equatable {
    public let head: HTTPHead
    public let semantics: ResponseSemantics?

    public init(head: HTTPHead, semantics: ResponseSemantics?) {
        self.head = head
        self.semantics = semantics
    }

    public var bytes: [UInt8] { head.bytes }

    public static func == (lhs: Self, rhs: Self) -> Bool {
        lhs.head.bytes == rhs.head.bytes && lhs.semantics == rhs.semantics
    }
}

extension UpstreamRequest {
    /// The HTTP/1.1 request head of a request to `url`, for the proxy's own upstream client: the request line
    /// with the URL's path and query byte for byte (or `target`: `*` for `OPTIONS *`), `Host` (the URL's
    /// authority, the port left out when it is the scheme's default), the client's fields in their order, the
    /// body's framing as the client framed it (`Content-Length`, or `Transfer-Encoding: chunked`), then the
    /// credential's fields (`Authorization`, `DPoP`). Nothing is added that the client did not send. nil when
    /// `url` does not parse.
    public static func http1Head(
        method: String, url: String, target: String? = nil, fields: [(name: String, value: [UInt8])],
        body: OriginExchange.Body = .none, credential: [(name: String, value: [UInt8])]
    ) -> [UInt8]? {
        guard case .success(let parsed) = AbsoluteURL.parse(url) else { return nil }
        return http1Head(
            method: method, url: parsed, target: target, fields: fields, body: body, credential: credential)
    }

    /// Methods whose requests carry content by definition: an empty one still gets `Content-Length: 0`.
    static func definesContent(_ method: String) -> Bool {
        method == "POST" || method == "PUT" || method == "PATCH"
    }

    /// The same for a URL already parsed.
    public static func http1Head(
        method: String, url parsed: AbsoluteURL, target: String? = nil, fields: [(name: String, value: [UInt8])],
        body: OriginExchange.Body = .none, credential: [(name: String, value: [UInt8])]
    ) -> [UInt8] {
        let host = parsed.hostFieldValue
        let target = target ?? parsed.pathAndQuery
        let framing: (name: String, value: [UInt8])?
        switch body {
        case .none:
            // RFC 9110 §8.6: a POST, PUT or PATCH says its empty content's length (some origins answer 411 when it
            // does not); other methods without content send no framing field.
            framing = Self.definesContent(method) ? ("Content-Length", Array("0".utf8)) : nil
        case .length(let length): framing = ("Content-Length", Array(String(length).utf8))
        case .chunked: framing = ("Transfer-Encoding", Self.chunked)
        }
        var size = method.utf8.count + 1 + target.utf8.count + Self.requestLineEnd.count
        size += 6 + host.utf8.count + 2  // Host: host CRLF
        for field in fields { size += ByteWriter.fieldSize(field.name, field.value) }
        if let framing { size += ByteWriter.fieldSize(framing.name, framing.value) }
        for field in credential { size += ByteWriter.fieldSize(field.name, field.value) }
        size += 2
        return ByteWriter.bytes(count: size) { head in
            head.write(string: method)
            head.write(ASCII.space)
            head.write(string: target)
            head.write(Self.requestLineEnd)
            head.write("Host: ")
            head.write(string: host)
            head.write(ASCII.cr)
            head.write(ASCII.lf)
            for field in fields { head.writeField(field.name, field.value) }
            if let framing { head.writeField(framing.name, framing.value) }
            for field in credential { head.writeField(field.name, field.value) }
            head.write(ASCII.cr)
            head.write(ASCII.lf)
        }
    }

    private static let requestLineEnd = Array(" HTTP/1.1\r\n".utf8)
    private static let chunked = Array("chunked".utf8)
}
