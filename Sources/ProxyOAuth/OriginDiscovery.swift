import ProxyCore
import ProxyTLS

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

/// Fetches the documents an origin or an authorization server names, under `MetadataURL`'s rules: only https or
/// loopback http URLs, a redirect followed only within its origin (at most three), at most 64 KiB read
/// (`ProtectedResourceMetadata.maxDocumentBytes`), no cookies, nothing sent but `Accept`. A server whose
/// certificate the system's roots do not verify is tried again with `caFile` (`--ca-file`), and the answer says
/// so, so that init writes `ca_file` only where a server needs it.
public struct MetadataFetcher: Sendable {
    public let transport: any HTTPTransport
    public let caFile: String?
    /// Milliseconds for each request.
    public let timeout: Int

    public init(transport: any HTTPTransport, caFile: String?, timeout: Int = 15_000) {
        self.transport = transport
        self.caFile = caFile
        self.timeout = timeout
    }

    /// An answer, and where it came from.
    public struct Fetched: Sendable {
        /// The URL that answered (after same-origin redirects).
        public var url: String
        public var response: HTTPResponse
        /// `caFile` was needed to verify the server.
        public var usedCA: Bool
    }

    /// GETs `url`. `probe`: only the head matters (an origin's answer to an unauthenticated request, whose body
    /// may be a large page): a larger body is cut at the bound instead of failing.
    public func get(_ url: String, probe: Bool = false) async throws -> Fetched {
        var current = url
        for _ in 0...3 {
            if let problem = MetadataURL.problem(current, allowQuery: true) {
                throw DiscoveryError("\(TargetText.withoutQuery(current)) is not fetched: \(problem)")
            }
            var request = HTTPRequest(url: current, headers: [("Accept", "application/json")])
            request.limit = ProtectedResourceMetadata.maxDocumentBytes
            request.keepsHeadWhenTooLarge = probe
            request.timeout = timeout
            let (response, usedCA) = try await send(request)
            if (300..<400).contains(response.status), let location = response.header("Location") {
                switch MetadataURL.redirect(from: current, to: location) {
                case .success(let next): current = next
                case .failure(let error): throw error
                }
                continue
            }
            return Fetched(url: current, response: response, usedCA: usedCA)
        }
        throw DiscoveryError("\(TargetText.withoutQuery(url)) redirects more than three times")
    }

    /// POSTs a JSON body (a registration); no redirect is followed.
    public func postJSON(_ url: String, _ body: String) async throws -> Fetched {
        if let problem = MetadataURL.problem(url, allowQuery: true) {
            throw DiscoveryError("\(TargetText.withoutQuery(url)) is not used: \(problem)")
        }
        var request = HTTPRequest(
            method: "POST", url: url,
            headers: [("Content-Type", "application/json"), ("Accept", "application/json")], body: Array(body.utf8))
        request.limit = ProtectedResourceMetadata.maxDocumentBytes
        let (response, usedCA) = try await send(request)
        return Fetched(url: url, response: response, usedCA: usedCA)
    }

    private func send(_ request: HTTPRequest) async throws -> (HTTPResponse, Bool) {
        let target = TargetText.withoutQuery(request.url)
        do {
            return (try await transport.send(request), false)
        } catch TransportError.certificate(let reason) {
            guard let caFile else {
                throw DiscoveryError(
                    "\(target): the certificate does not verify (\(reason)); if the server's certificate comes from a private CA, give --ca-file FILE"
                )
            }
            var again = request
            again.caFile = caFile
            do {
                return (try await transport.send(again), true)
            } catch let error as TransportError {
                throw DiscoveryError("\(target): \(error.description) (with --ca-file \(caFile) too)")
            }
        } catch let error as TransportError {
            throw DiscoveryError("cannot fetch \(target): \(error.description)")
        }
    }
}

/// `proxyctl init --origin URL` without an issuer: what the origin says about itself (RFC 9728), what the
/// authorization server it names says (RFC 8414, OpenID Connect Discovery), and the client registration (RFC
/// 7591). The I/O of it; every decision is `ProtectedResourceMetadata`'s, `ProviderMetadata`'s and
/// `ClientRegistration`'s.
public struct OriginDiscovery: Sendable {
    public let fetcher: MetadataFetcher

    public init(fetcher: MetadataFetcher) {
        self.fetcher = fetcher
    }

    /// The origin's protected resource metadata.
    public struct ResourceFinding: Sendable {
        public var metadata: ProtectedResourceMetadata
        /// Where it was read.
        public var url: String
        /// Found through the `resource_metadata` of the origin's challenge (else the well-known URL).
        public var viaChallenge: Bool
        /// The `scope` of that challenge, if it named one.
        public var challengeScopes: [String]?
        public var usedCA: Bool
    }

    /// RFC 9728 §5 then §3: the `resource_metadata` of the challenge an unauthenticated request gets, else the
    /// well-known URL; its `resource` must be `resource` (§3.3).
    public func resource(_ resource: AbsoluteURL, as given: String) async throws -> ResourceFinding {
        let probe = try await fetcher.get(given, probe: true)
        let challenges = ChallengeParser.parse(probe.response.headers(named: "WWW-Authenticate"))
        let named = probe.response.status == 401 || probe.response.status == 403 ? challenges.resourceMetadata : nil
        let url = named ?? ProtectedResourceMetadata.wellKnownURL(for: resource)
        let fetched = try await fetcher.get(url)
        guard fetched.response.status == 200 else {
            if named == nil && (fetched.response.status == 404 || fetched.response.status == 405) {
                throw DiscoveryError(
                    "\(given) publishes no protected resource metadata (RFC 9728): its answer to a request without a token named no resource_metadata, and \(TargetText.withoutQuery(url)) answered \(fetched.response.status); give --issuer URL and --client-id ID"
                )
            }
            throw DiscoveryError(
                "the protected resource metadata at \(TargetText.withoutQuery(fetched.url)) answered \(fetched.response.status)"
            )
        }
        guard case .success(let json) = JSON.parse(fetched.response.body) else {
            throw DiscoveryError(
                "the protected resource metadata at \(TargetText.withoutQuery(fetched.url)) is not JSON")
        }
        let metadata: ProtectedResourceMetadata
        switch ProtectedResourceMetadata.parse(json) {
        case .failure(let error):
            throw DiscoveryError("\(TargetText.withoutQuery(fetched.url)): \(error.message)")
        case .success(let parsed): metadata = parsed
        }
        // RFC 9728 §3.3: metadata for another resource is not this one's, whoever serves it.
        guard ProtectedResourceMetadata.matches(metadata.resource, resource) else {
            throw DiscoveryError(
                "the protected resource metadata at \(TargetText.withoutQuery(fetched.url)) is for the resource \(DiscoveryText.printable(metadata.resource)), not \(given) (RFC 9728 §3.3: they must be identical); nothing was used"
            )
        }
        return ResourceFinding(
            metadata: metadata, url: fetched.url, viaChallenge: named != nil,
            challengeScopes: named != nil ? challenges.scope : nil, usedCA: probe.usedCA || fetched.usedCA)
    }

    /// The authorization server's metadata.
    public struct ServerFinding: Sendable {
        public var metadata: ProviderMetadata
        public var url: String
        public var usedCA: Bool
    }

    /// The metadata URLs of `issuer`, RFC 8414's first (an OAuth authorization server), then OpenID Connect
    /// Discovery's.
    public static func serverMetadataURLs(issuer: String) -> [String] {
        Array(ProviderMetadata.discoveryURLs(issuer: issuer).reversed())
    }

    /// RFC 8414 §3, then OpenID Connect Discovery §4: the first document that answers must name exactly `issuer`
    /// (RFC 8414 §3.3); a 404 or 405 tries the next.
    public func authorizationServer(_ issuer: String) async throws -> ServerFinding {
        var tried: [String] = []
        for url in Self.serverMetadataURLs(issuer: issuer) {
            let fetched = try await fetcher.get(url)
            let status = fetched.response.status
            if status == 404 || status == 405 {
                tried.append("\(url) answered \(status)")
                continue
            }
            guard status == 200, let document = fetched.response.jsonObject else {
                throw DiscoveryError("\(url) answered \(status) without authorization server metadata")
            }
            guard let named = document["issuer"]?.string, named == issuer else {
                let named = document["issuer"]?.string.map { DiscoveryText.printable($0) } ?? "no issuer"
                throw DiscoveryError(
                    "the authorization server metadata at \(url) names \(named), not \(issuer) (RFC 8414 §3.3: it must name exactly the issuer the origin named); nothing was used"
                )
            }
            switch ProviderMetadata.parse(document, expectedIssuer: issuer) {
            case .failure(let error): throw DiscoveryError("\(url): \(error.description)")
            case .success(let metadata):
                return ServerFinding(metadata: metadata, url: fetched.url, usedCA: fetched.usedCA)
            }
        }
        throw DiscoveryError("\(issuer) publishes no authorization server metadata (\(tried.joined(separator: ", ")))")
    }

    /// Why a registration was refused: the status and the OAuth error of the answer (RFC 7591 §3.2.2).
    public struct RegistrationRefused: Error, Sendable {
        public var status: Int
        public var error: OAuthErrorResponse?
        public var description: String {
            "HTTP \(status)" + (error.map { ", \($0.summary)" } ?? "")
        }
    }

    /// Registers `request` at `endpoint` (RFC 7591 §3.1).
    /// `register`, once more without the device grant when the provider refused the request for its metadata
    /// while the request asked for that grant: glewlwyd 2.7.5 lists urn:ietf:params:oauth:grant-type:device_code in
    /// grant_types_supported and refuses it in a registration (it wants a name of its own). The refusal that
    /// dropped the grant comes back with the registration (nil when the first request was taken).
    public func registerDroppingRefusedDeviceGrant(
        _ request: ClientRegistrationRequest, at endpoint: String, issuer: String
    ) async throws -> (registration: ClientRegistration, deviceRefused: RegistrationRefused?) {
        let device = request.grantTypes.contains(ClientRegistrationRequest.deviceGrant)
        do {
            return (try await register(request, at: endpoint, issuer: issuer), nil)
        } catch let refused as RegistrationRefused where device && refused.error?.error == "invalid_client_metadata" {
            var without = request
            without.grantTypes.removeAll { $0 == ClientRegistrationRequest.deviceGrant }
            return (try await register(without, at: endpoint, issuer: issuer), refused)
        }
    }

    public func register(
        _ request: ClientRegistrationRequest, at endpoint: String, issuer: String
    ) async throws -> ClientRegistration {
        let fetched = try await fetcher.postJSON(endpoint, request.body)
        let response = fetched.response
        guard response.status == 201 || response.status == 200 else {
            let object = response.jsonObject
            throw RegistrationRefused(
                status: response.status,
                error: object?["error"]?.string.map {
                    OAuthErrorResponse(error: $0, description: object?["error_description"]?.string)
                })
        }
        guard case .success(let json) = JSON.parse(response.body) else {
            throw DiscoveryError("the registration answer from \(endpoint) is not JSON")
        }
        switch ClientRegistration.parse(
            json, issuer: issuer, request: request, now: Int64(Date().timeIntervalSince1970))
        {
        case .failure(let error): throw error
        case .success(let registration): return registration
        }
    }
}

/// Registrations proxyctl made, one file per issuer in `STATE_DIR/registrations/` (0700): the client id, the
/// redirect URIs and grants, and the `registration_access_token` (a credential: the files are 0600, replaced
/// atomically, never printed).
public struct RegistrationStore: Sendable {
    public let directory: String

    public init(stateDirectory: String) {
        directory = stateDirectory + "/registrations"
    }

    /// `HOST-HASH.json`: the issuer's host for people, a hash of the whole issuer so that two issuers of one host
    /// never share a file.
    public func file(for issuer: String) -> String {
        var host = "issuer"
        if case .success(let url) = AbsoluteURL.parse(issuer) {
            host = String(url.authority.host.map { $0.isLetter || $0.isNumber || $0 == "." || $0 == "-" ? $0 : "_" })
        }
        let hash = Crypto.sha256(issuer).prefix(6).map { String($0, radix: 16).leftPadding(to: 2) }.joined()
        return "\(directory)/\(host)-\(hash).json"
    }

    public func load(issuer: String) -> ClientRegistration? {
        guard let data = FileManager.default.contents(atPath: file(for: issuer)),
            case .success(let json) = JSON.parse(Array(data)), let registration = ClientRegistration(stored: json),
            registration.issuer == issuer
        else { return nil }
        return registration
    }

    public func save(_ registration: ClientRegistration) throws {
        try SecureFile.makePrivateDirectory(directory)
        let text = JSON.serialize(registration.stored) + "\n"
        try SecureFile.write(Array(text.utf8), to: file(for: registration.issuer), mode: 0o600)
    }
}
