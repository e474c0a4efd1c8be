import CLibevent
import ProxyCore

#if canImport(Glibc)
    import Glibc
#elseif canImport(Darwin)
    import Darwin
#endif

/// A blind tunnel between two sockets that moves bytes with splice(2): kernel pages go from one socket
/// through a pipe to the other, never copied through user space, in chunks of up to a megabyte.
///
/// Backpressure is the pipe: while a direction's pipe holds bytes the destination has not taken, its source
/// is not read. Pipes are taken from a per-loop pool only while bytes are in flight, so an idle tunnel holds
/// two sockets and four libevent events, nothing more. An EOF is passed on as shutdown(SHUT_WR) once the
/// direction has delivered everything (half-close); the tunnel ends when both directions have, on an error,
/// or after `idle_timeout` without bytes either way.
///
/// Where the platform has no splice (`Platform.splices`: macOS, or `PROXYCTL_PORTABLE=1`), or a socket cannot be
/// spliced, the same tunnel is a read/write pump (`copy`): reads into the loop's one buffer, writes what the
/// destination takes at once, and keeps only the rest (the destination is full: backpressure, as the pipe's).
final class SpliceTunnel: ServerConnection {
    let context: ConnectionContext
    let id: UInt64
    let peer: String
    let clientAddress: String
    /// How the tunnel is named in its log line: "CONNECT host:port", or the request that was upgraded.
    let label: TunnelLabel
    let status: Int
    private let started: Int64
    private var lastActivity: Int64
    private var closed = false
    private let up: Direction
    private let down: Direction
    private let clientFD: Int32
    private let upstreamFD: Int32

    /// One direction of the tunnel: bytes read from `source` are written to `destination`.
    final class Direction {
        let source: Int32
        let destination: Int32
        var readEvent: OpaquePointer?
        var writeEvent: OpaquePointer?
        /// Bytes to write before anything is spliced (read before the tunnel started).
        var head: [UInt8]
        var headOffset = 0
        var pipe: (read: Int32, write: Int32)?
        var inPipe = 0
        var sourceEnded = false
        var shutDown = false
        var bytes = 0
        var reading = false
        var writing = false

        init(source: Int32, destination: Int32, head: [UInt8]) {
            self.source = source
            self.destination = destination
            self.head = head
        }

        var finished: Bool { sourceEnded && shutDown }
        var pendingHead: Int { head.count - headOffset }
    }

    init(
        context: ConnectionContext, id: UInt64, peer: String, client: String, label: TunnelLabel, status: Int,
        started: Int64, clientFD: Int32, upstreamFD: Int32, toUpstream: [UInt8], toClient: [UInt8]
    ) {
        self.context = context
        self.id = id
        self.peer = peer
        self.clientAddress = client
        self.label = label
        self.status = status
        self.started = started
        self.lastActivity = EventLoop.monotonicMilliseconds()
        self.clientFD = clientFD
        self.upstreamFD = upstreamFD
        up = Direction(source: clientFD, destination: upstreamFD, head: toUpstream)
        down = Direction(source: upstreamFD, destination: clientFD, head: toClient)
        let pointer = Unmanaged.passUnretained(self).toOpaque()
        for direction in [up, down] {
            direction.readEvent = event_new(
                context.loop.base, direction.source, Int16(EV_READ | EV_PERSIST), tunnelReadCallback, pointer)
            direction.writeEvent = event_new(
                context.loop.base, direction.destination, Int16(EV_WRITE | EV_PERSIST), tunnelWriteCallback, pointer)
        }
        context.pipes.tunnelOpened()
        for direction in [up, down] {
            if direction.pendingHead > 0 { flush(direction) } else { setReading(direction, true) }
        }
    }

    deinit {
        for direction in [up, down] {
            if let event = direction.readEvent { event_free(event) }
            if let event = direction.writeEvent { event_free(event) }
        }
    }

    var isIdle: Bool { false }

    /// A tunnel has no requests to finish: it runs until its ends close or the shutdown grace runs out.
    func shutdown() {}

    // MARK: - Events

    fileprivate func readable(fd: Int32, timedOut: Bool) {
        let direction = fd == clientFD ? up : down
        if timedOut { return idleCheck() }
        pump(direction)
    }

    fileprivate func writable(fd: Int32, timedOut: Bool) {
        let direction = fd == upstreamFD ? up : down
        if timedOut { return idleCheck() }
        flush(direction)
    }

    private func idleCheck() {
        let quiet = EventLoop.monotonicMilliseconds() - lastActivity
        if quiet >= Int64(context.settings.idleTimeout) { finish(reason: "idle timeout") }
    }

    private func setReading(_ direction: Direction, _ on: Bool) {
        guard direction.reading != on, !closed else { return }
        direction.reading = on
        if on {
            var idle = timeval(milliseconds: context.settings.idleTimeout)
            event_add(direction.readEvent, &idle)
        } else {
            event_del(direction.readEvent)
        }
    }

    private func setWriting(_ direction: Direction, _ on: Bool) {
        guard direction.writing != on, !closed else { return }
        direction.writing = on
        if on {
            var idle = timeval(milliseconds: context.settings.idleTimeout)
            event_add(direction.writeEvent, &idle)
        } else {
            event_del(direction.writeEvent)
        }
    }

    // MARK: - Moving bytes

    /// Reads from the source into the pipe and on to the destination, until the source has nothing more,
    /// the destination is full, or a few rounds have passed (other connections get their turn).
    private func pump(_ direction: Direction) {
        for _ in 0..<8 {
            guard !closed, direction.inPipe == 0, direction.pendingHead == 0, !direction.sourceEnded else { return }
            guard let pipe = direction.pipe ?? context.pipes.take() else { return copy(direction) }
            direction.pipe = pipe
            let moved = Platform.splice(from: direction.source, to: pipe.write, length: Self.chunk)
            if moved > 0 {
                direction.inPipe = moved
                direction.bytes += moved
                lastActivity = EventLoop.monotonicMilliseconds()
                flush(direction)
                if moved < Self.chunk { return }
                continue
            }
            if moved == 0 {
                return sourceEnded(direction)
            }
            switch proxyctl_errno() {
            case EAGAIN, EINTR:
                releasePipe(direction)
                return
            case EINVAL, ENOSYS:
                // No splice for this kind of socket here: copy instead.
                context.pipes.disable()
                releasePipe(direction)
                return copy(direction)
            default:
                return broke(direction.source, passTo: direction.destination)
            }
        }
    }

    /// Writes what is waiting for the destination (the head, then the pipe).
    private func flush(_ direction: Direction) {
        guard !closed else { return }
        while direction.pendingHead > 0 {
            let sent = direction.head[direction.headOffset...].withUnsafeBytes { raw in
                Platform.send(direction.destination, raw)
            }
            if sent > 0 {
                direction.headOffset += sent
                continue
            }
            if sent < 0 && (proxyctl_errno() == EAGAIN || proxyctl_errno() == EINTR) {
                setReading(direction, false)
                setWriting(direction, true)
                return
            }
            return broke(direction.destination, passTo: direction.source)
        }
        if !direction.head.isEmpty {
            direction.head = []
            direction.headOffset = 0
        }
        while direction.inPipe > 0, let pipe = direction.pipe {
            let moved = Platform.splice(from: pipe.read, to: direction.destination, length: direction.inPipe)
            if moved > 0 {
                direction.inPipe -= moved
                continue
            }
            if moved < 0 && (proxyctl_errno() == EAGAIN || proxyctl_errno() == EINTR) {
                // The destination is full: stop reading this direction until it drains.
                setReading(direction, false)
                setWriting(direction, true)
                return
            }
            return broke(direction.destination, passTo: direction.source)
        }
        releasePipe(direction)
        setWriting(direction, false)
        if direction.sourceEnded {
            passOnEnd(direction)
        } else {
            setReading(direction, true)
        }
    }

    /// Without splice, the pump: reads into the loop's scratch buffer and writes what the destination takes at
    /// once; what it does not take becomes the direction's head, and reading waits until `flush` delivered it.
    /// A few rounds per wake-up, as `pump`'s.
    private func copy(_ direction: Direction) {
        for _ in 0..<8 {
            guard !closed, direction.pendingHead == 0, !direction.sourceEnded else { return }
            let buffer = context.tunnelBuffer
            let count = buffer.bytes.withUnsafeMutableBytes { raw in
                recv(direction.source, raw.baseAddress, raw.count, 0)
            }
            if count == 0 { return sourceEnded(direction) }
            if count < 0 {
                let code = proxyctl_errno()
                if code == EAGAIN || code == EINTR { return }
                return broke(direction.source, passTo: direction.destination)
            }
            direction.bytes += count
            lastActivity = EventLoop.monotonicMilliseconds()
            var sent = 0
            while sent < count {
                let written = buffer.bytes[sent..<count].withUnsafeBytes { Platform.send(direction.destination, $0) }
                if written > 0 {
                    sent += written
                    continue
                }
                let code = proxyctl_errno()
                if written < 0 && code == EINTR { continue }
                if written < 0 && code != EAGAIN { return broke(direction.destination, passTo: direction.source) }
                // The destination is full: keep the rest and stop reading this direction until it drains.
                direction.head = Array(buffer.bytes[sent..<count])
                direction.headOffset = 0
                setReading(direction, false)
                setWriting(direction, true)
                return
            }
            if count < buffer.bytes.count { return }
        }
    }

    private func sourceEnded(_ direction: Direction) {
        direction.sourceEnded = true
        setReading(direction, false)
        if direction.inPipe == 0 && direction.pendingHead == 0 { passOnEnd(direction) }
    }

    /// Half-close: everything from the source was delivered; pass its FIN on.
    private func passOnEnd(_ direction: Direction) {
        if !direction.shutDown {
            direction.shutDown = true
            Platform.shutdownWrite(direction.destination)
        }
        releasePipe(direction)
        if up.finished && down.finished { finish(reason: nil) }
    }

    private func releasePipe(_ direction: Direction) {
        guard direction.inPipe == 0, let pipe = direction.pipe else { return }
        direction.pipe = nil
        context.pipes.give(pipe)
    }

    /// One side's connection broke (reset, or another error): the other side gets a reset too, so that it
    /// does not take a cut stream for a complete one (a clean close would look like the end of a
    /// read-until-close body).
    private func broke(_ fd: Int32, passTo other: Int32) {
        let code = proxyctl_errno()
        proxyctl_set_linger_reset(other)
        finish(
            reason: fd == clientFD
                ? "client connection error" : "upstream connection error: \(String(cString: strerror(code)))")
    }

    private func finish(reason: String?) {
        guard !closed else { return }
        let duration = EventLoop.monotonicMilliseconds() - started
        context.logger.info(
            "conn=\(id) client=\(peer) \(label) status=\(status) up=\(up.bytes) down=\(down.bytes) duration=\(LogText.duration(duration))"
                + (reason.map { " closed=\"\($0)\"" } ?? ""))
        context.owner.tunnelEnded(upgrade: status == 101, status: status, up: up.bytes, down: down.bytes)
        close()
    }

    func abort(_ reason: String?) { finish(reason: reason ?? "aborted") }

    func close() {
        guard !closed else { return }
        for direction in [up, down] {
            event_del(direction.readEvent)
            event_del(direction.writeEvent)
            direction.reading = false
            direction.writing = false
            if let pipe = direction.pipe {
                // A pipe with bytes left in it cannot go back to the pool.
                Platform.closeDescriptor(pipe.read)
                Platform.closeDescriptor(pipe.write)
                direction.pipe = nil
            }
        }
        closed = true
        Platform.closeDescriptor(clientFD)
        Platform.closeDescriptor(upstreamFD)
        context.pipes.tunnelClosed()
        context.owner.connectionClosed(self)
    }

    /// Bytes per splice: the pool's pipes are enlarged to this size when the system allows.
    static let chunk = 1 << 20
}

/// Pipes for splicing, shared by the tunnels of a loop and held only while bytes are in flight. The pool
/// is emptied whenever the last tunnel closes, so a proxy without tunnels holds no pipes. Where the platform
/// does not splice it has none, and every tunnel copies.
final class PipePool {
    private var free: [(read: Int32, write: Int32)] = []
    private let capacity = 32
    private(set) var available = Platform.splices
    private var tunnels = 0

    deinit { empty() }

    func tunnelOpened() { tunnels += 1 }

    func tunnelClosed() {
        tunnels -= 1
        if tunnels == 0 { empty() }
    }

    private func empty() {
        for pipe in free {
            close(pipe.read)
            close(pipe.write)
        }
        free.removeAll()
    }

    /// A pipe, or nil when splice is not usable here.
    func take() -> (read: Int32, write: Int32)? {
        guard available else { return nil }
        if let pipe = free.popLast() { return pipe }
        return Platform.splicePipe(size: SpliceTunnel.chunk)
    }

    /// Takes back an empty pipe.
    func give(_ pipe: (read: Int32, write: Int32)) {
        if free.count < capacity {
            free.append(pipe)
        } else {
            close(pipe.read)
            close(pipe.write)
        }
    }

    func disable() { available = false }
}

private let tunnelReadCallback: event_callback_fn = { fd, what, context in
    Unmanaged<SpliceTunnel>.fromOpaque(context!).takeUnretainedValue()
        .readable(fd: fd, timedOut: Int32(what) & EV_TIMEOUT != 0)
}

private let tunnelWriteCallback: event_callback_fn = { fd, what, context in
    Unmanaged<SpliceTunnel>.fromOpaque(context!).takeUnretainedValue()
        .writable(fd: fd, timedOut: Int32(what) & EV_TIMEOUT != 0)
}
