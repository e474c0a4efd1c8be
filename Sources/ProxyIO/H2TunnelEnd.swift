import CLibevent
import ProxyCore

/// Our end of a WebSocket stream's buffer pair (RFC 8441), the context pointer of its callbacks. The other end is
/// an HTTP/1.1 `ClientDriver`'s client connection, which runs the upgrade as it runs any (tokens, the origin's
/// TLS, refresh and replay); the stream's DATA goes in here, what comes out goes to the stream.
final class TunnelEnd {
    private(set) weak var driver: H2Driver?
    let stream: Int32
    let bev: OpaquePointer
    private var closed = false

    private init(driver: H2Driver, stream: Int32, bev: OpaquePointer) {
        self.driver = driver
        self.stream = stream
        self.bev = bev
    }

    /// A buffer pair for `stream` of `driver`'s connection, its inner end given to a new `ClientDriver` (adopted
    /// by the server's table and started) and `head`, the upgrade request, written to it. Nil when libevent
    /// cannot make the pair.
    static func open(
        driver: H2Driver, stream: Int32, head: [UInt8], context: ConnectionContext, origin: OriginConfig
    ) -> TunnelEnd? {
        var pair: [OpaquePointer?] = [nil, nil]
        let options = Int32(BEV_OPT_CLOSE_ON_FREE.rawValue | BEV_OPT_DEFER_CALLBACKS.rawValue)
        guard bufferevent_pair_new(context.loop.base, options, &pair) == 0, let inner = pair[0], let outer = pair[1]
        else { return nil }
        let end = TunnelEnd(driver: driver, stream: stream, bev: outer)
        let client = ClientDriver(
            context: context, id: driver.id, peer: driver.peer, client: driver.clientAddress, origin: origin,
            pair: inner)
        context.owner.adopt(client)
        client.begin()
        bufferevent_setwatermark(outer, Int16(EV_WRITE), context.highWater / 2, 0)
        bufferevent_setcb(
            outer, tunnelReadCallback, tunnelWriteCallback, tunnelEventCallback,
            Unmanaged.passUnretained(end).toOpaque())
        bufferevent_enable(outer, Int16(EV_READ | EV_WRITE))
        Buffers.append(head, to: bufferevent_get_output(outer))
        return end
    }

    var input: OpaquePointer { bufferevent_get_input(bev) }
    var output: OpaquePointer { bufferevent_get_output(bev) }

    /// Reading from the HTTP/1.1 side on or off (the client's stream window is full, or drained).
    func setReading(_ on: Bool) {
        if on { bufferevent_enable(bev, Int16(EV_READ)) } else { bufferevent_disable(bev, Int16(EV_READ)) }
    }

    /// The client ended its side of the stream: the HTTP/1.1 side reads its end once the bytes before it.
    func endInput() {
        bufferevent_flush(bev, Int16(EV_WRITE), BEV_FINISHED)
    }

    /// Ends the pair: the other side reads its end (EOF), then this end is freed.
    func close() {
        guard !closed else { return }
        closed = true
        bufferevent_setcb(bev, nil, nil, nil, nil)
        bufferevent_flush(bev, Int16(EV_WRITE), BEV_FINISHED)
        bufferevent_free(bev)
    }
}

private func tunnelEnd(_ pointer: UnsafeMutableRawPointer?) -> TunnelEnd {
    Unmanaged<TunnelEnd>.fromOpaque(pointer!).takeUnretainedValue()
}

private let tunnelReadCallback: bufferevent_data_cb = { _, context in
    let end = tunnelEnd(context)
    end.driver?.tunnelReadable(end)
}
private let tunnelWriteCallback: bufferevent_data_cb = { _, context in
    let end = tunnelEnd(context)
    end.driver?.tunnelWritable(end)
}
private let tunnelEventCallback: bufferevent_event_cb = { _, events, context in
    let end = tunnelEnd(context)
    end.driver?.tunnelEvent(end, events)
}
