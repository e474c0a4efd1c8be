import CLibevent
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

/// One libevent `event_base` and the thread that runs it.
///
/// Everything created on a loop (bufferevents, timers, connections) belongs to it and is used only on its
/// thread, so those objects are plain non-Sendable classes. The only ways in from other threads are `post`
/// and `LoopBound`, both thread-safe.
public final class EventLoop: @unchecked Sendable {
    // @unchecked Sendable: `base` and `wakeEvent` are only used on the loop thread, except through
    // `post`, which locks `jobs` and calls `event_active`, which libevent makes thread-safe once
    // `evthread_use_pthreads` has run (see `EventLoop.initializeLibraries`).

    let base: OpaquePointer
    private var wakeEvent: OpaquePointer?
    private let jobs = Mutex<[@Sendable () -> Void]>([])
    /// The thread running the loop, 0 before `run`.
    private let thread = Atomic<UInt>(0)

    /// Must run before any other thread starts and before the first loop is made; later calls do nothing.
    public static func initializeLibraries() {
        _ = librariesInitialized
    }

    private static let librariesInitialized: Bool = {
        _ = evthread_use_pthreads()
        // Writes to a closed socket must fail with EPIPE, not kill the process.
        signal(SIGPIPE, SIG_IGN)
        return true
    }()

    public init() {
        // libevent keeps timeouts on a monotonic clock: clock changes do not disturb them.
        // The epoll change list: the interest changes a pass makes on one descriptor (a bufferevent enabling
        // and disabling reads and writes, a connection's socket handed from one bufferevent to another) reach
        // the kernel as one epoll_ctl when the pass ends, not one each: 14 calls per intercepted new
        // connection became 7. libevent's caveat is descriptors cloned by dup(), which this program never
        // registers; a descriptor closed and reused within a pass is retried as an add (ENOENT).
        guard let config = event_config_new() else { fatalError("event_config_new failed") }
        defer { event_config_free(config) }
        _ = event_config_set_flag(config, Int32(EVENT_BASE_FLAG_EPOLL_USE_CHANGELIST.rawValue))
        guard let base = event_base_new_with_config(config) else { fatalError("event_base_new failed") }
        self.base = base
        let context = Unmanaged.passUnretained(self).toOpaque()
        wakeEvent = event_new(
            base, -1, Int16(EV_PERSIST),
            { _, _, context in
                Unmanaged<EventLoop>.fromOpaque(context!).takeUnretainedValue().runPostedJobs()
            }, context)
        // A persistent event that is never added is fine for event_active.
    }

    deinit {
        if let wakeEvent { event_free(wakeEvent) }
        event_base_free(base)
    }

    /// The time libevent took when this pass of the loop began (the same for every callback of the pass):
    /// a stamp for work done once per pass. Loop thread only.
    public func passStamp() -> Int64 {
        var now = timeval()
        event_base_gettimeofday_cached(base, &now)
        return Int64(now.tv_sec) * 1_000_000 + Int64(now.tv_usec)
    }

    /// Runs the loop on the calling thread until `stop` or until nothing is left to do.
    public func run() {
        thread.store(Platform.currentThread, ordering: .releasing)
        event_base_loop(base, 0)
    }

    /// Ends `run` after the current callbacks return.
    public func stop() {
        event_base_loopbreak(base)
    }

    /// Whether the caller is on this loop's thread.
    public var inLoopThread: Bool {
        let owner = thread.load(ordering: .acquiring)
        return owner == 0 || owner == Platform.currentThread
    }

    /// Runs `job` on the loop thread soon. Safe from any thread.
    public func post(_ job: @escaping @Sendable () -> Void) {
        jobs.withLock { $0.append(job) }
        event_active(wakeEvent, Int32(EV_READ), 0)
    }

    private func runPostedJobs() {
        let pending = jobs.withLock { queue -> [@Sendable () -> Void] in
            let taken = queue
            queue.removeAll()
            return taken
        }
        for job in pending { job() }
    }

    /// Milliseconds on a monotonic clock, for durations and activity checks.
    public static func monotonicMilliseconds() -> Int64 {
        var now = timespec()
        clock_gettime(CLOCK_MONOTONIC, &now)
        return Int64(now.tv_sec) * 1000 + Int64(now.tv_nsec) / 1_000_000
    }
}

/// A value that belongs to a loop, carried through a Sendable closure (a resolver thread's answer, say) and
/// opened again only on that loop's thread.
public struct LoopBound<Value>: @unchecked Sendable {
    // @unchecked Sendable: the value is only read on the loop thread, which `value` checks.
    private let stored: Value
    private let loop: EventLoop

    public init(_ value: Value, loop: EventLoop) {
        self.stored = value
        self.loop = loop
    }

    public var value: Value {
        precondition(loop.inLoopThread, "a LoopBound value was opened off its loop")
        return stored
    }
}

/// A one-shot or repeating timer on a loop. Cancelled when freed.
public final class LoopTimer {
    private var event: OpaquePointer?
    /// What firing runs; replaced when a spare timer is reused (`ConnectionContext.takeTimer`).
    var action: () -> Void
    /// Kept so that the event base outlives the event: freeing the event after its base was a use after
    /// free (seen as `proxyctl token` hanging at exit, in `event_free`, when a transport outlived its loop).
    private let loop: EventLoop

    public init(loop: EventLoop, action: @escaping () -> Void) {
        self.action = action
        self.loop = loop
        event = event_new(
            loop.base, -1, 0,
            { _, _, context in
                Unmanaged<LoopTimer>.fromOpaque(context!).takeUnretainedValue().action()
            }, Unmanaged.passUnretained(self).toOpaque())
    }

    deinit {
        if let event { event_free(event) }
    }

    /// Fires once after `milliseconds`, replacing an earlier schedule.
    public func schedule(milliseconds: Int) {
        var delay = timeval(milliseconds: milliseconds)
        event_add(event, &delay)
    }

    public func cancel() {
        event_del(event)
    }

    /// Whether it is scheduled and has not fired yet.
    public var isPending: Bool { event_pending(event, Int16(EV_TIMEOUT), nil) != 0 }

    /// Fires in this pass of the loop, after the callbacks already due (at most once however often it is
    /// called before it fired): work that a pass's events add up to, done once for all of them.
    public func fireInThisPass() {
        event_active(event, 0, 0)
    }
}

extension timeval {
    init(milliseconds: Int) {
        self.init(tv_sec: milliseconds / 1000, tv_usec: (milliseconds % 1000) * 1000)
    }
}
