import ProxyCore

/// A connection's timers, a slot per kind: an array indexed by the kind, where a dictionary hashed the kind for
/// every arm and disarm (four per request). Both drivers keep theirs here.
struct TimerSlots {
    private var slots = [LoopTimer?](repeating: nil, count: ConnectionTimer.allCases.count)

    subscript(kind: ConnectionTimer) -> LoopTimer? {
        get { slots[Self.index(kind)] }
        set { slots[Self.index(kind)] = newValue }
    }

    /// Schedules the timer of `kind` after `milliseconds`, made by `make` the first time.
    mutating func arm(_ kind: ConnectionTimer, milliseconds: Int, make: () -> LoopTimer) {
        let index = Self.index(kind)
        let timer = slots[index] ?? make()
        slots[index] = timer
        timer.schedule(milliseconds: milliseconds)
    }

    func disarm(_ kind: ConnectionTimer) {
        slots[Self.index(kind)]?.cancel()
    }

    func cancelAll() {
        for case let timer? in slots { timer.cancel() }
    }

    mutating func removeAll() {
        for index in slots.indices { slots[index] = nil }
    }

    private static func index(_ kind: ConnectionTimer) -> Int {
        switch kind {
        case .head: 0
        case .keepAlive: 1
        case .connect: 2
        case .idle: 3
        case .upstreamKeepAlive: 4
        }
    }
}
