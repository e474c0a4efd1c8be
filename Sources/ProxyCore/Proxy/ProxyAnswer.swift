/// Every answer the proxy gives itself, in one catalogue: the status, the `Proxy-Status` error type and
/// details (RFC 9209), and the one-line message naming the fix. Nothing else in the code base makes a
/// `ProxyResponse`; a state machine decides which case applies, `response` says what it looks like.
public enum ProxyAnswer: Sendable, Equatable {
    // MARK: The request itself

    /// A request head (or body framing) that cannot be read: 400, 414, 431 or 505 from the parse error.
    case badRequest(HTTPParseError)
    /// The request head did not arrive within header_timeout of its first byte (or of the accept).
    case requestHeadTimeout(milliseconds: Int)
    /// `proxy_auth_file` is set and the request has no or wrong credentials. `close` when the body, if any,
    /// was not read.
    case proxyAuthenticationRequired(credentialsSent: Bool, close: Bool)
    /// An origin-form request (`GET /`): a client that took the proxy for a web server.
    case notProxyRequest(listen: String, close: Bool)
    /// `GET https://…` in a plain request instead of CONNECT.
    case httpsURLInPlainRequest(close: Bool)
    /// The target is this proxy's own listener.
    case loopDetected(HostPort)
    /// A local user other than the proxy's (or one the proxy cannot identify) asked for what the settings keep
    /// for the proxy's own user: a protected origin (`protected: true`, its tokens) or passthrough.
    case notForThisUser(PeerIdentity, protected: Bool)
    /// Like `notForThisUser`, where the system cannot tell a client's user (docs/porting.md) and the owner
    /// credential stands in: the request did not carry it (`credentialSent` false) or carried another. `close`
    /// when the body, if any, was not read.
    case ownerCredentialRequired(credentialSent: Bool, protected: Bool, close: Bool)
    /// `max_connections` connections are open: a new one is turned away at once.
    case overCapacity(limit: Int)
    /// `max_connections_per_client` connections from this address are open.
    case tooManyFromClient(limit: Int)

    // MARK: Reaching the next hop

    case dnsTimeout(HostPort, milliseconds: Int, viaProxy: Bool)
    case dnsError(HostPort, reason: String, viaProxy: Bool)
    case connectTimeout(HostPort, milliseconds: Int, viaProxy: Bool)
    case connectRefused(HostPort, viaProxy: Bool)
    case connectFailed(HostPort, reason: String, viaProxy: Bool)
    /// The upstream proxy closed the connection before answering our CONNECT.
    case upstreamProxyClosed(HostPort)
    /// The upstream proxy did not answer our CONNECT within connect_timeout.
    case upstreamProxyTimeout(HostPort)
    /// The upstream proxy's answer to CONNECT could not be read.
    case upstreamProxyMalformedAnswer(HostPort)
    /// The upstream proxy answered 407: our configuration lacks (or has wrong) credentials.
    case upstreamProxyCredentials(HostPort, credentialsConfigured: Bool)
    /// The upstream proxy refused the CONNECT with another status.
    case upstreamProxyRefused(HostPort, status: Int)

    // MARK: The next hop's response

    /// The connection closed (or was reset) before a complete response head arrived.
    case responseIncomplete(HostPort)
    /// No response within idle_timeout.
    case responseTimeout(HostPort, milliseconds: Int)
    /// A response head that breaks HTTP/1.1's rules (framing, syntax).
    case invalidResponse(HostPort, reason: String)
    /// A response head larger than the proxy reads.
    case responseHeadTooLarge(HostPort)
    /// A transfer to a protected origin that failed before its response head; `origin` names the section whose
    /// `ca_file` decides whether its certificate verifies.
    case upstreamFailed(UpstreamFailure, hop: HostPort, detail: String, origin: OriginTrust? = nil)

    // MARK: Protected origins

    /// A protected https origin, but no local CA to terminate TLS with.
    case noLocalCA(origin: String)
    /// The TLS server context for the origin could not be made.
    case tlsSetupFailed(origin: String, reason: String)
    /// Host, the absolute-form target or the SNI names another authority than the tunnel's: no token sent.
    case misdirected(reason: String)
    /// Something the proxy does not do on intercepted connections (CONNECT inside the tunnel, say).
    case unsupported(reason: String)
    /// A web page of another origin made the request (cross-site request forgery with the user's token):
    /// `browser_requests = refuse`. `close` when the body, if any, was not read.
    case browserRequestRefused(BrowserRefusal, close: Bool)
    /// A placeholder of another origin, or the client's own credential where `client_credential = refuse`: 403,
    /// nothing sent upstream. `close` when the body, if any, was not read.
    case credentialRefused(reason: String, close: Bool)
    /// No tokens, or the provider refused the refresh token: the user must sign in.
    case signInNeeded(provider: String, reason: String)
    /// The provider is unreachable or overloaded.
    case providerUnavailable(origin: String, reason: String, retryAfter: Int)
    /// A refresh is out at the provider and its answer has not come yet: the refresh token is not sent again.
    case refreshPending(origin: String, reason: String, retryAfter: Int)
    /// Tokens cannot be kept in the state directory (a full disk, a quota, permissions).
    case tokenStorageFailed(origin: String, reason: String)
    /// proxy.conf or the provider's registration is wrong.
    case providerMisconfigured(origin: String, provider: String, reason: String)
    /// Tokens are DPoP-bound but the key they are bound to is not there.
    case dpopKeyMissing(provider: String)
    /// The DPoP proof could not be signed.
    case dpopProofFailed(reason: String)
    /// The request body could not be kept for replay (the spool file could not be written).
    case bodyNotKept(directory: String)

    /// The response: status, `Proxy-Status`, extra fields, one-line body, and whether the connection closes.
    public var response: ProxyResponse {
        switch self {
        case .badRequest(let error):
            return ProxyResponse(
                status: error.status, proxyStatus: ProxyStatus(error: .httpRequestError, details: error.reason),
                message: "proxyctl: bad request: \(error.reason)", close: true)
        case .requestHeadTimeout(let milliseconds):
            return ProxyResponse(
                status: 408, proxyStatus: ProxyStatus(error: .httpRequestError, details: "request head incomplete"),
                message:
                    "proxyctl: the request head did not arrive within \(ConfigValue.describeDuration(milliseconds))",
                close: true)
        case .proxyAuthenticationRequired(let sent, let close):
            return ProxyResponse(
                status: 407,
                proxyStatus: ProxyStatus(error: .httpRequestDenied, details: "proxy authentication required"),
                message: sent
                    ? "proxyctl: wrong proxy user name or password"
                    : "proxyctl: this proxy requires a user name and password (Proxy-Authorization: Basic)",
                extraFields: [("Proxy-Authenticate", "Basic realm=\"proxyctl\", charset=\"UTF-8\"")], close: close)
        case .notProxyRequest(let listen, let close):
            return ProxyResponse(
                status: 400, proxyStatus: ProxyStatus(error: .httpRequestError, details: "not a proxy request"),
                message:
                    "proxyctl is a forward proxy, not a web server: set HTTPS_PROXY=http://\(listen) and HTTP_PROXY=http://\(listen) (or curl -x http://\(listen) URL)",
                close: close)
        case .httpsURLInPlainRequest(let close):
            return ProxyResponse(
                status: 400,
                proxyStatus: ProxyStatus(error: .httpRequestError, details: "https URL in a plain request"),
                message:
                    "proxyctl: https:// URLs go through a CONNECT tunnel; configure this proxy as HTTPS_PROXY so the client sends CONNECT",
                close: close)
        case .loopDetected(let target):
            return ProxyResponse(
                status: 508, proxyStatus: ProxyStatus(error: .proxyLoopDetected, details: "the target is this proxy"),
                message: "proxyctl: \(target) is this proxy itself; request the real destination instead", close: true)
        case .notForThisUser(let peer, let protected):
            let who: String
            switch peer {
            case .otherUser(let uid): who = "another user (uid \(uid))"
            case .unknown: who = "a client whose user cannot be told"
            case .owner: who = "this user"
            }
            let what = protected ? "protected origins (and the tokens for them)" : "this proxy"
            let key = protected ? "protected_users" : "passthrough_users"
            return ProxyResponse(
                status: 403,
                proxyStatus: ProxyStatus(
                    error: .httpRequestDenied, details: "\(what) serve only the user running proxyctl (\(key))"),
                message:
                    "proxyctl: \(what) serve only the user who runs this proxy, not \(who); run your own proxyctl, or set \(key) = any",
                close: true)
        case .ownerCredentialRequired(let sent, let protected, let close):
            let what = protected ? "protected origins (and the tokens for them)" : "this proxy"
            let key = protected ? "protected_users" : "passthrough_users"
            let how =
                "use the HTTPS_PROXY that eval \"$(proxyctl env)\" sets (it carries the credential), or proxyctl exec -- COMMAND"
            return ProxyResponse(
                status: 407,
                proxyStatus: ProxyStatus(
                    error: .httpRequestDenied,
                    details: "\(what) serve only the user running proxyctl (\(key)), who holds its credential"),
                message: sent
                    ? "proxyctl: wrong proxy credential; \(what) serve only the user who runs this proxy: \(how)"
                    : "proxyctl: \(what) serve only the user who runs this proxy, and this system cannot tell which user a connection comes from: \(how)",
                extraFields: [("Proxy-Authenticate", "Basic realm=\"proxyctl\", charset=\"UTF-8\"")], close: close)
        case .overCapacity(let limit):
            return ProxyResponse(
                status: 503,
                proxyStatus: ProxyStatus(
                    error: .connectionLimitReached, details: "\(limit) connections are open (max_connections)"),
                message:
                    "proxyctl: the proxy has \(limit) connections open, its limit; retry shortly, or raise max_connections",
                extraFields: [("Retry-After", "1")], close: true)
        case .tooManyFromClient(let limit):
            return ProxyResponse(
                status: 503,
                proxyStatus: ProxyStatus(
                    error: .connectionLimitReached,
                    details: "\(limit) connections from this address are open (max_connections_per_client)"),
                message:
                    "proxyctl: this address has \(limit) connections open, its limit; close some, or raise max_connections_per_client",
                extraFields: [("Retry-After", "1")], close: true)

        case .dnsTimeout(let hop, let milliseconds, let viaProxy):
            return Self.nextHop(
                504, .dnsTimeout, hop, viaProxy,
                "resolving \(hop.host) took longer than \(ConfigValue.describeDuration(milliseconds))")
        case .dnsError(let hop, let reason, let viaProxy):
            return Self.nextHop(502, .dnsError, hop, viaProxy, "cannot resolve \(hop.host): \(reason)")
        case .connectTimeout(let hop, let milliseconds, let viaProxy):
            return Self.nextHop(
                504, .connectionTimeout, hop, viaProxy,
                "connecting to \(hop) took longer than \(ConfigValue.describeDuration(milliseconds))")
        case .connectRefused(let hop, let viaProxy):
            return Self.nextHop(502, .connectionRefused, hop, viaProxy, "\(hop) refused the connection")
        case .connectFailed(let hop, let reason, let viaProxy):
            return Self.nextHop(502, .destinationUnavailable, hop, viaProxy, "cannot connect to \(hop): \(reason)")
        case .upstreamProxyClosed(let hop):
            return Self.nextHop(
                502, .connectionTerminated, hop, true, "closed the connection during CONNECT")
        case .upstreamProxyTimeout(let hop):
            return Self.nextHop(504, .httpResponseTimeout, hop, true, "no answer to CONNECT")
        case .upstreamProxyMalformedAnswer(let hop):
            return Self.nextHop(502, .httpProtocolError, hop, true, "malformed answer to CONNECT")
        case .upstreamProxyCredentials(let hop, let configured):
            let detail =
                configured
                ? "the upstream proxy refused the credentials in upstream_proxy (407)"
                : "the upstream proxy requires credentials (407); add user:password to upstream_proxy"
            return ProxyResponse(
                status: 502,
                proxyStatus: ProxyStatus(
                    error: .proxyConfigurationError, details: detail, receivedStatus: 407, nextHop: hop.description),
                message: "proxyctl: \(detail)", close: true)
        case .upstreamProxyRefused(let hop, let status):
            let detail = "upstream proxy: answered \(status) to CONNECT"
            return ProxyResponse(
                status: 502,
                proxyStatus: ProxyStatus(
                    error: .connectionRefused, details: detail, receivedStatus: status, nextHop: hop.description),
                message: "proxyctl: \(detail)", close: true)

        case .responseIncomplete(let hop):
            return Self.nextHop(
                502, .httpResponseIncomplete, hop, false,
                "\(hop) closed the connection before sending a complete response")
        case .responseTimeout(let hop, let milliseconds):
            return Self.nextHop(
                504, .httpResponseTimeout, hop, false,
                "\(hop) sent no response within \(ConfigValue.describeDuration(milliseconds))")
        case .invalidResponse(let hop, let reason):
            return ProxyResponse(
                status: 502,
                proxyStatus: ProxyStatus(
                    error: .httpProtocolError, details: "invalid response: \(reason)", nextHop: hop.description),
                message: "proxyctl: \(hop) sent an invalid response (\(reason))", close: true)
        case .responseHeadTooLarge(let hop):
            return Self.nextHop(
                502, .httpResponseHeaderSectionSize, hop, false,
                "\(hop) sent a response head larger than the proxy accepts")
        case .upstreamFailed(let failure, let hop, let detail, let origin):
            let (status, type, what) = failure.describe(hop)
            var text = detail.isEmpty ? what : "\(what): \(detail)"
            if failure == .certificate, let origin, let fix = origin.fix(detail) { text += "; \(fix)" }
            return ProxyResponse(
                status: status, proxyStatus: ProxyStatus(error: type, details: text, nextHop: hop.description),
                message: "proxyctl: \(text)", close: true)

        case .noLocalCA(let origin):
            return ProxyResponse(
                status: 502, proxyStatus: ProxyStatus(error: .proxyConfigurationError, details: "no local CA"),
                message: "proxyctl: \(origin) is protected but there is no local CA; run proxyctl ca init",
                close: true)
        case .tlsSetupFailed(let origin, let reason):
            return ProxyResponse(
                status: 502, proxyStatus: ProxyStatus(error: .proxyInternalError, details: "TLS set-up failed"),
                message: "proxyctl: cannot set up TLS for \(origin): \(reason)", close: true)
        case .misdirected(let reason):
            return ProxyResponse(
                status: 421, proxyStatus: ProxyStatus(error: .httpRequestDenied, details: reason),
                message: "proxyctl: misdirected request: \(reason); no token was sent", close: true)
        case .unsupported(let reason):
            return ProxyResponse(
                status: 501, proxyStatus: ProxyStatus(error: .httpRequestError, details: reason),
                message: "proxyctl: \(reason)", close: true)
        case .browserRequestRefused(let refusal, let close):
            // No CORS fields: the page that made the request learns nothing but that it failed.
            return ProxyResponse(
                status: 403, proxyStatus: ProxyStatus(error: .httpRequestDenied, details: refusal.details),
                message: refusal.message, close: close)
        case .credentialRefused(let reason, let close):
            return ProxyResponse(
                status: 403, proxyStatus: ProxyStatus(error: .httpRequestDenied, details: reason),
                message: "proxyctl: refused: \(reason)", close: close)
        case .signInNeeded(let provider, let reason):
            return ProxyResponse(
                status: 401,
                proxyStatus: ProxyStatus(
                    error: .httpRequestDenied, details: "sign-in needed: run proxyctl login \(provider)"),
                message: "proxyctl: \(reason)")
        case .providerUnavailable(let origin, let reason, let retryAfter):
            return ProxyResponse(
                status: 503,
                proxyStatus: ProxyStatus(
                    error: .proxyInternalResponse,
                    details: "the identity provider is unavailable; retry in \(retryAfter)s"),
                message: "proxyctl: cannot get a token for \(origin): \(reason); retry in \(retryAfter)s",
                extraFields: [("Retry-After", String(retryAfter))])
        case .refreshPending(let origin, let reason, let retryAfter):
            return ProxyResponse(
                status: 503,
                proxyStatus: ProxyStatus(
                    error: .proxyInternalResponse,
                    details: "a token refresh is waiting for the identity provider's answer; retry in \(retryAfter)s"),
                message: "proxyctl: cannot get a token for \(origin): \(reason); retry in \(retryAfter)s",
                extraFields: [("Retry-After", String(retryAfter))])
        case .tokenStorageFailed(let origin, let reason):
            // No Retry-After: waiting does not help until someone frees space or fixes permissions.
            return ProxyResponse(
                status: 503,
                proxyStatus: ProxyStatus(
                    error: .proxyInternalError,
                    details: "proxyctl cannot keep tokens in its state directory; see the message"),
                message: "proxyctl: cannot get a token for \(origin): \(reason)")
        case .providerMisconfigured(let origin, let provider, let reason):
            return ProxyResponse(
                status: 500,
                proxyStatus: ProxyStatus(
                    error: .proxyConfigurationError, details: "provider \(provider) is misconfigured"),
                message: "proxyctl: cannot get a token for \(origin): \(reason)")
        case .dpopKeyMissing(let provider):
            return ProxyResponse(
                status: 401,
                proxyStatus: ProxyStatus(
                    error: .httpRequestDenied, details: "sign-in needed: run proxyctl login \(provider)"),
                message: "proxyctl: the DPoP key for \(provider) is missing; run: proxyctl login \(provider)")
        case .dpopProofFailed(let reason):
            return ProxyResponse(
                status: 500, proxyStatus: ProxyStatus(error: .proxyInternalError, details: "cannot sign a DPoP proof"),
                message: "proxyctl: cannot sign a DPoP proof: \(reason)", close: true)
        case .bodyNotKept(let directory):
            return ProxyResponse(
                status: 500,
                proxyStatus: ProxyStatus(error: .proxyInternalError, details: "cannot keep the request body"),
                message: "proxyctl: cannot write the request body to \(directory)", close: true)
        }
    }

    /// The status the answer carries (for logs and playbooks).
    public var status: Int { response.status }

    /// An answer about reaching the next hop; through an upstream proxy the text says so.
    private static func nextHop(
        _ status: Int, _ type: ProxyStatus.ErrorType, _ hop: HostPort, _ viaProxy: Bool, _ message: String
    ) -> ProxyResponse {
        let text = viaProxy ? "upstream proxy: \(message)" : message
        return ProxyResponse(
            status: status, proxyStatus: ProxyStatus(error: type, details: text, nextHop: hop.description),
            message: "proxyctl: \(text)", close: true)
    }
}

/// Why a transfer to a protected origin failed before its response head: what libcurl's error codes
/// (mapped in one place in ProxyIO) mean to the proxy and to the provider client alike.
public enum UpstreamFailure: Sendable, Equatable {
    case dns
    case connect
    case timeout
    case certificate
    case tls
    /// The connection closed or broke before a complete response.
    case incomplete
    /// The upstream proxy failed or could not be resolved.
    case proxy
    /// The response head was larger than the proxy accepts.
    case headTooLarge
    /// The response could not be read as HTTP (a malformed head, ambiguous framing, a broken chunk).
    case protocolError
    case other
    /// The upstream proxy answered this status to our CONNECT (407: it wants credentials).
    case proxyRefused(status: Int)
    /// The upstream proxy closed the connection during our CONNECT.
    case proxyClosed
    /// The upstream proxy's answer to our CONNECT was not HTTP, or came with more than the answer.
    case proxyMalformed
    /// The upstream proxy did not answer our CONNECT in time.
    case proxyTimeout

    /// The proxy's own answer for this failure of a request to `hop` (through `proxy`, when one applies): the
    /// upstream proxy's own answers for the CONNECT failures, else `.upstreamFailed` (naming `origin`'s
    /// `ca_file` when the certificate does not verify).
    public func answer(
        hop: HostPort, proxy: UpstreamProxy?, detail: String, origin: OriginTrust? = nil
    ) -> ProxyAnswer {
        let failed = ProxyAnswer.upstreamFailed(self, hop: hop, detail: detail, origin: origin)
        guard let proxy else { return failed }
        switch self {
        case .proxyRefused(let status): return proxy.connectRefusal(status: status) ?? failed
        case .proxyClosed: return .upstreamProxyClosed(proxy.address)
        case .proxyMalformed: return .upstreamProxyMalformedAnswer(proxy.address)
        case .proxyTimeout: return .upstreamProxyTimeout(proxy.address)
        default: return failed
        }
    }

    /// Status, `Proxy-Status` error type and the sentence for a person.
    func describe(_ hop: HostPort) -> (Int, ProxyStatus.ErrorType, String) {
        switch self {
        case .dns: (502, .dnsError, "cannot resolve \(hop.host)")
        case .connect: (502, .connectionRefused, "cannot connect to \(hop)")
        case .timeout: (504, .connectionTimeout, "\(hop) did not answer in time")
        case .certificate: (502, .tlsCertificateError, "the certificate of \(hop) does not verify")
        case .tls: (502, .tlsProtocolError, "TLS with \(hop) failed")
        case .incomplete: (502, .httpResponseIncomplete, "\(hop) closed the connection without a complete response")
        case .proxy, .proxyRefused, .proxyClosed, .proxyMalformed:
            (502, .proxyConfigurationError, "the upstream proxy failed")
        case .proxyTimeout: (504, .connectionTimeout, "the upstream proxy did not answer in time")
        case .headTooLarge:
            (502, .httpResponseHeaderSectionSize, "\(hop) sent a response head larger than the proxy accepts")
        case .protocolError: (502, .httpProtocolError, "\(hop) sent a response that is not valid HTTP/1.1")
        case .other: (502, .proxyInternalError, "the request to \(hop) failed")
        }
    }
}

/// A protected origin's section and the CA file it trusts (`ca_file`, else the system's roots): what a person
/// changes when the origin's certificate does not verify.
public struct OriginTrust: Sendable, Equatable {
    /// The section's URL, `https://api.example.com:8443`.
    public let url: String
    public let caFile: String?
    /// The configuration file of the section ("" when unknown: proxy.conf is named).
    public let file: String

    public init(url: String, caFile: String?, file: String = "") {
        self.url = url
        self.caFile = caFile
        self.file = file
    }

    public init(_ origin: OriginConfig) { self.init(url: origin.url, caFile: origin.caFile, file: origin.file) }

    /// OpenSSL's verification errors (`X509_verify_cert_error_string`) that mean the issuer is not trusted: a
    /// private CA, which `ca_file` fixes. An expired certificate or another host's is not fixed by a CA.
    static let untrustedIssuer = [
        "self-signed certificate", "self signed certificate", "unable to get local issuer certificate",
        "unable to get issuer certificate", "unable to verify the first certificate",
    ]

    /// The fix for a certificate that failed verification with `detail`, or nil when a CA is not the fix.
    func fix(_ detail: String) -> String? {
        guard Self.untrustedIssuer.contains(where: { detail.contains($0) }) else { return nil }
        let section = "[origin \(url)] of \(file.isEmpty ? "proxy.conf" : file)"
        if let caFile { return "the CA that issued it is not in ca_file = \(caFile) of \(section): add it there" }
        return "if the origin's certificate comes from a private CA, set ca_file = FILE (that CA's PEM) in \(section)"
    }
}
