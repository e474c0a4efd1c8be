import Foundation
import ProxyOAuth
import Synchronization
import Testing

/// Real commands through `ChildProcess` (what replaced Foundation's `Process`): the input reaches them, both
/// outputs come back apart, the status and a signal are told, a timeout stops them.
@Suite struct ChildProcessTests {
    @Test func inputInOutputAndErrorApartAndTheExitStatus() throws {
        let outcome = try ChildProcess.run(
            "/bin/sh", ["-c", "tr a-z A-Z; echo to-stderr >&2; exit 3"], input: .bytes(Array("secret\n".utf8)),
            output: .capture, error: .capture)
        #expect(String(decoding: outcome.output, as: UTF8.self) == "SECRET\n")
        #expect(String(decoding: outcome.error, as: UTF8.self) == "to-stderr\n")
        #expect(outcome.termination == .exit(3))
        #expect(!outcome.succeeded && !outcome.timedOut)
    }

    @Test func largeOutputsOnBothStreamsDoNotStall() throws {
        // 1 MiB on each stream: more than a pipe holds, so the two must be read together.
        let outcome = try ChildProcess.run(
            "/bin/sh", ["-c", "head -c 1048576 /dev/zero; head -c 1048576 /dev/zero >&2"], output: .capture,
            error: .capture, timeout: 10_000)
        #expect(outcome.output.count == 1_048_576 && outcome.error.count == 1_048_576)
        #expect(outcome.succeeded)
    }

    @Test func aCommandThatOutlivesItsTimeoutIsStopped() throws {
        let started = Date()
        let outcome = try ChildProcess.run("/bin/sh", ["-c", "echo begun; exec sleep 30"], timeout: 300)
        #expect(outcome.timedOut)
        #expect(outcome.termination == .signal(SIGTERM))
        #expect(String(decoding: outcome.output, as: UTF8.self) == "begun\n")
        #expect(Date().timeIntervalSince(started) < 5)
    }

    @Test func theEnvironmentIsTheOneGivenAndSignalsAreAtTheirDefaults() throws {
        signal(SIGPIPE, SIG_IGN)  // as proxyctl runs: the command must not inherit it
        let outcome = try ChildProcess.run(
            "/bin/sh", ["-c", "echo $ONLY; grep SigIgn /proc/self/status"], environment: ["ONLY": "this"])
        let lines = String(decoding: outcome.output, as: UTF8.self).split(separator: "\n")
        #expect(lines.first == "this")
        // The standard signals' bits (1-31); glibc keeps 32 and 33 for itself.
        let ignored = lines.last.flatMap { UInt64($0.split(separator: "\t").last ?? "", radix: 16) }
        #expect(ignored.map { $0 & 0x7fff_ffff } == 0)
    }

    @Test func aMissingProgramIsAStartFailure() {
        #expect(throws: ChildProcess.StartFailure.self) { try ChildProcess.run("/nonexistent/program", []) }
    }

    @Test func startReportsHowTheCommandEnded() async throws {
        let ended = Mutex<ChildProcess.Termination?>(nil)
        try ChildProcess.start("/bin/sh", ["-c", "kill -TERM $$"]) { termination in
            ended.withLock { $0 = termination }
        }
        for _ in 0..<200 where ended.withLock({ $0 }) == nil { try await Task.sleep(for: .milliseconds(10)) }
        #expect(ended.withLock { $0 } == .signal(SIGTERM))
    }

    @Test func whichFindsExecutableFilesOnly() throws {
        #expect(ChildProcess.which("sh", path: "/nonexistent:/bin") == "/bin/sh")
        #expect(ChildProcess.which("bin", path: "/") == nil)  // a directory
        #expect(ChildProcess.which("/bin/sh", path: nil) == "/bin/sh")
        #expect(ChildProcess.which("no-such-command-here", path: "/bin:/usr/bin") == nil)
    }
}
