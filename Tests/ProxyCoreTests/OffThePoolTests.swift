import Foundation
import Synchronization
import Testing

/// `offThePool` must leave Swift's cooperative pool free: with as many walks running as the pool has
/// threads, a task started meanwhile still runs. `DispatchQueue.global()` fails this on Linux (the runtime's
/// jobs share its threads), which let the exhaustive walks starve token refreshes in ProxyOAuthTests.
@Suite struct OffThePoolTests {
    final class Probe: Sendable {
        let started = Atomic<Int>(0)
        let ranWhileHeld = Atomic<Bool>(false)
        let taskRan = DispatchSemaphore(value: 0)
        let released = Atomic<Bool>(false)
    }

    @Test func aTaskRunsWhileAPoolsWorthOfWorkIsOffThePool() async {
        let width = ProcessInfo.processInfo.activeProcessorCount
        let probe = Probe()
        // A thread outside every pool starts the task once all the work holds its thread, and lets the work go
        // when the task has run, or after a minute: a broken offThePool fails instead of hanging.
        Thread {
            while probe.started.load(ordering: .acquiring) < width { usleep(1000) }
            Task { probe.taskRan.signal() }
            probe.ranWhileHeld.store(probe.taskRan.wait(timeout: .now() + 60) == .success, ordering: .releasing)
            probe.released.store(true, ordering: .releasing)
        }.start()
        await withTaskGroup(of: Void.self) { group in
            for _ in 0..<width {
                group.addTask {
                    await offThePool {
                        probe.started.add(1, ordering: .releasing)
                        // Busy like a walk: Dispatch on Linux adds threads for blocked ones, not for busy ones.
                        while !probe.released.load(ordering: .acquiring) {}
                    }
                }
            }
        }
        let ranWhileHeld = probe.ranWhileHeld.load(ordering: .acquiring)
        #expect(ranWhileHeld, "a task waited for the work run off the pool")
    }
}
