import Synchronization

/// Whether a refresh token is out at the provider, so that a process about to stop can wait for the answer
/// to be stored instead of losing the rotated refresh token (RFC 9700 §4.14.2: the old one is spent the
/// moment the provider rotates it).
///
/// `enter` (before the refresh token is sent) and `close` (before the process stops) race on one atomic:
/// either the refresh starts and the stop waits for it, or the stop wins and no refresh starts.
public final class RefreshGate: Sendable {
    private let state = Atomic<Int>(0)
    private static let idle = 0
    private static let closed = -1

    public init() {}

    /// Marks a refresh token as sent; false when the gate was closed (the process is stopping: send nothing).
    func enter() -> Bool {
        var current = state.load(ordering: .acquiring)
        while current != Self.closed {
            let (exchanged, original) = state.compareExchange(
                expected: current, desired: current + 1, ordering: .acquiringAndReleasing)
            if exchanged { return true }
            current = original
        }
        return false
    }

    /// The refresh's outcome is stored (or nothing was spent).
    func leave() {
        state.subtract(1, ordering: .releasing)
    }

    /// No refresh is out at the provider right now.
    public var isIdle: Bool { state.load(ordering: .acquiring) <= Self.idle }

    /// Closes the gate when no refresh is out: true means nothing is in flight and none will start. False
    /// while a refresh is in flight (call again once it has ended).
    public func close() -> Bool {
        let (exchanged, original) = state.compareExchange(
            expected: Self.idle, desired: Self.closed, ordering: .acquiringAndReleasing)
        return exchanged || original == Self.closed
    }
}
