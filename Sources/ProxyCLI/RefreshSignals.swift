import Dispatch
import ProxyCore
import ProxyOAuth
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

/// SIGINT and SIGTERM for a command that may spend a refresh token (`proxyctl token`).
///
/// While a refresh token is out at the provider (`RefreshGate`), stopping waits until the answer is stored,
/// for at most `grace` milliseconds (`shutdown_grace`, as `serve` gives its transfers): killed mid-refresh,
/// the command would leave the provider to rotate the token with nobody to keep the new one. A second
/// signal stops at once. Without a refresh in flight a signal stops the command at once, as before. Either
/// way the process ends by the signal itself, so callers see the usual "killed by SIGINT" status.
///
/// The signals reach the queue through a pipe: the handler, installed before `init` returns, writes the signal's
/// number to it. A dispatch signal source is registered later, on libdispatch's manager thread, and a signal
/// that came before that was lost to SIG_IGN: Ctrl-C right after the start did nothing (the integration suite
/// saw it on a loaded machine).
final class RefreshSignals: Sendable {
    private let gate: RefreshGate
    private let grace: Int
    private let context: CommandContext
    private let received = Atomic<Int32>(0)
    private let queue: DispatchQueue
    /// Kept so the source stays installed; never changed after `init` (dispatch sources are thread-safe).
    nonisolated(unsafe) private let source: (any DispatchSourceRead)?

    init(gate: RefreshGate, grace: Int, context: CommandContext) {
        self.gate = gate
        self.grace = grace
        self.context = context
        let queue = DispatchQueue(label: "proxyctl-signals")
        self.queue = queue
        var ends: [Int32] = [-1, -1]
        guard pipe(&ends) == 0 else {
            // No pipe (out of descriptors): the signals keep their default action and stop the command at once.
            source = nil
            return
        }
        for end in ends {
            _ = fcntl(end, F_SETFD, FD_CLOEXEC)
            _ = fcntl(end, F_SETFL, O_NONBLOCK)  // a burst of signals never blocks the handler; reads end at empty
        }
        let readEnd = ends[0]
        let source = DispatchSource.makeReadSource(fileDescriptor: readEnd, queue: queue)
        self.source = source
        refreshSignalPipe = ends[1]
        source.setEventHandler { [self] in
            var numbers = [UInt8](repeating: 0, count: 16)
            while true {
                let count = read(readEnd, &numbers, numbers.count)
                guard count > 0 else { return }
                for number in numbers[..<count] { signalled(Int32(number)) }
            }
        }
        source.resume()
        for number in [SIGINT, SIGTERM] {
            signal(number) { number in
                let saved = errno
                var byte = UInt8(truncatingIfNeeded: number)
                _ = write(refreshSignalPipe, &byte, 1)
                errno = saved
            }
        }
    }

    /// Call when the work is done: a signal that arrived meanwhile ends the process now.
    func finish() {
        let number = received.load(ordering: .acquiring)
        if number != 0 { Self.die(number) }
    }

    private func signalled(_ number: Int32) {
        if received.exchange(number, ordering: .acquiringAndReleasing) != 0 { Self.die(number) }
        // Closing the gate is atomic with a refresh entering it: either nothing is out and none will start,
        // or one is out and we wait for it.
        if gate.close() { Self.die(number) }
        context.err(
            "proxyctl: stopping once the token refresh in flight is answered and stored (at most \(ConfigValue.describeDuration(grace)), so the new refresh token is not lost); send the signal again to stop now"
        )
        let deadline = DispatchTime.now() + .milliseconds(grace)
        waitForGate(number, until: deadline)
    }

    private func waitForGate(_ number: Int32, until deadline: DispatchTime) {
        if gate.close() { Self.die(number) }
        if DispatchTime.now() >= deadline {
            context.err("proxyctl: the provider did not answer within the grace period; stopping anyway")
            Self.die(number)
        }
        queue.asyncAfter(deadline: .now() + .milliseconds(20)) { [self] in waitForGate(number, until: deadline) }
    }

    /// Ends the process by `number` with its default action, as if it had never been caught.
    private static func die(_ number: Int32) -> Never {
        signal(number, SIG_DFL)
        var set = sigset_t()
        sigemptyset(&set)
        sigaddset(&set, number)
        pthread_sigmask(SIG_UNBLOCK, &set, nil)
        raise(number)
        _exit(128 + number)
    }
}

/// The pipe's write end for `RefreshSignals`' handler: set before the handler is installed, read only by it
/// (a load and a write(2) are safe in a signal handler).
nonisolated(unsafe) private var refreshSignalPipe: Int32 = -1
