import Foundation
import ProxyCore
import Synchronization
import Testing

@testable import ProxyIO

/// The log's line format, read back from a pipe: the access-log lines written as bytes at once must read
/// exactly as the general ones (timestamp, level, `conn=`, `client=`, the machine's text), and the JSON format
/// splits them into members.
@Suite struct AccessLogTests {
    /// What `write` logs through a logger of `format`, as text.
    static func logged(_ format: LogFormat, _ write: (Logger) -> Void) throws -> String {
        var fds: [Int32] = [0, 0]
        try #require(pipe(&fds) == 0)
        defer { close(fds[0]) }
        write(Logger(level: .info, format: format, fd: fds[1]))
        close(fds[1])
        return readAll(fds[0])
    }

    /// Everything `fd` gives until its end, as text.
    static func readAll(_ fd: Int32) -> String {
        var bytes: [UInt8] = []
        var buffer = [UInt8](repeating: 0, count: 4096)
        while true {
            let count = read(fd, &buffer, buffer.count)
            if count <= 0 { break }
            bytes += buffer[..<count]
        }
        return String(decoding: bytes, as: UTF8.self)
    }

    @Test func anAccessLogLineReadsAsAnyOtherLine() throws {
        let text = try Self.logged(.text) { logger in
            logger.connection(
                42, peer: "127.0.0.1:5000", LogLine(.info, "GET http://a.test/x status=200 up=0 down=5 ms=1"))
            logger.info("conn=43 client=127.0.0.1:5001 GET http://a.test/y status=204")
            logger.connection(44, peer: "127.0.0.1:5002", LogLine(.debug, "not shown at info"))
        }
        let lines = text.split(separator: "\n", omittingEmptySubsequences: false)
        #expect(lines.count == 3 && lines[2].isEmpty, "\(text)")
        let pattern = #/^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{3}Z info conn=(\d+) client=(\S+) (.*)$/#
        let first = try #require(try pattern.wholeMatch(in: String(lines[0])))
        #expect(first.1 == "42" && first.2 == "127.0.0.1:5000")
        #expect(first.3 == "GET http://a.test/x status=200 up=0 down=5 ms=1")
        let second = try #require(try pattern.wholeMatch(in: String(lines[1])))
        #expect(second.1 == "43" && second.3 == "GET http://a.test/y status=204")
        // The time is now, in UTC, to the millisecond.
        let parser = ISO8601DateFormatter()
        parser.formatOptions = [.withInternetDateTime, .withFractionalSeconds]
        let stamp = try #require(parser.date(from: String(lines[0].prefix(24))), "\(lines[0])")
        #expect(abs(stamp.timeIntervalSinceNow) < 5)
    }

    /// Bytes waiting in a pipe.
    static func waiting(_ fd: Int32) -> Int32 {
        var count: Int32 = 0
        _ = ioctl(fd, UInt(FIONREAD), &count)
        return count
    }

    /// Held access-log lines are written at the end of the pass that made them, together; any other line
    /// writes them first.
    @Test func heldLinesAreWrittenAtTheEndOfThePassInOrder() throws {
        var fds: [Int32] = [0, 0]
        try #require(pipe(&fds) == 0)
        defer { close(fds[0]) }
        let loop = EventLoop()
        let logger = Logger(level: .info, fd: fds[1])
        logger.holdAccessLines(on: loop)
        let during = Mutex<[Int32]>([])
        let reader = fds[0]
        loop.post {
            logger.connection(1, peer: "p:1", LogLine(.info, "first"))
            logger.connection(2, peer: "p:2", LogLine(.info, "second"))
            during.withLock { $0.append(Self.waiting(reader)) }
            logger.info("conn=9 client=q:9 general")  // writes the two held lines, then itself
            during.withLock { $0.append(Self.waiting(reader)) }
            logger.connection(3, peer: "p:3", LogLine(.info, "third"))
            logger.connection(4, peer: "p:4", LogLine(.warn, "a warning is not held"))
            during.withLock { $0.append(Self.waiting(reader)) }
            logger.connection(5, peer: "p:5", LogLine(.info, "fifth"))
        }
        loop.run()  // the posted job, then the flush at the end of its pass
        let counts = during.withLock { $0 }
        #expect(counts.count == 3 && counts[0] == 0 && counts[1] > 0 && counts[2] > counts[1], "\(counts)")
        close(fds[1])
        let messages = Self.readAll(fds[0]).split(separator: "\n").map {
            $0.split(separator: " ", maxSplits: 4).last.map(String.init) ?? ""
        }
        #expect(messages == ["first", "second", "general", "third", "a warning is not held", "fifth"], "\(messages)")
    }

    @Test func jsonSplitsTheConnectionAndTheClient() throws {
        let text = try Self.logged(.json) { logger in
            logger.connection(7, peer: "[::1]:9", LogLine(.warn, "say \"hi\""))
        }
        let object = try #require(
            try JSONSerialization.jsonObject(with: Data(text.utf8)) as? [String: Any], "\(text)")
        #expect(object["conn"] as? Int == 7)
        #expect(object["client"] as? String == "[::1]:9")
        #expect(object["msg"] as? String == "say \"hi\"")
        #expect(object["level"] as? String == "warn")
    }
}
