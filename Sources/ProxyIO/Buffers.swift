import CLibevent
import ProxyCore

/// Small helpers over libevent buffers, so the connection code reads as the protocol, not as C.
enum Buffers {
    /// Bytes waiting in `buffer`.
    @inline(__always)
    static func length(_ buffer: OpaquePointer?) -> Int {
        evbuffer_get_length(buffer)
    }

    /// Moves `count` bytes from `source` to `destination`: whole chains move without copying, only a
    /// partial last chain is copied.
    @inline(__always)
    static func move(_ count: Int, from source: OpaquePointer?, to destination: OpaquePointer?) {
        if count >= evbuffer_get_length(source) {
            evbuffer_add_buffer(destination, source)
        } else {
            evbuffer_remove_buffer(source, destination, count)
        }
    }

    @inline(__always)
    static func append(_ bytes: [UInt8], to buffer: OpaquePointer?) {
        bytes.withUnsafeBytes { raw in _ = evbuffer_add(buffer, raw.baseAddress, raw.count) }
    }

    /// Calls `body` with each contiguous segment of `buffer`, in order, until it returns false.
    static func forEachSegment(_ buffer: OpaquePointer?, _ body: (UnsafeRawBufferPointer) -> Bool) {
        withUnsafeTemporaryAllocation(of: iovec.self, capacity: 16) { vectors in
            var position = evbuffer_ptr()
            var first = true
            while true {
                let count =
                    first
                    ? evbuffer_peek(buffer, -1, nil, vectors.baseAddress, 16)
                    : evbuffer_peek(buffer, -1, &position, vectors.baseAddress, 16)
                if count <= 0 { return }
                let filled = min(Int(count), 16)
                var seen = 0
                for index in 0..<filled {
                    let vector = vectors[index]
                    seen += vector.iov_len
                    if !body(UnsafeRawBufferPointer(start: vector.iov_base, count: vector.iov_len)) { return }
                }
                if Int(count) <= 16 { return }
                // More segments than fit: continue after the ones seen.
                let offset = first ? seen : Int(position.pos) + seen
                first = false
                if evbuffer_ptr_set(buffer, &position, offset, EVBUFFER_PTR_SET) != 0 { return }
            }
        }
    }
}

extension Buffers {
    /// Feeds `input` to `parser` and removes the bytes it took: the head's bytes, never the body's.
    static func readHead(_ parser: inout HTTPHeadParser, from input: OpaquePointer?) -> HTTPHeadParser.Outcome {
        var outcome = HTTPHeadParser.Outcome.needMore
        var taken = 0
        forEachSegment(input) { segment in
            outcome = parser.parse(segment)
            switch outcome {
            case .needMore:
                taken += segment.count
                return true
            case .complete(_, let consumed):
                taken += consumed
                return false
            case .failed:
                return false
            }
        }
        evbuffer_drain(input, taken)
        return outcome
    }
}

/// A message body being passed on unchanged, following its framing (RFC 9112 §6.3): by count for
/// Content-Length, by `ChunkedScanner` for chunked bodies (chunk data moves without being looked at), or
/// everything until the sender closes.
struct FramedBody {
    private(set) var framing: BodyFraming
    private var remaining: UInt64 = 0
    private var chunks: ChunkedScanner?
    /// A read-until-close body ended (the sender closed).
    private var closed = false

    init(_ framing: BodyFraming) {
        self.framing = framing
        switch framing {
        case .none, .untilClose: break
        case .contentLength(let length): remaining = length
        case .chunked: chunks = ChunkedScanner()
        }
    }

    /// The whole body has been passed on.
    var isComplete: Bool {
        switch framing {
        case .none: true
        case .contentLength: remaining == 0
        case .chunked: chunks?.isFinished ?? true
        case .untilClose: closed
        }
    }

    /// The sender closed: the end of a read-until-close body.
    mutating func senderClosed() { closed = true }

    /// Moves the body's bytes that are in `input` to `output`. Returns the count moved, or the framing error.
    mutating func pass(from input: OpaquePointer?, to output: OpaquePointer?) -> Result<Int, HTTPParseError> {
        var moved = 0
        while !isComplete {
            let available = Buffers.length(input)
            if available == 0 { break }
            switch framing {
            case .none:
                return .success(moved)
            case .untilClose:
                evbuffer_add_buffer(output, input)
                moved += available
            case .contentLength:
                let count = Int(min(remaining, UInt64(available)))
                Buffers.move(count, from: input, to: output)
                moved += count
                remaining -= UInt64(count)
            case .chunked:
                var scanner = chunks!
                var count = 0
                if scanner.pendingData > 0 {
                    count = Int(min(scanner.pendingData, UInt64(available)))
                    scanner.skipData(count)
                } else {
                    var failure: HTTPParseError? = nil
                    Buffers.forEachSegment(input) { segment in
                        switch scanner.scan(segment) {
                        case .needMore:
                            count += segment.count
                            return scanner.pendingData == 0
                        case .done(let consumed):
                            count += consumed
                            return false
                        case .failed(let error):
                            failure = error
                            return false
                        }
                    }
                    if let failure {
                        chunks = scanner
                        return .failure(failure)
                    }
                }
                chunks = scanner
                Buffers.move(count, from: input, to: output)
                moved += count
            }
        }
        return .success(moved)
    }
}
