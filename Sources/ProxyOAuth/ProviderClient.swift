import ProxyCore

#if canImport(FoundationEssentials)
    import FoundationEssentials
#else
    import Foundation
#endif

/// Talks to one provider's endpoints: discovery, JWKS, token, PAR, device authorization, revocation.
/// Caches the metadata and the key set. Retries only where retrying is safe (see `postToken`).
public actor ProviderClient {
    public nonisolated let config: ProviderConfig
    let transport: any HTTPTransport
    private var metadata: ProviderMetadata?
    private var keys: JWKSet?
    /// Retries of 5xx, 429 and network errors at the token endpoint, and the longest wait between them.
    public var retryBudget = 2
    public var maxRetryWait = 5
    /// With DPoP: the key that signs proofs for token requests (RFC 9449 §5).
    public private(set) var dpopKey: DPoPKey?
    /// DPoP nonces of the authorization server, from every response.
    public nonisolated let nonces: DPoPNonces
    /// Sleeps between retries; tests shorten it.
    var sleep: @Sendable (Int) async throws -> Void = { seconds in try await Task.sleep(for: .seconds(seconds)) }

    public init(config: ProviderConfig, transport: any HTTPTransport, nonces: DPoPNonces = DPoPNonces()) {
        self.config = config
        self.transport = transport
        self.nonces = nonces
    }

    public func setDPoPKey(_ key: DPoPKey?) { dpopKey = key }

    /// How a confidential client authenticates at the token endpoint; nil for a public client (`client_id`).
    public private(set) var clientAuthentication: ClientAuthentication?

    public func setClientAuthentication(_ authentication: ClientAuthentication?) {
        clientAuthentication = authentication
    }

    func setSleep(_ sleep: @escaping @Sendable (Int) async throws -> Void) { self.sleep = sleep }

    /// The provider's metadata, fetched once (OpenID Connect Discovery, then RFC 8414).
    public func discover() async throws -> ProviderMetadata {
        if let metadata { return metadata }
        switch try await probe(issuer: config.issuer) {
        case .found(_, let document):
            switch ProviderMetadata.parse(document, expectedIssuer: config.issuer) {
            case .failure(let error): throw error
            case .success(let parsed):
                metadata = parsed
                return parsed
            }
        case .missing(let tried):
            throw AuthError.configuration(
                reason:
                    "\(config.issuer) has no discovery document (\(ProviderMetadata.describeTried(tried))); check issuer in [provider \(config.name)]"
            )
        }
    }

    /// What discovery finds for `issuer`, its issuer not checked yet: `proxyctl init` tells a person what to give.
    public enum DiscoveryProbe: Sendable {
        /// The document, and the URL that answered it.
        case found(url: String, document: JSONObject)
        /// Every URL tried (OpenID Connect Discovery, then RFC 8414) and the status it answered.
        case missing(tried: [(url: String, status: Int)])
    }

    /// Fetches the first discovery document of `issuer`'s discovery URLs that answers; 404 and 405 go on to the
    /// next. A provider that cannot be reached, a 5xx or 429, or another status is thrown.
    public func probe(issuer: String) async throws -> DiscoveryProbe {
        var tried: [(url: String, status: Int)] = []
        for url in ProviderMetadata.discoveryURLs(issuer: issuer) {
            let response: HTTPResponse
            do {
                response = try await transport.send(
                    HTTPRequest(url: url, headers: [("Accept", "application/json")], caFile: config.caFile))
            } catch let error as TransportError {
                throw Self.unreachable(error, what: "the provider \(issuer)")
            }
            if response.status == 404 || response.status == 405 {
                tried.append((url, response.status))
                continue
            }
            guard response.status == 200, let document = response.jsonObject else {
                if response.status == 429 || response.status >= 500 {
                    throw AuthError.recoverable(
                        reason: "the provider's discovery document is unavailable (\(response.status))",
                        retryAfter: TokenEndpoint.retryAfter(response.header("Retry-After"), now: Date()))
                }
                throw AuthError.configuration(reason: "\(url) answered \(response.status) without a discovery document")
            }
            return .found(url: url, document: document)
        }
        return .missing(tried: tried)
    }

    /// The provider's key set; `refresh` fetches it again (after an unknown kid).
    public func jwks(refresh: Bool) async throws -> JWKSet {
        if let keys, !refresh { return keys }
        let metadata = try await discover()
        guard let uri = metadata.jwksURI else {
            throw AuthError.configuration(reason: "the provider publishes no jwks_uri; ID tokens cannot be verified")
        }
        let response: HTTPResponse
        do {
            response = try await transport.send(
                HTTPRequest(url: uri, headers: [("Accept", "application/json")], caFile: config.caFile))
        } catch let error as TransportError {
            throw Self.unreachable(error, what: "the provider's keys")
        }
        guard response.status == 200, let document = response.jsonObject,
            case .success(let set) = JWKSet.parse(document)
        else {
            throw AuthError.recoverable(
                reason: "the provider's key set is unavailable (\(response.status))", retryAfter: nil)
        }
        keys = set
        return set
    }

    /// POSTs to the token endpoint. 5xx, 429 and network errors are retried within the budget, honouring
    /// Retry-After up to `maxRetryWait`; then they become `AuthError.recoverable` with the remaining wait.
    /// With a DPoP key, every attempt carries a fresh proof with the server's latest nonce, and a
    /// `use_dpop_nonce` answer is retried once with the nonce it brought (RFC 9449 §8).
    ///
    /// When `resendable` is false (a refresh token: RFC 9700 §4.14.2, a rotated token sent twice makes the
    /// provider revoke the session), a request that went out and got no answer is never sent again: it
    /// ends as `.unanswered`. `timeout` (milliseconds, default `token_timeout`) bounds each attempt.
    public func postToken(
        _ parameters: [(String, String)], resendable: Bool = true, timeout: Int? = nil
    ) async throws -> Result<TokenResponse, TokenEndpointError> {
        let metadata = try await discover()
        var attempt = 0
        var nonceRetried = false
        while true {
            var headers: [(name: String, value: String)] = []
            if let dpopKey {
                do {
                    let proof = try dpopKey.proof(
                        method: "POST", url: metadata.tokenEndpoint, nonce: nonces.nonce(for: metadata.tokenEndpoint),
                        now: Int64(Date().timeIntervalSince1970))
                    headers.append(("DPoP", proof))
                } catch {
                    throw AuthError.configuration(reason: "cannot sign a DPoP proof: \(error)")
                }
            }
            var form = parameters
            if let clientAuthentication {
                // A new assertion for every attempt, a nonce retry included: providers refuse a jti they have seen.
                do {
                    let applied = try clientAuthentication.apply(
                        to: parameters, issuer: metadata.issuer, tokenEndpoint: metadata.tokenEndpoint,
                        now: Int64(Date().timeIntervalSince1970))
                    form = applied.parameters
                    headers += applied.headers
                } catch let error as AuthError {
                    throw error
                } catch {
                    throw AuthError.configuration(reason: "cannot sign the client assertion: \(error)")
                }
            }
            var request = HTTPRequest.form(metadata.tokenEndpoint, form, caFile: config.caFile, headers: headers)
            request.timeout = timeout ?? config.tokenTimeout
            let outcome: Result<TokenResponse, TokenEndpointError>
            do {
                let response = try await transport.send(request)
                nonces.remember(response.header("DPoP-Nonce"), for: metadata.tokenEndpoint)
                outcome = TokenEndpoint.parse(response)
            } catch let error as TransportError {
                if case .certificate = error { throw Self.unreachable(error, what: "the token endpoint") }
                if case .noAnswer(let reason) = error, !resendable { return .failure(.unanswered(reason)) }
                guard attempt < retryBudget else { throw Self.unreachable(error, what: "the token endpoint") }
                attempt += 1
                try await sleep(min(1 << (attempt - 1), maxRetryWait))
                continue
            }
            if dpopKey != nil, !nonceRetried, case .failure(.oauth(let error, _, let nonce)) = outcome,
                error.error == "use_dpop_nonce", nonce != nil
            {
                nonceRetried = true
                continue
            }
            if case .failure(.unavailable(let status, let retryAfter)) = outcome {
                let wait = retryAfter ?? (1 << attempt)
                guard attempt < retryBudget, wait <= maxRetryWait else {
                    throw AuthError.recoverable(
                        reason: "the provider's token endpoint is unavailable (HTTP \(status))", retryAfter: retryAfter)
                }
                attempt += 1
                try await sleep(wait)
                continue
            }
            return outcome
        }
    }

    /// POSTs a form to another endpoint (PAR, device authorization, revocation); no retries.
    public func postForm(
        _ url: String, _ parameters: [(String, String)], headers: [(name: String, value: String)] = []
    )
        async throws -> HTTPResponse
    {
        do {
            return try await transport.send(HTTPRequest.form(url, parameters, caFile: config.caFile, headers: headers))
        } catch let error as TransportError {
            throw Self.unreachable(error, what: url)
        }
    }

    static func unreachable(_ error: TransportError, what: String) -> AuthError {
        switch error {
        case .certificate(let reason):
            .configuration(
                reason: "cannot verify the TLS certificate of \(what): \(reason) (set ca_file for a private CA)")
        case .timeout(let reason):
            .recoverable(reason: "\(what) did not answer in time: \(reason)", retryAfter: nil)
        case .unreachable(let reason):
            .recoverable(reason: "cannot reach \(what): \(reason)", retryAfter: nil)
        case .noAnswer(let reason):
            .recoverable(reason: "\(what) gave no answer: \(reason)", retryAfter: nil)
        }
    }
}
