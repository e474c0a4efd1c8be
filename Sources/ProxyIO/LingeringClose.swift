import CLibevent
import COpenSSL

/// Closing a connection after the proxy's last bytes to it without losing them.
///
/// Closing a socket while the peer's bytes sit unread in it makes the kernel send a reset instead of a FIN, and
/// a reset makes the peer drop what it had received but not yet read: the end of the last response (an HTTP/2
/// client's WINDOW_UPDATEs and PING answers keep coming until it has read everything). So, as nginx's
/// lingering close does, the driver shuts its sending side once its output is flushed, keeps reading and
/// dropping what comes until the peer closes as well, and closes at the latest after `milliseconds`.
enum LingeringClose {
    /// How long the input is still read and dropped after the end was sent.
    static let milliseconds = 2_000

    /// Sends the end of what the proxy writes on `bev`: TLS close_notify where it speaks TLS, then a FIN; the
    /// reading side stays open. False when `bev` has no socket of its own (a buffer pair, a TLS filter over
    /// another bufferevent): the caller closes at once, as before.
    static func shutWrite(_ bev: OpaquePointer) -> Bool {
        // A filter's socket belongs to the bufferevent under it, whose output may still hold bytes.
        guard bufferevent_get_underlying(bev) == nil else { return false }
        let fd = bufferevent_getfd(bev)
        guard fd >= 0 else { return false }
        if let ssl = bufferevent_openssl_get_ssl(bev) { _ = SSL_shutdown(ssl) }
        return Platform.shutdownWrite(fd)
    }
}

/// How far a driver's client connection is in ending; the timers it needs for that are the state's own, so they
/// go with it.
enum ClosePhase {
    case open
    /// The last bytes are going out (`closeAfterFlush`), nothing new is read; `deadline` bounds the wait for a
    /// client that stops reading (HTTP/2, whose responses wait for the client's WINDOW_UPDATEs).
    case flushing(deadline: LoopTimer?)
    /// Everything went out and the sending side is shut: input is read and dropped until the client closes or the
    /// timer fires (`LingeringClose`).
    case lingering(LoopTimer)
    case closed

    var isClosed: Bool {
        if case .closed = self { return true }
        return false
    }

    var isLingering: Bool {
        if case .lingering = self { return true }
        return false
    }

    var isFlushing: Bool {
        if case .flushing = self { return true }
        return false
    }
}
