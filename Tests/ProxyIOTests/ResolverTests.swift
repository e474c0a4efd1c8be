import Foundation
import ProxyCore
import Synchronization
import Testing

@testable import ProxyIO

@Suite struct SocketAddressTests {
    @Test func parsesIPv4Literal() throws {
        let address = try #require(SocketAddress(ip: "127.0.0.1", port: 8080))
        #expect(address.family == AF_INET)
        #expect(address.port == 8080)
        #expect(address.description == "127.0.0.1:8080")
    }

    @Test func parsesIPv6Literal() throws {
        let address = try #require(SocketAddress(ip: "::1", port: 443))
        #expect(address.family == AF_INET6)
        #expect(address.description == "[::1]:443")
    }

    @Test func rejectsNames() {
        #expect(SocketAddress(ip: "localhost", port: 80) == nil)
        #expect(SocketAddress(ip: "1.2.3", port: 80) == nil)
    }
}

@Suite struct ResolverTests {
    /// Runs `resolve` on a real loop and returns what the completion saw.
    func resolve(_ host: HostPort) -> Result<[SocketAddress], ResolveError>? {
        EventLoop.initializeLibraries()
        let loop = EventLoop()
        let outcome = Mutex<Result<[SocketAddress], ResolveError>?>(nil)
        // Keeps the loop alive until the answer arrives, and bounds the wait.
        let guardTimer = LoopTimer(loop: loop) { loop.stop() }
        guardTimer.schedule(milliseconds: 10_000)
        Resolver().resolve(host, loop: loop) { result in
            outcome.withLock { $0 = result }
            loop.stop()
        }
        if outcome.withLock({ $0 }) == nil { loop.run() }
        return outcome.withLock { $0 }
    }

    @Test func literalAnswersWithoutAThread() throws {
        let result = try #require(resolve(HostPort(host: "10.1.2.3", port: 80, kind: .ipv4)))
        let addresses = try result.get()
        #expect(addresses.map(\.description) == ["10.1.2.3:80"])
    }

    @Test func localhostResolvesThroughTheSystem() throws {
        let result = try #require(resolve(HostPort(host: "localhost", port: 8080, kind: .name)))
        let addresses = try result.get()
        #expect(addresses.contains { $0.ipString == "127.0.0.1" || $0.ipString == "::1" })
        #expect(addresses.allSatisfy { $0.port == 8080 })
    }

    @Test func unknownNameIsNotFound() throws {
        // RFC 6761 §6.4: .invalid never resolves.
        let result = try #require(resolve(HostPort(host: "no-such-host.invalid", port: 80, kind: .name)))
        switch result {
        case .failure(let error): #expect(error == .notFound)
        case .success(let addresses): Issue.record("resolved to \(addresses)")
        }
    }
}

@Suite struct LoggerTests {
    @Test func writesOneLinePerMessageAtOrAboveTheLevel() throws {
        var fds: [Int32] = [0, 0]
        #expect(pipe(&fds) == 0)
        let logger = Logger(level: .info, fd: fds[1])
        logger.debug("hidden")
        logger.info("shown key=value")
        logger.error("also shown")
        close(fds[1])
        let data = FileHandle(fileDescriptor: fds[0], closeOnDealloc: true).readDataToEndOfFile()
        let lines = String(decoding: data, as: UTF8.self).split(separator: "\n")
        #expect(lines.count == 2)
        #expect(lines[0].hasSuffix(" info shown key=value"))
        #expect(lines[1].hasSuffix(" error also shown"))
        // 2026-11-30T08:40:40.123Z
        let stamp = lines[0].prefix(24)
        #expect(stamp.count == 24 && stamp.hasSuffix("Z") && stamp.dropFirst(10).first == "T")
    }
}
