import CLibevent
import Foundation
import Testing

@testable import ProxyIO

/// The loop batches interest changes (libevent's epoll change list). The case that batching could get wrong:
/// a descriptor deleted and closed, and a new socket given the same number and added, all before the pass ends.
/// The new socket must still be watched.
@Suite struct EventLoopTests {
    final class Fired: @unchecked Sendable {
        var count = 0
    }

    @Test func aDescriptorClosedAndReusedWithinAPassIsStillWatched() throws {
        let loop = EventLoop()
        var first: [Int32] = [0, 0]
        try #require(socketpair(AF_UNIX, Int32(SOCK_STREAM.rawValue), 0, &first) == 0)
        defer { close(first[1]) }
        let fired = Fired()
        let context = Unmanaged.passUnretained(fired).toOpaque()
        let callback: event_callback_fn = { _, _, context in
            Unmanaged<Fired>.fromOpaque(context!).takeUnretainedValue().count += 1
        }
        let old = try #require(event_new(loop.base, first[0], Int16(EV_READ | EV_PERSIST), callback, context))
        event_add(old, nil)
        event_base_loop(loop.base, EVLOOP_NONBLOCK)  // the add reaches the kernel

        // One pass: delete, close, reuse the number, add.
        event_del(old)
        event_free(old)
        let number = first[0]
        var second: [Int32] = [0, 0]
        try #require(socketpair(AF_UNIX, Int32(SOCK_STREAM.rawValue), 0, &second) == 0)
        // The number closed and given to the new socket in one step (dup2): between a close and a socket call,
        // another test running in parallel could take the lowest free number first (seen: 23, not 24).
        try #require(dup2(second[0], number) == number, "the new socket took the closed one's number")
        close(second[0])
        second[0] = number
        defer {
            close(second[0])
            close(second[1])
        }
        let new = try #require(event_new(loop.base, second[0], Int16(EV_READ | EV_PERSIST), callback, context))
        defer { event_free(new) }
        event_add(new, nil)
        #expect(write(second[1], "x", 1) == 1)
        var limit = timeval(tv_sec: 2, tv_usec: 0)
        let stop = event_new(
            loop.base, -1, 0, { _, _, base in event_base_loopbreak(OpaquePointer(base)) },
            UnsafeMutableRawPointer(loop.base))
        defer { event_free(stop) }
        event_add(stop, &limit)
        event_base_loop(loop.base, EVLOOP_ONCE)
        #expect(fired.count == 1, "the reused descriptor's read event fired")
    }
}
