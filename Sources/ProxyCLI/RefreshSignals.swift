import Dispatch
import Foundation
import ProxyCore
import ProxyOAuth
import Synchronization

/// SIGINT and SIGTERM for a command that may spend a refresh token (`proxyctl token`).
///
/// While a refresh token is out at the provider (`RefreshGate`), stopping waits until the answer is stored,
/// for at most `grace` milliseconds (`shutdown_grace`, as `serve` gives its transfers): killed mid-refresh,
/// the command would leave the provider to rotate the token with nobody to keep the new one. A second
/// signal stops at once. Without a refresh in flight a signal stops the command at once, as before. Either
/// way the process ends by the signal itself, so callers see the usual "killed by SIGINT" status.
final class RefreshSignals: Sendable {
    private let gate: RefreshGate
    private let grace: Int
    private let context: CommandContext
    private let received = Atomic<Int32>(0)
    private let queue: DispatchQueue
    /// Kept so the sources stay installed; never changed after `init` (dispatch sources are thread-safe).
    nonisolated(unsafe) private let sources: [any DispatchSourceSignal]

    init(gate: RefreshGate, grace: Int, context: CommandContext) {
        self.gate = gate
        self.grace = grace
        self.context = context
        let numbers = [SIGINT, SIGTERM]
        let queue = DispatchQueue(label: "proxyctl-signals")
        self.queue = queue
        sources = numbers.map { DispatchSource.makeSignalSource(signal: $0, queue: queue) }
        for (number, source) in zip(numbers, sources) {
            // A dispatch source sees the signal only when its default action is off.
            signal(number, SIG_IGN)
            source.setEventHandler { [self] in signalled(number) }
            source.resume()
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
