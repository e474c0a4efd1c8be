import CLibevent
import ProxyCore
import ProxyOAuth
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

/// The loopback HTTP listener that receives the browser's redirect after sign-in (RFC 8252 §7.3).
///
/// Listens on 127.0.0.1 only. Answers every request with a short page and closes the connection; the first
/// request to the redirect path carrying the expected `state` is handed to the waiting login and answered with
/// a 303 to `/done`, so that the address bar and the history keep no code. `/done` waits for the login's
/// `finish` (the tokens stored, or why not) and says it: the provider, the account, go back to the terminal;
/// or the reason and the command to try again. The query is never logged: it holds the authorization code.
public final class LoopbackReceiver: RedirectReceiver {
    public let redirectURI: String
    private let loop: EventLoop
    private let server: LoopBound<Listener>

    /// Binds 127.0.0.1:`port` (0: any free port) for `path`.
    public static func start(loop: EventLoop, port: Int, path: String) async throws -> LoopbackReceiver {
        try await withCheckedThrowingContinuation { continuation in
            loop.post {
                do {
                    let listener = try Listener(loop: loop, port: port, path: path)
                    continuation.resume(returning: LoopbackReceiver(loop: loop, listener: listener))
                } catch {
                    continuation.resume(throwing: error)
                }
            }
        }
    }

    /// Whether a login could listen on 127.0.0.1:`port` now: a bind with SO_REUSEADDR, as the listener's
    /// (a connection in TIME_WAIT does not count; a listening socket does).
    public static func canListen(port: Int) -> Bool {
        guard let address = SocketAddress(ip: "127.0.0.1", port: port) else { return false }
        let fd = Platform.tcpSocket(family: AF_INET, nonBlocking: false)
        guard fd >= 0 else { return false }
        defer { Platform.closeDescriptor(fd) }
        var one: Int32 = 1
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, socklen_t(MemoryLayout<Int32>.size))
        return address.withSockaddr { pointer, length in bind(fd, pointer, length) == 0 }
    }

    private init(loop: EventLoop, listener: Listener) {
        self.loop = loop
        self.redirectURI = "http://127.0.0.1:\(listener.port)\(listener.path)"
        self.server = LoopBound(listener, loop: loop)
    }

    public func expect(state: String) async {
        await withCheckedContinuation { continuation in
            loop.post { [server] in
                server.value.expect(state: state)
                continuation.resume()
            }
        }
    }

    public func waitForResponse(timeout: Int) async throws -> [(String, String)] {
        try await withCheckedThrowingContinuation { continuation in
            loop.post { [server] in
                server.value.wait(timeout: timeout) { result in continuation.resume(with: result) }
            }
        }
    }

    public func finish(_ end: SignInEnd) async {
        await withCheckedContinuation { (continuation: CheckedContinuation<Void, Never>) in
            loop.post { [server] in
                server.value.finish(end) { continuation.resume() }
            }
        }
    }

    public func close() {
        loop.post { [server] in server.value.shutdown() }
    }

    /// How long `finish` waits for the browser to fetch and receive its page (it follows the 303 at once; a
    /// client that does not follow it must not hold the login up for long).
    static let pageWait = 3_000

    /// The listener and its connections, on the loop thread.
    final class Listener {
        let loop: EventLoop
        let path: String
        private(set) var port = 0
        private var listener: OpaquePointer?
        private var connections: [ObjectIdentifier: Connection] = [:]
        private var expectedState: String?
        private var completion: ((Result<[(String, String)], any Error>) -> Void)?
        private var timer: LoopTimer?
        /// An answer that arrived before anyone waited for it.
        private var result: Result<[(String, String)], any Error>?
        /// Where the redirect sends the browser after the callback: the page that says how the sign-in ended.
        let donePath: String
        /// A callback was accepted and redirected to `donePath`: its page is worth waiting for.
        private var redirected = false
        /// How the sign-in ended, once the login says (`finish`).
        private var ending: SignInEnd?
        /// Browsers waiting on `donePath` for the ending.
        private var held: [Connection] = []
        /// Connections given the ending's page and still writing it.
        private var showing = 0
        /// The login's `finish`, waiting for the page to reach the browser.
        private var finished: (() -> Void)?
        private var finishTimer: LoopTimer?

        init(loop: EventLoop, port: Int, path: String) throws {
            self.loop = loop
            self.path = path
            self.donePath = path == "/done" ? "/finished" : "/done"
            guard let address = SocketAddress(ip: "127.0.0.1", port: port) else {
                throw AuthError.configuration(reason: "bad port")
            }
            let flags = LEV_OPT_CLOSE_ON_FREE | LEV_OPT_REUSEABLE | LEV_OPT_CLOSE_ON_EXEC
            listener = address.withSockaddr { pointer, length in
                evconnlistener_new_bind(loop.base, nil, nil, UInt32(flags), 16, pointer, Int32(length))
            }
            guard let listener else {
                let reason = String(cString: strerror(proxyctl_errno()))
                throw AuthError.configuration(
                    reason:
                        "cannot listen on 127.0.0.1:\(port) for the sign-in redirect: \(reason)\(port == 0 ? "" : " (is another login running? change redirect_port)")"
                )
            }
            var storage = sockaddr_storage()
            var length = socklen_t(MemoryLayout<sockaddr_storage>.size)
            let fd = evconnlistener_get_fd(listener)
            self.port = withUnsafeMutablePointer(to: &storage) { pointer in
                pointer.withMemoryRebound(to: sockaddr.self, capacity: 1) { raw in
                    getsockname(fd, raw, &length)
                    return SocketAddress(raw, length: length).port
                }
            }
            evconnlistener_set_cb(
                listener,
                { _, fd, _, _, context in
                    Unmanaged<Listener>.fromOpaque(context!).takeUnretainedValue().accepted(fd)
                }, Unmanaged.passUnretained(self).toOpaque())
        }

        deinit {
            if let listener { evconnlistener_free(listener) }
            // The connections' bufferevents go now, while `loop` (their event base) is surely alive: stored
            // properties are released after this body, in an order that must not matter.
            connections.removeAll()
            timer = nil
        }

        func expect(state: String) {
            expectedState = state
            result = nil
        }

        func wait(timeout: Int, completion: @escaping (Result<[(String, String)], any Error>) -> Void) {
            if let result {
                self.result = nil
                completion(result)
                return
            }
            self.completion = completion
            let timer = LoopTimer(loop: loop) { [unowned self] in
                self.deliver(
                    .failure(
                        AuthError.cancelled(
                            reason:
                                "nobody finished the sign-in within \(ConfigValue.describeDuration(timeout)); run the login again"
                        )))
            }
            timer.schedule(milliseconds: timeout)
            self.timer = timer
        }

        func shutdown() {
            if let listener { evconnlistener_free(listener) }
            listener = nil
            for connection in connections.values { connection.close() }
            held = []
            deliver(.failure(AuthError.cancelled(reason: "the sign-in was stopped")))
            endFinish()
        }

        /// The login's word on how the sign-in ended: the browsers waiting on `donePath` get the page now, a
        /// browser still following the redirect gets it when it comes. `done` runs once the page has been
        /// written to a browser, or after `pageWait` without one.
        func finish(_ end: SignInEnd, done: @escaping () -> Void) {
            ending = end
            let waiting = held
            held = []
            for connection in waiting { show(end, on: connection) }
            guard redirected else { return done() }
            finished = done
            let timer = LoopTimer(loop: loop) { [unowned self] in self.endFinish() }
            timer.schedule(milliseconds: LoopbackReceiver.pageWait)
            finishTimer = timer
        }

        private func show(_ end: SignInEnd, on connection: Connection) {
            showing += 1
            connection.answerEnding(Page.render(end))
        }

        /// A connection given the ending's page has written it and closed.
        func pageDelivered() {
            showing -= 1
            if showing == 0 { endFinish() }
        }

        private func endFinish() {
            finishTimer = nil
            let done = finished
            finished = nil
            done?()
        }

        /// Hands the answer to the waiting login, or keeps it until the login waits.
        private func deliver(_ outcome: Result<[(String, String)], any Error>) {
            timer = nil
            expectedState = nil
            if let completion {
                self.completion = nil
                completion(outcome)
            } else {
                result = outcome
            }
        }

        private func accepted(_ fd: Int32) {
            let connection = Connection(listener: self, fd: fd)
            connections[ObjectIdentifier(connection)] = connection
        }

        func closed(_ connection: Connection) {
            connections.removeValue(forKey: ObjectIdentifier(connection))
            held.removeAll { $0 === connection }
        }

        /// What a request is answered.
        enum Reply {
            case page(status: Int, html: String)
            /// 303 to this path.
            case redirect(String)
            /// Held until the login says how the sign-in ended.
            case hold
        }

        /// Decides the answer to one request and hands a matching redirect to the login.
        func handle(_ head: HTTPHead, connection: Connection) -> Reply {
            let (pathPart, query) = TargetText.split(head.target, at: "?")
            if head.method == "GET", pathPart.utf8.elementsEqual(donePath.utf8) {
                if let ending {
                    showing += 1
                    return .page(status: 200, html: Page.render(ending))
                }
                if redirected {
                    held.append(connection)
                    return .hold
                }
                return .page(
                    status: 404,
                    html: Page.render(title: "Nothing yet", message: "No sign-in has come back to proxyctl yet."))
            }
            guard head.method == "GET", pathPart.utf8.elementsEqual(path.utf8) else {
                return .page(
                    status: 404,
                    html: Page.render(
                        title: "Not found", message: "This address only receives the sign-in answer for proxyctl."))
            }
            guard let parameters = FormEncoding.decode(query ?? "") else {
                return .page(
                    status: 400,
                    html: Page.render(title: "Bad request", message: "The sign-in answer could not be read."))
            }
            let state = parameters.first { $0.0 == "state" }?.1
            guard let expectedState, state == expectedState else {
                return .page(
                    status: 400,
                    html: Page.render(
                        title: "Unknown sign-in",
                        message:
                            "This answer does not belong to the sign-in proxyctl is waiting for. Start the login again."
                    ))
            }
            // The code (or the provider's error) is read: the browser moves on to a clean address, whose page
            // says how the sign-in ended once the login knows.
            ending = nil
            redirected = true
            deliver(.success(parameters))
            return .redirect(donePath)
        }
    }

    /// One browser connection: read a head, answer, close.
    final class Connection {
        unowned let listener: Listener
        private var bev: OpaquePointer?
        private var parser = HTTPHeadParser(
            kind: .request, limits: HTTPHeadLimits(maxStartLine: 8192, maxHeadBytes: 32768, maxFields: 100))
        private var answered = false

        init(listener: Listener, fd: Int32) {
            self.listener = listener
            bev = bufferevent_socket_new(listener.loop.base, fd, Int32(BEV_OPT_CLOSE_ON_FREE.rawValue))
            let context = Unmanaged.passUnretained(self).toOpaque()
            bufferevent_setcb(
                bev,
                { _, context in Unmanaged<Connection>.fromOpaque(context!).takeUnretainedValue().readable() },
                { _, context in Unmanaged<Connection>.fromOpaque(context!).takeUnretainedValue().writable() },
                { _, _, context in Unmanaged<Connection>.fromOpaque(context!).takeUnretainedValue().close() },
                context)
            var timeout = timeval(milliseconds: 30_000)
            bufferevent_set_timeouts(bev, &timeout, &timeout)
            bufferevent_enable(bev, Int16(EV_READ | EV_WRITE))
        }

        func readable() {
            guard !answered else { return }
            let input = bufferevent_get_input(bev)
            var outcome = HTTPHeadParser.Outcome.needMore
            Buffers.forEachSegment(input) { segment in
                outcome = parser.parse(segment)
                if case .needMore = outcome { return true }
                return false
            }
            evbuffer_drain(input, Buffers.length(input))
            switch outcome {
            case .needMore:
                return
            case .failed:
                answer(400, Page.render(title: "Bad request", message: "proxyctl could not read this request."))
            case .complete(let head, _):
                switch listener.handle(head, connection: self) {
                case .page(let status, let html):
                    // The ending's page is counted by the listener until it is written.
                    endingPage = html.contains(Page.endingMarker)
                    answer(status, html)
                case .redirect(let location):
                    answered = true
                    let head =
                        "HTTP/1.1 303 See Other\r\nLocation: \(location)\r\nContent-Length: 0\r\n"
                        + "Cache-Control: no-store\r\nReferrer-Policy: no-referrer\r\nConnection: close\r\n\r\n"
                    Buffers.append(Array(head.utf8), to: bufferevent_get_output(bev))
                case .hold:
                    // Waits for the login: no timeout meanwhile (a token exchange may take token_timeout).
                    answered = true
                    holding = true
                    bufferevent_set_timeouts(bev, nil, nil)
                }
            }
        }

        /// The ending's page, for a connection that was held.
        func answerEnding(_ html: String) {
            guard bev != nil else { return listener.pageDelivered() }
            holding = false
            endingPage = true
            var timeout = timeval(milliseconds: 30_000)
            bufferevent_set_timeouts(bev, &timeout, &timeout)
            answer(200, html)
        }

        /// This connection carries the ending's page: the listener hears when it is written.
        private var endingPage = false
        /// Held until the sign-in ends: nothing to write yet.
        private var holding = false

        private func answer(_ status: Int, _ page: String) {
            answered = true
            let body = Array(page.utf8)
            let head =
                "HTTP/1.1 \(status) \(ProxyResponse.reasonPhrase(status))\r\nContent-Type: text/html; charset=utf-8\r\n"
                + "Content-Length: \(body.count)\r\nCache-Control: no-store\r\nReferrer-Policy: no-referrer\r\n"
                + "Connection: close\r\n\r\n"
            Buffers.append(Array(head.utf8) + body, to: bufferevent_get_output(bev))
        }

        func writable() {
            if answered && !holding && Buffers.length(bufferevent_get_output(bev)) == 0 { close() }
        }

        deinit { if let bev { bufferevent_free(bev) } }

        func close() {
            guard let bev else { return }
            bufferevent_free(bev)
            self.bev = nil
            listener.closed(self)
            if endingPage {
                endingPage = false
                listener.pageDelivered()
            }
        }
    }

    enum Page {
        /// In the pages that say how a sign-in ended (the listener counts them until written).
        static let endingMarker = "<main id=\"ending\">"

        static func render(title: String, message: String) -> String {
            """
            <!doctype html><html><head><meta charset="utf-8"><title>proxyctl: \(escape(title))</title>
            <style>body{font-family:system-ui,sans-serif;max-width:32em;margin:4em auto;color:#222}</style>
            </head><body><h1>\(escape(title))</h1><p>\(escape(message))</p></body></html>
            """
        }

        static func render(_ end: SignInEnd) -> String {
            render(title: end.title, message: end.message).replacing("<h1>", with: "\(endingMarker)<h1>")
                .replacing("</body>", with: "</main></body>")
        }

        /// Text from the provider (an account's name, an error description) is shown, never interpreted.
        static func escape(_ text: String) -> String {
            var escaped = ""
            for character in text {
                switch character {
                case "&": escaped += "&amp;"
                case "<": escaped += "&lt;"
                case ">": escaped += "&gt;"
                case "\"": escaped += "&quot;"
                case "'": escaped += "&#39;"
                default: escaped.append(character)
                }
            }
            return escaped
        }
    }
}
