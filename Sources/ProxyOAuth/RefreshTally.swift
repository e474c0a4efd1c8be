import Synchronization

/// How many refreshes of one provider's tokens ended well or badly in this process: for the metrics.
public final class RefreshTally: Sendable {
    private let succeeded = Atomic<Int>(0)
    private let failedCount = Atomic<Int>(0)

    public init() {}

    public var ok: Int { succeeded.load(ordering: .relaxed) }
    public var failed: Int { failedCount.load(ordering: .relaxed) }

    func record(ok: Bool) {
        if ok {
            succeeded.add(1, ordering: .relaxed)
        } else {
            failedCount.add(1, ordering: .relaxed)
        }
    }
}
