import CLibevent
import ProxyCore
import Synchronization

#if canImport(FoundationEssentials)
    import FoundationEssentials
#else
    import Foundation
#endif
#if canImport(Glibc)
    import Glibc
#elseif canImport(Darwin)
    import Darwin
#endif

/// Lines to standard error: `2026-11-30T08:40:40.123Z info message key=value ...`.
///
/// Callers pass only what may be seen: no credentials, tokens or field values. Each `write` carries whole
/// lines, so lines from several threads do not interleave. With `holdAccessLines(on:)`, the access log's lines
/// (one per request) made on the loop thread are held for the rest of that pass of the loop and written in one
/// `write`; any other line writes those first, then itself, so the order is kept.
public final class Logger: @unchecked Sendable {
    // @unchecked Sendable: `level` and `format` are atomics, held lines are behind a mutex, and `flushTask` is
    // set before the loop runs and used on its thread only.

    private let levelStorage: Atomic<Int>
    private let jsonStorage: Atomic<Bool>
    private let fd: Int32
    /// Access-log lines of this pass of the loop, not yet written.
    private let held = Mutex<[UInt8]>([])
    private var flushTask: LoopTimer?
    private var holdingLoop: EventLoop?
    /// Held lines are written at once beyond this size.
    private static let heldLimit = 64 * 1024

    public init(level: LogLevel, format: LogFormat = .text, fd: Int32 = 2) {
        self.levelStorage = Atomic(level.rawValue)
        self.jsonStorage = Atomic(format == .json)
        self.fd = fd
    }

    /// `text` for people, `json` (one object per line: time, level, conn, client, msg) for log collectors.
    public var format: LogFormat {
        get { jsonStorage.load(ordering: .relaxed) ? .json : .text }
        set { jsonStorage.store(newValue == .json, ordering: .relaxed) }
    }

    public var level: LogLevel {
        get { LogLevel(rawValue: levelStorage.load(ordering: .relaxed)) ?? .info }
        set { levelStorage.store(newValue.rawValue, ordering: .relaxed) }
    }

    /// Holds the access log's lines made on `loop`'s thread until the end of each pass of it (one `write` for
    /// a pass's requests instead of one each). Call before the loop runs; `flush()` when it has stopped.
    public func holdAccessLines(on loop: EventLoop) {
        holdingLoop = loop
        flushTask = LoopTimer(loop: loop) { [unowned self] in flush() }
    }

    /// Writes the held lines now.
    public func flush() {
        held.withLock { pending in
            if !pending.isEmpty { writeHeld(&pending) }
        }
    }

    /// Writes the held lines and empties the buffer (keeping its storage unless a burst made it large).
    private func writeHeld(_ pending: inout [UInt8]) {
        writeAll(pending)
        pending.removeAll(keepingCapacity: pending.capacity <= Self.heldLimit * 2)
    }

    @inline(__always)
    public func enabled(_ level: LogLevel) -> Bool { level.rawValue <= levelStorage.load(ordering: .relaxed) }

    public func error(_ message: @autoclosure () -> String) { log(.error, message()) }
    public func warn(_ message: @autoclosure () -> String) { log(.warn, message()) }
    public func info(_ message: @autoclosure () -> String) { log(.info, message()) }
    public func debug(_ message: @autoclosure () -> String) { log(.debug, message()) }

    /// A line printed whatever the level (start-up facts such as the listening address), labelled info.
    public func always(_ message: @autoclosure () -> String) {
        emit(.info, message())
    }

    /// A connection machine's log line, for connection `id` from `peer` (the drivers' one format).
    func connection(_ id: UInt64, peer: String, _ line: LogLine) {
        let level: LogLevel
        switch line.level {
        case .debug: level = .debug
        case .info: level = .info
        case .warn: level = .warn
        }
        guard enabled(level) else { return }
        if jsonStorage.load(ordering: .relaxed) {
            emit(level, "conn=\(id) client=\(peer) \(line.text)")
            return
        }
        // The access log's line per request goes as bytes straight into the pass's held lines: built as a
        // String in four steps it was a tenth of a forwarded request's instructions.
        func append(to bytes: inout [UInt8]) {
            appendPrefix(level, to: &bytes)
            bytes.append(utf8: "conn=")
            bytes.append(utf8: String(id))  // a small string: no allocation
            bytes.append(utf8: " client=")
            bytes.append(utf8: peer)
            bytes.append(UInt8(ascii: " "))
            bytes.append(contentsOf: line.bytes)
            bytes.append(UInt8(ascii: "\n"))
        }
        guard let flushTask, level != .warn, holdingLoop?.inLoopThread == true else {
            var bytes: [UInt8] = []
            bytes.reserveCapacity(line.bytes.count + peer.utf8.count + 72)
            append(to: &bytes)
            writeLine(bytes)
            return
        }
        let first = held.withLock { pending -> Bool in
            let first = pending.isEmpty
            append(to: &pending)
            if pending.count >= Self.heldLimit { writeHeld(&pending) }
            return first
        }
        if first { flushTask.fireInThisPass() }
    }

    /// The timestamp and the level, each followed by a space.
    private func appendPrefix(_ level: LogLevel, to bytes: inout [UInt8]) {
        appendTimestamp(to: &bytes)
        let name: StaticString =
            switch level {
            case .error: " error "
            case .warn: " warn "
            case .info: " info "
            case .debug: " debug "
            }
        name.withUTF8Buffer { bytes.append(contentsOf: $0) }
    }

    public func log(_ level: LogLevel, _ message: @autoclosure () -> String) {
        guard enabled(level) else { return }
        emit(level, message())
    }

    private func emit(_ level: LogLevel, _ message: String) {
        var bytes: [UInt8] = []
        if jsonStorage.load(ordering: .relaxed) {
            bytes.append(contentsOf: Self.jsonLine(time: timestamp(), level: level, message: message).utf8)
        } else {
            bytes.reserveCapacity(message.utf8.count + 40)
            appendPrefix(level, to: &bytes)
            bytes.append(utf8: message)
        }
        bytes.append(UInt8(ascii: "\n"))
        writeLine(bytes)
    }

    /// Writes `line` after the held lines, if any.
    private func writeLine(_ line: [UInt8]) {
        held.withLock { pending in
            if pending.isEmpty {
                writeAll(line)
            } else {
                pending.append(contentsOf: line)
                writeHeld(&pending)
            }
        }
    }

    private func writeAll(_ line: [UInt8]) {
        line.withUnsafeBytes { buffer in
            var offset = 0
            while offset < buffer.count {
                let written = write(fd, buffer.baseAddress! + offset, buffer.count - offset)
                if written <= 0 {
                    if written < 0 && errno == EINTR { continue }
                    return
                }
                offset += written
            }
        }
    }

    /// One JSON object: `time`, `level`, the connection's `conn` and `client` when the message starts with
    /// them (the access log lines), and the rest as `msg`.
    static func jsonLine(time: String, level: LogLevel, message: String) -> String {
        var members: [(String, JSONValue)] = [("time", .string(time)), ("level", .string(level.description))]
        var rest = Substring(message)
        if rest.hasPrefix("conn="), let space = rest.firstIndex(of: " "),
            let id = Int64(rest[rest.index(rest.startIndex, offsetBy: 5)..<space])
        {
            members.append(("conn", .int(id)))
            rest = rest[rest.index(after: space)...]
            if rest.hasPrefix("client="), let next = rest.firstIndex(of: " ") {
                members.append(("client", .string(String(rest[rest.index(rest.startIndex, offsetBy: 7)..<next]))))
                rest = rest[rest.index(after: next)...]
            }
        }
        members.append(("msg", .string(String(rest))))
        return JSON.serialize(.object(JSONObject(members)))
    }

    /// The formatted second of the last line: most lines share their second with the one before.
    private let lastSecond = Mutex<(seconds: Int, text: String)>((-1, ""))

    /// UTC, millisecond precision, without Foundation's formatter cost.
    func timestamp() -> String {
        var bytes: [UInt8] = []
        bytes.reserveCapacity(24)
        appendTimestamp(to: &bytes)
        return String(decoding: bytes, as: UTF8.self)
    }

    /// `timestamp()` appended to a line's bytes.
    private func appendTimestamp(to bytes: inout [UInt8]) {
        var now = timespec()
        clock_gettime(CLOCK_REALTIME, &now)
        let millis = Int(now.tv_nsec / 1_000_000)
        let prefix = lastSecond.withLock { cached -> String in
            if cached.seconds == now.tv_sec { return cached.text }
            var parts = tm()
            var seconds = now.tv_sec
            gmtime_r(&seconds, &parts)
            func pad(_ value: Int32, _ width: Int) -> String { String(value).leftPadding(to: width) }
            let text =
                "\(pad(parts.tm_year + 1900, 4))-\(pad(parts.tm_mon + 1, 2))-\(pad(parts.tm_mday, 2))T"
                + "\(pad(parts.tm_hour, 2)):\(pad(parts.tm_min, 2)):\(pad(parts.tm_sec, 2))."
            cached = (now.tv_sec, text)
            return text
        }
        bytes.append(utf8: prefix)
        bytes.append(UInt8(ascii: "0") + UInt8(millis / 100))
        bytes.append(UInt8(ascii: "0") + UInt8(millis / 10 % 10))
        bytes.append(UInt8(ascii: "0") + UInt8(millis % 10))
        bytes.append(UInt8(ascii: "Z"))
    }
}
