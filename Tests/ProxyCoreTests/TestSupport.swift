import Foundation
import Testing

@testable import ProxyCore

/// A failed precondition inside a helper; the helper has already recorded the issue.
struct TestSetupError: Error, CustomStringConvertible {
    let description: String
}

extension String {
    /// The UTF-8 bytes of the string.
    var bytes: [UInt8] { Array(utf8) }
}

/// Joins lines with CRLF and ends the head with the empty line: `head("GET / HTTP/1.1", "Host: a")`.
func crlfHead(_ lines: String...) -> String {
    crlfHead(lines)
}

/// Joins lines with CRLF and ends the head with the empty line.
func crlfHead(_ lines: [String]) -> String {
    lines.map { $0 + "\r\n" }.joined() + "\r\n"
}

/// What feeding a head parser a sequence of pieces came to, in a form tests can compare.
enum HeadFeedResult: Equatable, CustomStringConvertible {
    case needMore
    /// `consumed` counts from the start of the first piece.
    case complete(bytes: [UInt8], consumed: Int)
    case failed(HTTPParseError.Code)

    var description: String {
        switch self {
        case .needMore: "needMore"
        case .complete(let bytes, let consumed):
            "complete(\(String(decoding: bytes, as: UTF8.self).debugDescription), consumed: \(consumed))"
        case .failed(let code): "failed(\(code))"
        }
    }
}

/// Feeds `pieces` to a fresh parser one after another, stopping at the first complete or failed outcome.
func feedHead(
    _ pieces: [[UInt8]], kind: HTTPHeadParser.Kind = .request, limits: HTTPHeadLimits = HTTPHeadLimits()
) -> HeadFeedResult {
    var parser = HTTPHeadParser(kind: kind, limits: limits)
    var offset = 0
    for piece in pieces {
        switch parser.parse(piece) {
        case .needMore:
            offset += piece.count
        case .complete(let head, let consumed):
            return .complete(bytes: head.bytes, consumed: offset + consumed)
        case .failed(let error):
            return .failed(error.code)
        }
    }
    return .needMore
}

/// Parses a complete head, recording an issue (and throwing) when it does not parse.
func parseHead(
    _ text: String, kind: HTTPHeadParser.Kind = .request, sourceLocation: SourceLocation = #_sourceLocation
) throws -> HTTPHead {
    try parseHead(text.bytes, kind: kind, sourceLocation: sourceLocation)
}

/// Parses a complete head given as bytes.
func parseHead(
    _ bytes: [UInt8], kind: HTTPHeadParser.Kind = .request, sourceLocation: SourceLocation = #_sourceLocation
) throws -> HTTPHead {
    var parser = HTTPHeadParser(kind: kind)
    switch parser.parse(bytes) {
    case .complete(let head, _):
        return head
    case .needMore:
        Issue.record("head is incomplete", sourceLocation: sourceLocation)
        throw TestSetupError(description: "incomplete head")
    case .failed(let error):
        Issue.record("head did not parse: \(error)", sourceLocation: sourceLocation)
        throw TestSetupError(description: "head did not parse: \(error)")
    }
}

/// Runs CPU-bound work (an exhaustive walk) on a thread of its own, outside Swift's cooperative pool and
/// behind it for the cores, and returns its result.
///
/// The pool has one thread per core and takes jobs in order. A synchronous walk on it holds a thread for
/// seconds, and every task another test starts meanwhile (a token refresh in ProxyOAuthTests) waits behind
/// it; on a 2-core machine two walks held the whole pool, refreshes outlived their 30 s `token_timeout`
/// without having run, and five tests failed with "has not answered the token refresh ... in 30s". On Linux
/// `DispatchQueue.global()` is no way out: the Swift runtime enqueues its jobs on that same default-QoS root
/// queue. A thread of its own is, but a dozen walks in parallel would then take the cores from the pool, so
/// the thread runs at nice 19 (Linux keeps the nice value per thread): the walks get what the rest of the
/// suite leaves.
///
/// A test whose work takes more than a fraction of a second of CPU without an `await` belongs here. `work`
/// records no issues (it runs outside the test's task): it returns what the test then checks.
func offThePool<T: Sendable>(_ work: @escaping @Sendable () -> T) async -> T {
    await withCheckedContinuation { continuation in
        let thread = Thread {
            #if os(Linux)
                _ = setpriority(__priority_which_t(PRIO_PROCESS.rawValue), 0, 19)
            #endif
            continuation.resume(returning: work())
        }
        thread.qualityOfService = .background
        thread.stackSize = 8 << 20
        thread.start()
    }
}
