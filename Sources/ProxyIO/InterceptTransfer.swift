import CCurl
import Foundation
import ProxyCore

/// Who receives an intercept transfer's callbacks (the client connection's driver).
protocol TransferOwner: AnyObject {
    /// CURLOPT_HEADERFUNCTION's lines: a response head (or trailers) up to its blank line, terminators
    /// included, in one call (at most `InterceptTransfer.headBatchLimit` bytes at a time).
    func transferHeader(_ transfer: any UpstreamTransfer, _ lines: UnsafeRawBufferPointer)
    /// The proxy's own client's response head, parsed once (`OriginExchange`): in place of its lines.
    func transferResponseHead(_ transfer: any UpstreamTransfer, _ received: ReceivedHead)
    /// CURLOPT_WRITEFUNCTION: body bytes; returns the count taken, or CURL_WRITEFUNC_PAUSE.
    func transferBody(_ transfer: any UpstreamTransfer, _ data: UnsafeRawBufferPointer) -> Int
    /// CURLOPT_READFUNCTION: request body bytes; 0 at the end, or CURL_READFUNC_PAUSE.
    func transferRead(_ transfer: any UpstreamTransfer, _ buffer: UnsafeMutableRawBufferPointer) -> Int
    /// CURLOPT_SEEKFUNCTION: rewind the request body (libcurl resends it on a new HTTP/2 stream, say).
    func transferSeek(_ transfer: any UpstreamTransfer, _ offset: Int) -> Bool
    /// The trailer fields to send after a request body of unknown length (the client's own, or none).
    func transferTrailers(_ transfer: any UpstreamTransfer) -> [H2Field]
    func transferFinished(_ transfer: any UpstreamTransfer, _ failure: UpstreamFailure?, detail: String)
}

/// The libcurl transfer of one request to a protected origin: an `UpstreamRequest` (decided by
/// `ProtectedExchange`) mapped onto easy-handle options, its callbacks passed to the owner.
final class InterceptTransfer: CurlTransfer, UpstreamTransfer {
    unowned let owner: any TransferOwner
    private unowned let multi: CurlMulti
    /// Bytes of the request body handed to libcurl so far (the read callback's position).
    var uploadOffset = 0
    /// The response is paused because the client is slow.
    var paused = false
    /// The owner's name for the transfer (an HTTP/2 stream's id).
    var tag: Int32 = 0
    /// Trailer fields to send after a streamed request body (the client's own trailers).
    private var trailerSource: (() -> [H2Field])?
    /// The lines of the head being received: libcurl gives one line per call, the owner gets them at the
    /// head's blank line in one (an event per line was a measurable part of a small request's cost).
    private var headLines: [UInt8] = []
    /// Lines are handed over before they take more than this (the owner's head limits apply as they come).
    static let headBatchLimit = 16 * 1024

    /// - Parameter authorization: the `Authorization` (and `DPoP`) fields for the request's credential.
    init(
        owner: any TransferOwner, request: UpstreamRequest, authorization: [(name: String, value: [UInt8])],
        body: RequestBody, pool: CurlMulti
    ) {
        self.owner = owner
        self.multi = pool
        super.init(pool: pool)
        setURL(request.url)
        // libcurl adds fields of its own unless told not to: keep the request as the client made it.
        var suppressed: [(name: String, value: [UInt8])] = [("Expect", [])]
        if !request.fields.contains(where: { ASCII.equalsLowercase($0.name.utf8, "accept") }) {
            suppressed.append(("Accept", []))
        }
        let hasBody = request.body != .none
        if hasBody && !request.fields.contains(where: { ASCII.equalsLowercase($0.name.utf8, "content-type") }) {
            suppressed.append(("Content-Type", []))
        }
        setHeaders(request.fields, authorization, suppressed)
        // The target reaches the origin byte for byte: no dot-segment removal.
        _ = proxyctl_easy_setopt_long(easy, CURLOPT_PATH_AS_IS, 1)
        if let target = request.requestTarget {
            _ = proxyctl_easy_setopt_string(easy, CURLOPT_REQUEST_TARGET, target)
        }
        switch request.method {
        case "GET" where !hasBody:
            _ = proxyctl_easy_setopt_long(easy, CURLOPT_HTTPGET, 1)
        case "HEAD" where !hasBody:
            _ = proxyctl_easy_setopt_long(easy, CURLOPT_NOBODY, 1)
        default:
            if hasBody {
                _ = proxyctl_easy_setopt_long(easy, CURLOPT_POST, 1)
                let size: curl_off_t
                if case .length(let length) = request.body { size = curl_off_t(length) } else { size = -1 }
                _ = proxyctl_easy_setopt_off(easy, CURLOPT_POSTFIELDSIZE_LARGE, size)
                let context = Unmanaged.passUnretained(self).toOpaque()
                _ = proxyctl_easy_setopt_read_cb(easy, transferReadCallback)
                _ = proxyctl_easy_setopt_ptr(easy, CURLOPT_READDATA, context)
                _ = proxyctl_easy_setopt_seek_cb(easy, transferSeekCallback)
                _ = proxyctl_easy_setopt_ptr(easy, CURLOPT_SEEKDATA, context)
            }
            if request.method != "POST" || !hasBody {
                _ = proxyctl_easy_setopt_string(easy, CURLOPT_CUSTOMREQUEST, request.method)
            }
        }
        _ = proxyctl_easy_setopt_long(
            easy, CURLOPT_HTTP_VERSION,
            request.http2 && Self.http2Works ? CURL_HTTP_VERSION_2TLS : CURL_HTTP_VERSION_1_1)
        _ = proxyctl_easy_setopt_long(easy, CURLOPT_PIPEWAIT, 1)
        if !request.mayResend {
            // libcurl sends a request again by itself when a reused connection ends before a byte of the answer
            // (Curl_retry_request: the body rewound, up to five times), whatever the method. A request that may
            // not reach the origin twice (RetryPolicy) never goes on a reused connection: on a new one that
            // ends unanswered it fails, and the client gets a 502.
            _ = proxyctl_easy_setopt_long(easy, CURLOPT_FRESH_CONNECT, 1)
        }
        _ = proxyctl_easy_setopt_long(easy, CURLOPT_BUFFERSIZE, 256 * 1024)
        _ = proxyctl_easy_setopt_long(easy, CURLOPT_CONNECTTIMEOUT_MS, request.connectTimeout)
        // The transfer ends when no byte moved for idle_timeout.
        _ = proxyctl_easy_setopt_long(easy, CURLOPT_LOW_SPEED_LIMIT, 1)
        _ = proxyctl_easy_setopt_long(easy, CURLOPT_LOW_SPEED_TIME, max(1, request.idleTimeout / 1000))
        if let caFile = request.caFile { _ = proxyctl_easy_setopt_string(easy, CURLOPT_CAINFO, caFile) }
        if let resolve = request.resolve { setResolve([resolve]) }
        if let proxy = request.upstreamProxy {
            _ = proxyctl_easy_setopt_string(easy, CURLOPT_PROXY, "http://\(proxy.address)")
            if let user = proxy.username {
                _ = proxyctl_easy_setopt_string(easy, CURLOPT_PROXYUSERNAME, user)
                _ = proxyctl_easy_setopt_string(easy, CURLOPT_PROXYPASSWORD, proxy.password ?? "")
            }
        } else {
            // Never pick up HTTPS_PROXY from the environment: that may be this very proxy.
            _ = proxyctl_easy_setopt_string(easy, CURLOPT_PROXY, "")
        }
    }

    func start() { multi.add(self) }
    func resume() { multi.resume(self) }
    func cancel() { multi.cancel(self) }

    /// Whether libcurl's HTTP/2 client can be used for origins: curl 7.x's loses a response head when a small
    /// response arrives whole on a reused connection while the request is still being sent (curl 8 rewrote
    /// it). With an older libcurl, origins are spoken to in HTTP/1.1 (gRPC origins then refuse).
    static let http2Works: Bool = proxyctl_curl_version_info().pointee.version_num >= 0x08_00_00

    /// What the start-up log says when `http2Works` is false.
    static var http2Warning: String? {
        guard !http2Works, let version = proxyctl_curl_version_info().pointee.version else { return nil }
        return
            "libcurl \(String(cString: version)) is older than 8: protected origins are spoken to in HTTP/1.1 (gRPC origins need HTTP/2); install libcurl 8 (Debian 12: bookworm-backports, see scripts/bootstrap)"
    }

    /// Sends `source()`'s fields as trailers after a body of unknown length (chunked upstream; libcurl
    /// asks just before the last chunk).
    func sendTrailers(_ source: @escaping () -> [H2Field]) {
        trailerSource = source
        _ = proxyctl_easy_setopt_trailer_cb(easy, transferTrailerCallback)
        _ = proxyctl_easy_setopt_ptr(easy, CURLOPT_TRAILERDATA, Unmanaged.passUnretained(self).toOpaque())
    }

    fileprivate func trailerLines() -> [String] {
        (trailerSource?() ?? []).map { "\($0.nameText): \($0.valueText)" }
    }

    override func header(_ line: UnsafeRawBufferPointer) -> Bool {
        headLines.append(contentsOf: line)
        let blank = line.count <= 2 && (line.first == UInt8(ascii: "\r") || line.first == UInt8(ascii: "\n"))
        if blank || headLines.count >= Self.headBatchLimit { flushHead() }
        return true
    }

    /// Hands the lines collected so far to the owner (which may cancel the transfer meanwhile).
    private func flushHead() {
        guard !headLines.isEmpty else { return }
        headLines.withUnsafeBytes { owner.transferHeader(self, $0) }
        headLines.removeAll(keepingCapacity: true)
    }

    override func body(_ data: UnsafeRawBufferPointer) -> Int {
        if !headLines.isEmpty {
            flushHead()
            if cancelled { return 0 }
        }
        return owner.transferBody(self, data)
    }

    override func finish(_ code: CURLcode) {
        flushHead()
        if code == CURLE_OK {
            owner.transferFinished(self, nil, detail: "")
        } else {
            owner.transferFinished(self, UpstreamFailure(code), detail: errorText(code))
        }
    }
}

extension UpstreamFailure {
    /// What a libcurl error code means to the proxy: the one table for the intercept path and the
    /// provider client.
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

// CURLOPT_READFUNCTION: fill the buffer with request body bytes; CURL_READFUNC_PAUSE when none are there yet.
private let transferReadCallback:
    @convention(c) (UnsafeMutablePointer<CChar>?, Int, Int, UnsafeMutableRawPointer?) -> Int = {
        buffer, size, count, context in
        let transfer = Unmanaged<InterceptTransfer>.fromOpaque(context!).takeUnretainedValue()
        if transfer.cancelled { return proxyctl_readfunc_abort() }
        return transfer.owner.transferRead(transfer, UnsafeMutableRawBufferPointer(start: buffer, count: size * count))
    }

// CURLOPT_SEEKFUNCTION: 0 = done, 2 = cannot seek (the body streamed and is gone).
private let transferSeekCallback: @convention(c) (UnsafeMutableRawPointer?, curl_off_t, Int32) -> Int32 = {
    context, offset, origin in
    let transfer = Unmanaged<InterceptTransfer>.fromOpaque(context!).takeUnretainedValue()
    guard origin == SEEK_SET else { return 2 }
    return !transfer.cancelled && transfer.owner.transferSeek(transfer, Int(offset)) ? 0 : 2
}

// CURLOPT_TRAILERFUNCTION: the trailer fields, as a list libcurl frees. 0 = CURL_TRAILERFUNC_OK.
private let transferTrailerCallback:
    @convention(c) (UnsafeMutablePointer<UnsafeMutablePointer<curl_slist>?>?, UnsafeMutableRawPointer?) -> Int32 = {
        list, context in
        let transfer = Unmanaged<InterceptTransfer>.fromOpaque(context!).takeUnretainedValue()
        if transfer.cancelled { return 1 }
        for line in transfer.trailerLines() { list?.pointee = curl_slist_append(list?.pointee, line) }
        return 0
    }
