import CLibevent
import COpenSSL
import ProxyCore

/// Where an HTTP/1.1 client connection goes when its `ClientDriver` is done with it: a tunnel (a blind CONNECT,
/// or an upgrade the origin accepted), or the proxy's TLS on the socket of a CONNECT to a protected origin. Each
/// makes the next owner out of the driver's connections and what their buffers hold; the driver then lets go.
/// Mechanics only: the machine chose the hand-off and wrote the bytes that go first (its 200, the origin's 101).
enum ClientHandOff {
    /// The options of the OpenSSL bufferevents that TLS connections go on as.
    static let tlsOptions = Int32(BEV_OPT_CLOSE_ON_FREE.rawValue | BEV_OPT_DEFER_CALLBACKS.rawValue)

    /// A tunnel between `client` and `upstream`, whose buffers' bytes (the answer to the client, bytes the client
    /// sent early, bytes after an upstream proxy's answer) go first each way: `SpliceTunnel` between two sockets,
    /// `RelayTunnel` when TLS runs on either side (an upgraded connection to a protected origin) or the client
    /// is an HTTP/2 stream (the bytes must pass through OpenSSL or the pair). The relay starts once its owner
    /// holds it (`RelayTunnel.begin`).
    static func tunnel(
        _ identity: ConnectionIdentity, context: ConnectionContext, label: TunnelLabel, status: Int,
        client: (bev: OpaquePointer, ssl: OpaquePointer?), upstream: (bev: OpaquePointer, ssl: OpaquePointer?)
    ) -> any ServerConnection {
        if client.ssl != nil || upstream.ssl != nil || bufferevent_getfd(client.bev) < 0 {
            return RelayTunnel(
                context: context, id: identity.id, peer: identity.peer, client: identity.client, label: label,
                status: status, started: identity.started, clientBev: client.bev, clientSSL: client.ssl,
                upstreamBev: upstream.bev, upstreamSSL: upstream.ssl)
        }
        let clientFD = bufferevent_getfd(client.bev)
        let upstreamFD = bufferevent_getfd(upstream.bev)
        // The bufferevents let go of their descriptors (setfd -1), so freeing them closes nothing. That also
        // unfreezes their buffers, which can then be emptied.
        bufferevent_setfd(client.bev, -1)
        bufferevent_setfd(upstream.bev, -1)
        let toClient = take(bufferevent_get_output(client.bev)) + take(bufferevent_get_input(upstream.bev))
        let toUpstream = take(bufferevent_get_output(upstream.bev)) + take(bufferevent_get_input(client.bev))
        bufferevent_free(client.bev)
        bufferevent_free(upstream.bev)
        return SpliceTunnel(
            context: context, id: identity.id, peer: identity.peer, client: identity.client, label: label,
            status: status, started: identity.started, clientFD: clientFD, upstreamFD: upstreamFD,
            toUpstream: toUpstream, toClient: toClient)
    }

    /// A bufferevent on the socket of the own client's connection the origin switched protocols on (OpenSSL's on
    /// its TLS session, already open, for an https origin); what the origin sent after its 101 goes to
    /// `clientOutput` first, what waited to be written to the origin to the new bufferevent.
    static func adopt(
        _ connection: OriginConnection, loop: EventLoop, clientOutput: OpaquePointer?
    ) -> (bev: OpaquePointer, ssl: OpaquePointer?)? {
        guard let (fd, tls, received, unsent) = connection.handOver() else { return nil }
        let made: OpaquePointer?
        if let tls {
            made = bufferevent_openssl_socket_new(loop.base, fd, tls, BUFFEREVENT_SSL_OPEN, tlsOptions)
            if made == nil { SSL_free(tls) }
            if let made { bufferevent_openssl_set_allow_dirty_shutdown(made, 1) }
        } else {
            made = bufferevent_socket_new(loop.base, fd, tlsOptions)
        }
        guard let made else {
            Platform.closeDescriptor(fd)
            return nil
        }
        ClientDriver.tune(made)
        Buffers.append(received, to: clientOutput)
        Buffers.append(unsent, to: bufferevent_get_output(made))
        return (made, tls)
    }

    /// Everything in `buffer`, removed from it. A bufferevent's buffers are frozen (the output at its front)
    /// while it has a descriptor; call this after bufferevent_setfd(-1).
    private static func take(_ buffer: OpaquePointer?) -> [UInt8] {
        let count = Buffers.length(buffer)
        guard count > 0 else { return [] }
        var bytes = [UInt8](repeating: 0, count: count)
        let taken = bytes.withUnsafeMutableBytes { evbuffer_remove(buffer, $0.baseAddress, count) }
        precondition(taken == count, "a bufferevent buffer was still frozen")
        return bytes
    }

    /// How TLS for an intercepted CONNECT starts, once `send` took `sent` bytes of the machine's `answer` (-1 for
    /// none: an error or a full socket) and the bufferevent held bytes either way (`buffered`, then nothing was
    /// sent): on the socket itself when the whole answer went and nothing waits, else as a filter over the
    /// bufferevent, which sends what is left of the answer first and keeps what the client sent early.
    enum InterceptionStart: Equatable {
        case onTheSocket
        case overTheBufferevent(rest: ArraySlice<UInt8>)
    }

    static func interceptionStart(answer: [UInt8], sent: Int, buffered: Bool) -> InterceptionStart {
        if buffered { return .overTheBufferevent(rest: answer[...]) }
        if sent >= answer.count { return .onTheSocket }
        return .overTheBufferevent(rest: answer[max(0, sent)...])
    }

    /// A CONNECT to a protected origin: the machine's `answer` (its 200) goes to the client on `bev`, then a new
    /// `ClientDriver` runs the proxy's TLS for `origin` on the socket, or as a filter over `bev`. On success `bev`
    /// is no longer the caller's; on failure (no local CA, no TLS session) nothing was sent.
    static func intercept(
        _ identity: ConnectionIdentity, context: ConnectionContext, origin: OriginConfig, answer: [UInt8],
        bev: OpaquePointer
    ) -> Result<ClientDriver, InterceptionFailure> {
        guard let contexts = context.tlsContexts else { return .failure(InterceptionFailure(reason: "no local CA")) }
        let ssl: OpaquePointer
        do {
            ssl = try contexts.makeSSL(for: origin.authority.host)
        } catch {
            return .failure(InterceptionFailure(reason: "\(error)"))
        }
        let fd = bufferevent_getfd(bev)
        let buffered =
            Buffers.length(bufferevent_get_input(bev)) != 0 || Buffers.length(bufferevent_get_output(bev)) != 0
        let sent = buffered ? 0 : answer.withUnsafeBytes { Platform.send(fd, $0) }
        switch interceptionStart(answer: answer, sent: sent, buffered: buffered) {
        case .onTheSocket:
            // The usual case: TLS directly on the socket. The bufferevent lets go of the descriptor.
            bufferevent_setfd(bev, -1)
            bufferevent_free(bev)
            return .success(
                ClientDriver(
                    context: context, id: identity.id, peer: identity.peer, client: identity.client, origin: origin,
                    ssl: ssl, fd: fd, underlying: nil))
        case .overTheBufferevent(let rest):
            // The client sent bytes before our answer, or the socket took part of it: TLS as a filter over the
            // existing bufferevent, which keeps those bytes and sends the rest of the 200 first.
            Buffers.append(Array(rest), to: bufferevent_get_output(bev))
            bufferevent_setcb(bev, nil, nil, nil, nil)
            return .success(
                ClientDriver(
                    context: context, id: identity.id, peer: identity.peer, client: identity.client, origin: origin,
                    ssl: ssl, fd: -1, underlying: bev))
        }
    }

    struct InterceptionFailure: Error {
        let reason: String
    }
}
