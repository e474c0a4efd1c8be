import CCurl
import Dispatch
import ProxyCore
import ProxyOAuth

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

/// `HTTPTransport` for provider endpoints, on libcurl's multi interface in a loop.
///
/// Requests go through the configured upstream proxy unless the host is in `no_upstream_proxy`. TLS is
/// verified against the system roots or the request's `caFile`; redirects are not followed.
public final class CurlTransport: HTTPTransport {
    private let loop: EventLoop
    /// The multi handle, made at the first request: libcurl is loaded then, not when a command starts.
    private let multi: LoopBound<LazyMulti>
    private let upstreamProxy: UpstreamProxy?
    private let bypass: BypassList
    private let resolve: [String: String]

    /// Must be created on `loop`'s thread (or before the loop runs).
    public init(loop: EventLoop, upstreamProxy: UpstreamProxy?, bypass: BypassList, resolve: [String: String] = [:]) {
        self.loop = loop
        self.multi = LoopBound(LazyMulti(), loop: loop)
        self.upstreamProxy = upstreamProxy
        self.bypass = bypass
        self.resolve = resolve
    }

    public func send(_ request: HTTPRequest) async throws -> HTTPResponse {
        let proxy = proxyURL(for: request.url)
        let target = Self.describe(request.url)
        return try await withCheckedThrowingContinuation { continuation in
            loop.post { [loop, multi, resolve] in
                guard let pool = multi.value.pool(loop) else {
                    let failure = CurlMulti.loadLibrary() ?? "libcurl cannot be used"
                    continuation.resume(throwing: TransportError.unreachable("\(target): \(failure)"))
                    return
                }
                let transfer = BufferedTransfer(
                    target: target, limit: request.limit, keepsHeadWhenTooLarge: request.keepsHeadWhenTooLarge
                ) { result in
                    switch result {
                    case .success(let data):
                        continuation.resume(
                            returning: HTTPResponse(status: data.status, headers: data.headers, body: data.body))
                    case .failure(.timeout(let reason)):
                        continuation.resume(throwing: TransportError.timeout(reason))
                    case .failure(.certificate(let reason)):
                        continuation.resume(throwing: TransportError.certificate(reason))
                    case .failure(.unreachable(let reason)):
                        continuation.resume(throwing: TransportError.unreachable(reason))
                    case .failure(.noAnswer(let reason)):
                        continuation.resume(throwing: TransportError.noAnswer(reason))
                    }
                }
                transfer.setURL(request.url)
                transfer.setHeaders(request.headers.map { ($0.name, Array($0.value.utf8)) } + [("Expect", [])])
                transfer.setMethod(request.method, body: request.body)
                _ = proxyctl_easy_setopt_long(transfer.easy, CURLOPT_TIMEOUT_MS, request.timeout)
                _ = proxyctl_easy_setopt_long(transfer.easy, CURLOPT_CONNECTTIMEOUT_MS, min(request.timeout, 10_000))
                if let caFile = request.caFile {
                    _ = proxyctl_easy_setopt_string(transfer.easy, CURLOPT_CAINFO, caFile)
                }
                if let url = try? AbsoluteURL.parse(request.url).get(), let fixed = resolve[url.authority.host] {
                    transfer.setResolve(["\(url.authority.host):\(url.authority.port):\(fixed)"])
                }
                if let proxy {
                    _ = proxyctl_easy_setopt_string(transfer.easy, CURLOPT_PROXY, proxy.url)
                    if let credentials = proxy.credentials {
                        _ = proxyctl_easy_setopt_string(transfer.easy, CURLOPT_PROXYUSERPWD, credentials)
                    }
                } else {
                    // Never pick up HTTPS_PROXY from the environment: that may be this very proxy.
                    _ = proxyctl_easy_setopt_string(transfer.easy, CURLOPT_PROXY, "")
                }
                pool.add(transfer)
            }
        }
    }

    /// `CurlTransport`'s multi handle once libcurl is loaded. Loop thread only.
    private final class LazyMulti {
        private var made: CurlMulti?

        func pool(_ loop: EventLoop) -> CurlMulti? {
            if let made { return made }
            guard CurlMulti.loadLibrary() == nil else { return nil }
            made = CurlMulti(loop: loop)
            return made
        }
    }

    private func proxyURL(for url: String) -> (url: String, credentials: String?)? {
        guard let upstreamProxy, case .success(let parsed) = AbsoluteURL.parse(url), !bypass.matches(parsed.authority)
        else { return nil }
        let credentials = upstreamProxy.username.map { user in
            "\(FormEncoding.percentEncode(user)):\(FormEncoding.percentEncode(upstreamProxy.password ?? ""))"
        }
        return ("http://\(upstreamProxy.address)", credentials)
    }

    /// The URL without its query, for error messages.
    static func describe(_ url: String) -> String {
        TargetText.withoutQuery(url)
    }
}

/// A loop running on a thread of its own, for commands that need I/O (login, token, logout).
public final class LoopThread: Sendable {
    public let loop: EventLoop
    private let keepAlive: LoopBound<LoopTimer>
    /// Signalled when the thread has left the loop.
    private let finished = DispatchSemaphore(value: 0)

    public init() {
        EventLoop.initializeLibraries()
        let loop = EventLoop()
        self.loop = loop
        // A repeating timer keeps event_base_loop from returning while idle.
        let timer = LoopTimer(loop: loop) {}
        timer.schedule(milliseconds: 86_400_000)
        keepAlive = LoopBound(timer, loop: loop)
        let finished = self.finished
        Platform.startThread(name: "proxyctl-loop") {
            loop.run()
            finished.signal()
        }
    }

    /// Ends the loop and waits (up to 5 s) until its thread has left it. A command that returned while the
    /// loop still ran would exit the process under it: exit-time cleanup (OpenSSL's atexit handler) racing
    /// with libcurl on the loop thread could hang `proxyctl token`. Not for the loop thread itself.
    public func stop() {
        loop.post { [loop] in loop.stop() }
        _ = finished.wait(timeout: .now() + .seconds(5))
    }
}
