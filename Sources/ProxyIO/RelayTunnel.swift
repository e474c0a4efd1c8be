import CLibevent
import COpenSSL
import ProxyCore

#if canImport(Glibc)
    import Glibc
#elseif canImport(Darwin)
    import Darwin
#endif

/// A tunnel between two bufferevents, for connections where TLS is on either side (an upgraded connection to a
/// protected origin: the client's TLS ends at the proxy, the origin's starts there), so the bytes must go
/// through OpenSSL and cannot be spliced.
///
/// The same rules as `SpliceTunnel`: backpressure (a side is not read while the other's output holds more
/// than `highWater` bytes; reading resumes when it drained to half), half-close (an EOF from one side is
/// passed on once everything it sent was written: TLS close_notify, or shutdown(SHUT_WR) on a plain socket),
/// the end when both directions ended, on an error (the other side is reset so that it cannot take a cut stream
/// for a whole one), or after `idle_timeout` without a byte either way.
final class RelayTunnel: ServerConnection {
    let context: ConnectionContext
    let id: UInt64
    let peer: String
    let clientAddress: String
    let label: TunnelLabel
    let status: Int
    private let started: Int64
    private var lastActivity: Int64
    private var closed = false
    private let client: Side
    private let upstream: Side
    private var idleTimer: LoopTimer?

    /// One end of the relay: its bufferevent, its TLS session if any, and what came from it.
    final class Side {
        let bev: OpaquePointer
        let ssl: OpaquePointer?
        /// It sent its EOF.
        var ended = false
        /// Its EOF was passed on to the other side.
        var passedOn = false
        /// Bytes read from it.
        var bytes = 0

        init(bev: OpaquePointer, ssl: OpaquePointer?) {
            self.bev = bev
            self.ssl = ssl
        }
    }

    init(
        context: ConnectionContext, id: UInt64, peer: String, client clientAddress: String, label: TunnelLabel,
        status: Int,
        started: Int64, clientBev: OpaquePointer, clientSSL: OpaquePointer?, upstreamBev: OpaquePointer,
        upstreamSSL: OpaquePointer?
    ) {
        self.context = context
        self.id = id
        self.peer = peer
        self.clientAddress = clientAddress
        self.label = label
        self.status = status
        self.started = started
        self.lastActivity = EventLoop.monotonicMilliseconds()
        client = Side(bev: clientBev, ssl: clientSSL)
        upstream = Side(bev: upstreamBev, ssl: upstreamSSL)
    }

    var isIdle: Bool { false }

    /// A tunnel has no requests to finish: it runs until its ends close or the shutdown grace runs out.
    func shutdown() {}

    func abort(_ reason: String?) { finish(reason: reason ?? "aborted") }

    private var pointer: UnsafeMutableRawPointer { Unmanaged.passUnretained(self).toOpaque() }

    /// Starts relaying, once the server's table holds the tunnel; bytes already in the inputs go first.
    func begin() {
        for side in [client, upstream] {
            bufferevent_setcb(side.bev, relayReadCallback, relayWriteCallback, relayEventCallback, pointer)
            // The write callback fires when the output drained to half the high-water mark: time to read the
            // other side again.
            bufferevent_setwatermark(side.bev, Int16(EV_WRITE), context.highWater / 2, 0)
            bufferevent_enable(side.bev, Int16(EV_READ | EV_WRITE))
        }
        let timer = LoopTimer(loop: context.loop) { [unowned self] in idleCheck() }
        idleTimer = timer
        timer.schedule(milliseconds: context.settings.idleTimeout)
        readable(client.bev)
        if !closed { readable(upstream.bev) }
    }

    private func side(_ bev: OpaquePointer?) -> (from: Side, to: Side) {
        bev == client.bev ? (client, upstream) : (upstream, client)
    }

    fileprivate func readable(_ bev: OpaquePointer?) {
        guard !closed else { return }
        let (from, to) = side(bev)
        let input = bufferevent_get_input(from.bev)
        let count = Buffers.length(input)
        guard count > 0 else { return }
        lastActivity = EventLoop.monotonicMilliseconds()
        from.bytes += count
        evbuffer_add_buffer(bufferevent_get_output(to.bev), input)
        if Buffers.length(bufferevent_get_output(to.bev)) >= context.highWater {
            bufferevent_disable(from.bev, Int16(EV_READ))
        }
    }

    /// `bev`'s output drained below half the high-water mark (or to nothing).
    fileprivate func writable(_ bev: OpaquePointer?) {
        guard !closed else { return }
        let (to, from) = side(bev)
        lastActivity = EventLoop.monotonicMilliseconds()
        if !from.ended { bufferevent_enable(from.bev, Int16(EV_READ)) }
        if from.ended && Buffers.length(bufferevent_get_output(to.bev)) == 0 { passOnEnd(from, to: to) }
    }

    fileprivate func event(_ bev: OpaquePointer?, _ events: Int16) {
        guard !closed else { return }
        let (from, to) = side(bev)
        let what = Int32(events)
        if what & Int32(BEV_EVENT_EOF) != 0 && what & Int32(BEV_EVENT_ERROR) == 0 {
            // What it sent before its EOF goes on first.
            readable(from.bev)
            from.ended = true
            bufferevent_disable(from.bev, Int16(EV_READ))
            if Buffers.length(bufferevent_get_output(to.bev)) == 0 { passOnEnd(from, to: to) }
            return
        }
        // The connection broke: the other side is reset, so that it does not take a cut stream for a whole one.
        let detail = Self.errorDetail(from.bev)
        proxyctl_set_linger_reset(bufferevent_getfd(to.bev))
        finish(reason: (from === client ? "client connection error" : "upstream connection error") + detail)
    }

    /// What broke: the TLS library's reason, else the socket's.
    private static func errorDetail(_ bev: OpaquePointer) -> String {
        let code = bufferevent_get_openssl_error(bev)
        if code != 0 {
            var buffer = [CChar](repeating: 0, count: 200)
            ERR_error_string_n(code, &buffer, buffer.count)
            return ": " + String(decoding: buffer.prefix { $0 != 0 }.map { UInt8(bitPattern: $0) }, as: UTF8.self)
        }
        let fd = bufferevent_getfd(bev)
        let errno = fd < 0 ? 0 : proxyctl_socket_error(fd)
        return errno == 0 ? "" : ": " + String(cString: strerror(errno))
    }

    /// Half-close: everything `from` sent was written to `to`; `to` learns the end.
    private func passOnEnd(_ from: Side, to: Side) {
        if !from.passedOn {
            from.passedOn = true
            if let ssl = to.ssl {
                _ = SSL_shutdown(ssl)
            } else if bufferevent_getfd(to.bev) >= 0 {
                Platform.shutdownWrite(bufferevent_getfd(to.bev))
            } else {
                // A buffer pair (an HTTP/2 stream's side): the other end reads its EOF.
                bufferevent_flush(to.bev, Int16(EV_WRITE), BEV_FINISHED)
            }
        }
        if client.passedOn && upstream.passedOn { finish(reason: nil) }
    }

    private func idleCheck() {
        guard !closed else { return }
        let quiet = EventLoop.monotonicMilliseconds() - lastActivity
        let limit = Int64(context.settings.idleTimeout)
        if quiet >= limit {
            finish(reason: "idle timeout")
        } else {
            idleTimer?.schedule(milliseconds: Int(limit - quiet))
        }
    }

    private func finish(reason: String?) {
        guard !closed else { return }
        let duration = EventLoop.monotonicMilliseconds() - started
        context.logger.info(
            "conn=\(id) client=\(peer) \(label) status=\(status) up=\(client.bytes) down=\(upstream.bytes) duration=\(LogText.duration(duration))"
                + (reason.map { " closed=\"\($0)\"" } ?? ""))
        context.owner.tunnelEnded(upgrade: status == 101, status: status, up: client.bytes, down: upstream.bytes)
        close()
    }

    func close() {
        guard !closed else { return }
        closed = true
        idleTimer?.cancel()
        idleTimer = nil
        bufferevent_free(client.bev)
        bufferevent_free(upstream.bev)
        context.owner.connectionClosed(self)
    }
}

// MARK: - libevent callbacks (context: the RelayTunnel, unretained; the server's table owns it)

private func relay(_ context: UnsafeMutableRawPointer?) -> RelayTunnel {
    Unmanaged<RelayTunnel>.fromOpaque(context!).takeUnretainedValue()
}

private let relayReadCallback: bufferevent_data_cb = { bev, context in relay(context).readable(bev) }
private let relayWriteCallback: bufferevent_data_cb = { bev, context in relay(context).writable(bev) }
private let relayEventCallback: bufferevent_event_cb = { bev, events, context in relay(context).event(bev, events) }
