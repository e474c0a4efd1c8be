import CCurl
import CLibevent
import ProxyCore

#if canImport(FoundationEssentials)
    import FoundationEssentials
#else
    import Foundation
#endif

/// libcurl's multi interface driven by a libevent loop (the pattern of curl's hiperfifo.c).
///
/// curl tells us which sockets to watch (`CURLMOPT_SOCKETFUNCTION`) and when to call it back
/// (`CURLMOPT_TIMERFUNCTION`); libevent watches them; readiness goes back to curl through
/// `curl_multi_socket_action`; finished transfers come out of `curl_multi_info_read`. Loop thread only.
final class CurlMulti {
    let loop: EventLoop
    private let multi: UnsafeMutableRawPointer
    /// TLS sessions and DNS answers shared by every transfer of this multi handle (the connection cache is
    /// the multi handle's own): each request is a new easy handle, which alone would resume nothing.
    private let share: UnsafeMutableRawPointer?
    private var timer: LoopTimer?
    /// Transfers in progress, by easy handle; the table keeps them alive while curl holds them.
    private var transfers: [UnsafeMutableRawPointer: CurlTransfer] = [:]
    /// How deep the loop is inside libcurl (its callbacks run there). libcurl forbids removing a handle from
    /// inside any callback, and resuming another from there is unsafe: both wait until the call returned.
    private var depth = 0
    /// Transfers cancelled inside libcurl: removed once it returned (kept alive until then, as libcurl may
    /// still call them, and fail them, in the same call).
    private var removals: [CurlTransfer] = []
    private var resumes: [CurlTransfer] = []
    private var additions: [CurlTransfer] = []
    /// Easy handles of finished transfers, reset and ready for the next one: making one per request (and
    /// freeing it) was a measurable part of an intercepted request's cost (docs/performance.md).
    private var idleEasies: [UnsafeMutableRawPointer] = []
    /// How many idle easy handles are kept (each holds a few KiB).
    static let idleEasyLimit = 64

    /// Loads libcurl, once per process (CCurl's loader.c); nil when it is ready, else why it cannot be used. Before
    /// any other libcurl call.
    static func loadLibrary() -> String? {
        proxyctl_curl_load() == 0 ? nil : String(cString: proxyctl_curl_load_error())
    }

    init(loop: EventLoop) {
        self.loop = loop
        guard let multi = proxyctl_curl_multi_init() else { fatalError("curl_multi_init failed") }
        self.multi = multi
        share = proxyctl_curl_share_init()
        if let share {
            // Used on the loop thread only, so no lock callbacks are needed.
            _ = proxyctl_share_setopt_long(share, CURLSHOPT_SHARE, Int(CURL_LOCK_DATA_SSL_SESSION.rawValue))
            _ = proxyctl_share_setopt_long(share, CURLSHOPT_SHARE, Int(CURL_LOCK_DATA_DNS.rawValue))
        }
        // Keep idle connections for reuse. libcurl's default (4 × transfers in progress) closes them whenever
        // fewer requests are in flight, and every new one costs a TLS handshake.
        _ = proxyctl_multi_setopt_long(multi, CURLMOPT_MAXCONNECTS, 256)
        let context = Unmanaged.passUnretained(self).toOpaque()
        _ = proxyctl_multi_setopt_socket_cb(multi, curlSocketCallback)
        _ = proxyctl_multi_setopt_ptr(multi, CURLMOPT_SOCKETDATA, context)
        _ = proxyctl_multi_setopt_timer_cb(multi, curlTimerCallback)
        _ = proxyctl_multi_setopt_ptr(multi, CURLMOPT_TIMERDATA, context)
        timer = LoopTimer(loop: loop) { [unowned self] in
            insideCurl {
                var running: Int32 = 0
                proxyctl_curl_multi_socket_action(self.multi, -1, 0, &running)
            }
        }
    }

    deinit {
        for (easy, transfer) in transfers {
            proxyctl_curl_multi_remove_handle(multi, easy)
            transfer.finish(CURLE_ABORTED_BY_CALLBACK)
        }
        for easy in idleEasies { proxyctl_curl_easy_cleanup(easy) }
        proxyctl_curl_multi_cleanup(multi)
        if let share { proxyctl_curl_share_cleanup(share) }
    }

    /// An easy handle in its initial state (as `curl_easy_init` makes it), reused when one is idle.
    func takeEasy() -> UnsafeMutableRawPointer {
        if let easy = idleEasies.popLast() { return easy }
        guard let easy = proxyctl_curl_easy_init() else { fatalError("curl_easy_init failed") }
        return easy
    }

    /// Takes back the easy handle of a transfer that is no longer in the multi handle: its options go back to
    /// their defaults (`curl_easy_reset`; connections and TLS sessions stay in the multi and share handles).
    fileprivate func giveBack(_ easy: UnsafeMutableRawPointer) {
        guard idleEasies.count < Self.idleEasyLimit else {
            proxyctl_curl_easy_cleanup(easy)
            return
        }
        proxyctl_curl_easy_reset(easy)
        idleEasies.append(easy)
    }

    func add(_ transfer: CurlTransfer) {
        if depth > 0 {
            // From inside a callback: added once libcurl returned.
            additions.append(transfer)
            return
        }
        if let share { _ = proxyctl_easy_setopt_ptr(transfer.easy, CURLOPT_SHARE, share) }
        transfers[transfer.easy] = transfer
        let status = proxyctl_curl_multi_add_handle(multi, transfer.easy)
        if status != CURLM_OK {
            transfers.removeValue(forKey: transfer.easy)
            transfer.finish(CURLE_FAILED_INIT)
        }
    }

    /// Stops a transfer early; its completion is not called, nor any other callback of it that can fail it.
    /// Safe anywhere, a libcurl callback included.
    func cancel(_ transfer: CurlTransfer) {
        if let index = additions.firstIndex(where: { $0 === transfer }) {
            additions.remove(at: index)
            transfer.cancelled = true
            return
        }
        guard transfers.removeValue(forKey: transfer.easy) != nil else { return }
        transfer.cancelled = true
        if depth > 0 {
            removals.append(transfer)
        } else {
            proxyctl_curl_multi_remove_handle(multi, transfer.easy)
        }
    }

    /// Lets curl continue a paused transfer (after CURL_WRITEFUNC_PAUSE or CURL_READFUNC_PAUSE). Safe
    /// anywhere: inside libcurl it happens once the call returned.
    func resume(_ transfer: CurlTransfer) {
        guard transfers[transfer.easy] != nil else { return }
        if depth > 0 {
            resumes.append(transfer)
            return
        }
        insideCurl { _ = proxyctl_curl_easy_pause(transfer.easy, CURLPAUSE_CONT) }
    }

    /// Runs a call into libcurl; once the outermost one returned, the removals and resumes asked for inside
    /// it happen, and finished transfers are collected.
    private func insideCurl(_ call: () -> Void) {
        depth += 1
        call()
        depth -= 1
        guard depth == 0 else { return }
        while !removals.isEmpty || !resumes.isEmpty || !additions.isEmpty {
            for transfer in removals { proxyctl_curl_multi_remove_handle(multi, transfer.easy) }
            removals.removeAll()
            let added = additions
            additions.removeAll()
            for transfer in added where !transfer.cancelled { add(transfer) }
            let waiting = resumes
            resumes.removeAll()
            for transfer in waiting where transfers[transfer.easy] != nil {
                depth += 1
                _ = proxyctl_curl_easy_pause(transfer.easy, CURLPAUSE_CONT)
                depth -= 1
            }
        }
        collectFinished()
    }

    // CURLMOPT_SOCKETFUNCTION: watch `socket` for `what`; CURL_POLL_REMOVE stops watching.
    fileprivate func socketChanged(_ socket: curl_socket_t, what: Int32, watcher: UnsafeMutableRawPointer?) {
        if what == CURL_POLL_REMOVE {
            if let watcher {
                Unmanaged<SocketWatcher>.fromOpaque(watcher).release()
                proxyctl_curl_multi_assign(multi, socket, nil)
            }
            return
        }
        let events =
            Int16(EV_PERSIST) | (what & CURL_POLL_IN != 0 ? Int16(EV_READ) : 0)
            | (what & CURL_POLL_OUT != 0 ? Int16(EV_WRITE) : 0)
        if let watcher {
            Unmanaged<SocketWatcher>.fromOpaque(watcher).takeUnretainedValue().watch(events)
        } else {
            let fresh = SocketWatcher(multi: self, socket: socket)
            fresh.watch(events)
            proxyctl_curl_multi_assign(multi, socket, Unmanaged.passRetained(fresh).toOpaque())
        }
    }

    // CURLMOPT_TIMERFUNCTION: -1 deletes the timer; 0 means "as soon as possible" (never call curl from here).
    fileprivate func timerChanged(_ milliseconds: Int) {
        if milliseconds < 0 {
            timer?.cancel()
        } else {
            timer?.schedule(milliseconds: milliseconds)
        }
    }

    fileprivate func socketReady(_ socket: curl_socket_t, events: Int16) {
        var flags: Int32 = 0
        if Int32(events) & EV_READ != 0 { flags |= CURL_CSELECT_IN }
        if Int32(events) & EV_WRITE != 0 { flags |= CURL_CSELECT_OUT }
        insideCurl {
            var running: Int32 = 0
            proxyctl_curl_multi_socket_action(multi, socket, flags, &running)
        }
    }

    /// Completions run outside libcurl: a completion may start or cancel transfers.
    private func collectFinished() {
        var remaining: Int32 = 0
        while let message = proxyctl_curl_multi_info_read(multi, &remaining) {
            guard message.pointee.msg == CURLMSG_DONE, let easy = message.pointee.easy_handle else { continue }
            let result = message.pointee.data.result
            proxyctl_curl_multi_remove_handle(multi, easy)
            if let transfer = transfers.removeValue(forKey: easy) {
                transfer.finish(result)
            }
        }
    }
}

/// One libevent event for a socket curl asked us to watch.
private final class SocketWatcher {
    unowned let multi: CurlMulti
    let socket: curl_socket_t
    private var event: OpaquePointer?
    /// Kept so that the event base outlives the event (see `LoopTimer`).
    private let loop: EventLoop

    init(multi: CurlMulti, socket: curl_socket_t) {
        self.multi = multi
        self.socket = socket
        self.loop = multi.loop
    }

    deinit { if let event { event_free(event) } }

    func watch(_ events: Int16) {
        if let event { event_free(event) }
        event = event_new(
            loop.base, socket, events,
            { fd, what, context in
                let watcher = Unmanaged<SocketWatcher>.fromOpaque(context!).takeUnretainedValue()
                watcher.multi.socketReady(fd, events: what)
            }, Unmanaged.passUnretained(self).toOpaque())
        event_add(event, nil)
    }
}

private let curlSocketCallback:
    @convention(c) (UnsafeMutableRawPointer?, curl_socket_t, Int32, UnsafeMutableRawPointer?, UnsafeMutableRawPointer?)
        -> Int32 = {
            _, socket, what, context, watcher in
            Unmanaged<CurlMulti>.fromOpaque(context!).takeUnretainedValue().socketChanged(
                socket, what: what, watcher: watcher)
            return 0
        }

private let curlTimerCallback: @convention(c) (UnsafeMutableRawPointer?, Int, UnsafeMutableRawPointer?) -> Int32 = {
    _, milliseconds, context in
    Unmanaged<CurlMulti>.fromOpaque(context!).takeUnretainedValue().timerChanged(milliseconds)
    return 0
}

/// One easy handle and what happens to its bytes. Subclasses decide where the response goes.
class CurlTransfer {
    let easy: UnsafeMutableRawPointer
    /// Cancelled by its owner: every later callback fails it, and it is no longer listened to.
    fileprivate(set) var cancelled = false
    private var headerList: UnsafeMutablePointer<curl_slist>? = nil
    private var resolveList: UnsafeMutablePointer<curl_slist>? = nil
    let errorBuffer = UnsafeMutablePointer<CChar>.allocate(capacity: Int(CURL_ERROR_SIZE))

    /// Where the easy handle came from and goes back to (none: made for this transfer alone).
    private weak var pool: CurlMulti?

    /// - Parameter pool: the multi handle the transfer will run on, to reuse one of its idle easy handles.
    init(pool: CurlMulti? = nil) {
        self.pool = pool
        if let pool {
            easy = pool.takeEasy()
        } else {
            guard let easy = proxyctl_curl_easy_init() else { fatalError("curl_easy_init failed") }
            self.easy = easy
        }
        errorBuffer.initialize(repeating: 0, count: Int(CURL_ERROR_SIZE))
        let context = Unmanaged.passUnretained(self).toOpaque()
        _ = proxyctl_easy_setopt_ptr(easy, CURLOPT_ERRORBUFFER, errorBuffer)
        _ = proxyctl_easy_setopt_long(easy, CURLOPT_NOSIGNAL, 1)
        _ = proxyctl_easy_setopt_string(easy, CURLOPT_PROTOCOLS_STR, "http,https")
        _ = proxyctl_easy_setopt_string(easy, CURLOPT_USERAGENT, "proxyctl")
        _ = proxyctl_easy_setopt_header_cb(easy, curlHeaderCallback)
        _ = proxyctl_easy_setopt_ptr(easy, CURLOPT_HEADERDATA, context)
        _ = proxyctl_easy_setopt_write_cb(easy, curlWriteCallback)
        _ = proxyctl_easy_setopt_ptr(easy, CURLOPT_WRITEDATA, context)
    }

    deinit {
        // Never in the multi handle by now: `CurlMulti` holds every transfer it has added until it removed it.
        if let pool { pool.giveBack(easy) } else { proxyctl_curl_easy_cleanup(easy) }
        if let headerList { proxyctl_curl_slist_free_all(headerList) }
        if let resolveList { proxyctl_curl_slist_free_all(resolveList) }
        errorBuffer.deallocate()
    }

    func setURL(_ url: String) { _ = proxyctl_easy_setopt_string(easy, CURLOPT_URL, url) }

    /// Field lines to send; a value is bytes (obs-text need not be UTF-8). An empty value makes curl leave out
    /// a field it would add itself.
    func setHeaders(_ groups: [(name: String, value: [UInt8])]...) {
        if let headerList { proxyctl_curl_slist_free_all(headerList) }
        headerList = nil
        var line: [UInt8] = []
        line.reserveCapacity(256)
        for headers in groups {
            appendHeaders(headers, &line)
        }
        _ = proxyctl_easy_setopt_ptr(easy, CURLOPT_HTTPHEADER, headerList)
    }

    private func appendHeaders(_ headers: [(name: String, value: [UInt8])], _ line: inout [UInt8]) {
        for (name, value) in headers {
            line.removeAll(keepingCapacity: true)
            var name = name
            name.withUTF8 { line.append(contentsOf: $0) }
            line.append(UInt8(ascii: ":"))
            line.append(UInt8(ascii: " "))
            line.append(contentsOf: value)
            line.append(0)
            headerList = line.withUnsafeBufferPointer { buffer in
                buffer.withMemoryRebound(to: CChar.self) { proxyctl_curl_slist_append(headerList, $0.baseAddress) }
            }
        }
    }

    /// CURLOPT_RESOLVE: "host:port:address" entries that bypass DNS.
    func setResolve(_ entries: [String]) {
        if let resolveList { proxyctl_curl_slist_free_all(resolveList) }
        resolveList = nil
        for entry in entries { resolveList = proxyctl_curl_slist_append(resolveList, entry) }
        _ = proxyctl_easy_setopt_ptr(easy, CURLOPT_RESOLVE, resolveList)
    }

    func setMethod(_ method: String, body: [UInt8]) {
        let requestBody = body
        switch method {
        case "GET":
            _ = proxyctl_easy_setopt_long(easy, CURLOPT_HTTPGET, 1)
        case "HEAD":
            _ = proxyctl_easy_setopt_long(easy, CURLOPT_NOBODY, 1)
        default:
            _ = proxyctl_easy_setopt_long(easy, CURLOPT_POST, 1)
            _ = proxyctl_easy_setopt_off(easy, CURLOPT_POSTFIELDSIZE_LARGE, curl_off_t(body.count))
            if body.isEmpty {
                // NULL post fields would make curl read the body from stdin.
                _ = proxyctl_easy_setopt_string(easy, CURLOPT_COPYPOSTFIELDS, "")
            } else {
                // COPYPOSTFIELDS copies at once: the pointer only has to live for the call.
                requestBody.withUnsafeBytes { raw in
                    _ = proxyctl_easy_setopt_ptr(
                        easy, CURLOPT_COPYPOSTFIELDS, UnsafeMutableRawPointer(mutating: raw.baseAddress))
                }
            }
            if method != "POST" { _ = proxyctl_easy_setopt_string(easy, CURLOPT_CUSTOMREQUEST, method) }
        }
    }

    /// The libcurl error text for the last failure (the error buffer, else the code's description).
    func errorText(_ code: CURLcode) -> String {
        let text = String(cString: errorBuffer)
        return text.isEmpty ? String(cString: proxyctl_curl_easy_strerror(code)) : text
    }

    // Overridden by subclasses.
    func header(_ line: UnsafeRawBufferPointer) -> Bool { true }
    func body(_ data: UnsafeRawBufferPointer) -> Int { data.count }
    func finish(_ code: CURLcode) {}
}

// CURLOPT_HEADERFUNCTION: one header line (with its CRLF) per call; returning less than size aborts.
private let curlHeaderCallback:
    @convention(c) (UnsafeMutablePointer<CChar>?, Int, Int, UnsafeMutableRawPointer?) -> Int = {
        data, size, count, context in
        let transfer = Unmanaged<CurlTransfer>.fromOpaque(context!).takeUnretainedValue()
        if transfer.cancelled { return 0 }
        let ok = transfer.header(UnsafeRawBufferPointer(start: data, count: size * count))
        return ok && !transfer.cancelled ? size * count : 0
    }

// CURLOPT_WRITEFUNCTION: body bytes; returning CURL_WRITEFUNC_PAUSE pauses the transfer.
private let curlWriteCallback:
    @convention(c) (UnsafeMutablePointer<CChar>?, Int, Int, UnsafeMutableRawPointer?) -> Int = {
        data, size, count, context in
        let transfer = Unmanaged<CurlTransfer>.fromOpaque(context!).takeUnretainedValue()
        // A count other than the size given fails the transfer (CURLE_WRITE_ERROR).
        if transfer.cancelled { return 0 }
        return transfer.body(UnsafeRawBufferPointer(start: data, count: size * count))
    }

/// A transfer whose whole response is kept in memory (provider endpoints: small JSON answers).
final class BufferedTransfer: CurlTransfer {
    private var status = 0
    private var headers: [(name: String, value: String)] = []
    private var data: [UInt8] = []
    private let limit: Int
    private var tooLarge = false
    /// An answer larger than `limit` still completes, with its head and the first `limit` bytes of its body.
    private let keepsHeadWhenTooLarge: Bool
    private let completion: (Result<HTTPResponseData, TransportErrorData>) -> Void
    private let target: String

    struct HTTPResponseData {
        let status: Int
        let headers: [(name: String, value: String)]
        let body: [UInt8]
    }

    enum TransportErrorData: Error {
        case unreachable(String)
        case timeout(String)
        case certificate(String)
        /// The request went out and no complete answer came back.
        case noAnswer(String)
    }

    init(
        target: String, limit: Int = 1 << 20, keepsHeadWhenTooLarge: Bool = false,
        completion: @escaping (Result<HTTPResponseData, TransportErrorData>) -> Void
    ) {
        self.limit = limit
        self.keepsHeadWhenTooLarge = keepsHeadWhenTooLarge
        self.completion = completion
        self.target = target
        super.init()
    }

    override func header(_ line: UnsafeRawBufferPointer) -> Bool {
        // "\r\n" is one Character in Swift: trim the bytes, not the string.
        var end = line.count
        while end > 0 && (line[end - 1] == 0x0A || line[end - 1] == 0x0D) { end -= 1 }
        let text = String(decoding: UnsafeRawBufferPointer(rebasing: line[0..<end]), as: UTF8.self)
        if text.hasPrefix("HTTP/") {
            // A new status line (after 100 Continue, say): start over.
            let parts = text.split(separator: " ", maxSplits: 2)
            status = parts.count > 1 ? Int(parts[1]) ?? 0 : 0
            headers.removeAll()
            return true
        }
        if let colon = text.firstIndex(of: ":") {
            let name = String(text[..<colon])
            let value = text[text.index(after: colon)...].trimmingOWS()
            headers.append((name, value))
        }
        return true
    }

    override func body(_ bytes: UnsafeRawBufferPointer) -> Int {
        if data.count + bytes.count > limit {
            tooLarge = true
            return 0
        }
        data.append(contentsOf: bytes)
        return bytes.count
    }

    override func finish(_ code: CURLcode) {
        if code == CURLE_OK || (code == CURLE_WRITE_ERROR && tooLarge && keepsHeadWhenTooLarge) {
            completion(.success(HTTPResponseData(status: status, headers: headers, body: data)))
            return
        }
        let detail = errorText(code)
        // CURLINFO_PRETRANSFER_TIME_T: set once the connection (and its TLS, and any proxy tunnel) was up and
        // the request was about to go out. Past that point the server may have acted on the request even
        // though no answer arrived; before it, nothing reached the server.
        var pretransfer: curl_off_t = 0
        _ = proxyctl_easy_getinfo_off(easy, CURLINFO_PRETRANSFER_TIME_T, &pretransfer)
        let failure = UpstreamFailure(code)
        if pretransfer > 0 && failure != .certificate {
            let what = tooLarge ? "the answer is larger than \(limit) bytes" : detail
            return completion(.failure(.noAnswer("\(target): \(what) after the request was sent")))
        }
        if code == CURLE_WRITE_ERROR && tooLarge {
            return completion(.failure(.unreachable("\(target): the answer is larger than \(limit) bytes")))
        }
        switch failure {
        case .timeout: completion(.failure(.timeout("\(target): \(detail)")))
        case .certificate: completion(.failure(.certificate("\(target): \(detail)")))
        default: completion(.failure(.unreachable("\(target): \(detail)")))
        }
    }
}

extension UpstreamFailure {
    /// What a libcurl error code means to the provider client.
    init(_ code: CURLcode) {
        switch code {
        case CURLE_COULDNT_RESOLVE_HOST: self = .dns
        case CURLE_COULDNT_CONNECT: self = .connect
        case CURLE_OPERATION_TIMEDOUT: self = .timeout
        case CURLE_PEER_FAILED_VERIFICATION, CURLE_SSL_CACERT_BADFILE, CURLE_SSL_CERTPROBLEM: self = .certificate
        case CURLE_SSL_CONNECT_ERROR: self = .tls
        case CURLE_GOT_NOTHING, CURLE_RECV_ERROR, CURLE_SEND_ERROR, CURLE_PARTIAL_FILE, CURLE_HTTP2,
            CURLE_HTTP2_STREAM:
            self = .incomplete
        case CURLE_COULDNT_RESOLVE_PROXY, CURLE_PROXY: self = .proxy
        case CURLE_WEIRD_SERVER_REPLY: self = .protocolError
        // libcurl refuses a response head above its limit (CURL_MAX_HTTP_HEADER) as out of memory.
        case CURLE_OUT_OF_MEMORY: self = .headTooLarge
        default: self = .other
        }
    }
}
