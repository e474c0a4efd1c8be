import ProxyCore
import ProxyIO
import ProxyOAuth
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

/// `proxyctl init --origin URL` without `--issuer` or `--client-id`: everything else from what the origin and its
/// authorization server publish (RFC 9728, RFC 8414 / OpenID Connect Discovery, RFC 7591).
///
/// Closed by construction: every URL fetched is https or loopback http, no redirect leaves its origin, no answer
/// is read beyond 64 KiB (`MetadataFetcher`); the metadata is checked before it is believed (the resource is the
/// one asked about, the authorization server names itself exactly); and proxyctl says which authorization server
/// the origin names, and what it would register there, before it sends that server anything: on a terminal it
/// asks, elsewhere it needs `--yes` or the issuer named with `--issuer`.
extension InitCommand {
    static func runFromOrigin(_ arguments: ParsedArguments, _ context: CommandContext) throws -> Int32 {
        let path = ["proxyctl", "init"]
        let given = arguments.all("origin")
        guard given.count == 1, let text = given.first else {
            throw UsageError(
                message:
                    "init from the origin alone takes one --origin (give --issuer and --client-id to protect several)",
                command: path)
        }
        if let problem = MetadataURL.problem(text, allowQuery: true) {
            throw UsageError(message: "--origin \(text): \(problem)", command: path)
        }
        guard case .success(let resourceURL) = AbsoluteURL.parse(text) else {
            throw UsageError(message: "--origin \(text): expected an https:// URL", command: path)
        }
        let originURL: String
        switch OriginConfig.parseURL("\(resourceURL.scheme)://\(resourceURL.hostFieldValue)") {
        case .success(let origin): originURL = origin.url
        case .failure(let error): throw UsageError(message: "--origin \(text): \(error.message)", command: path)
        }
        let namedIssuer = arguments.value("issuer")
        if let namedIssuer, let problem = ProviderConfig.checkIssuer(namedIssuer) {
            throw UsageError(message: "--issuer: \(problem)", command: path)
        }
        let clientMetadataURL = arguments.value("client-metadata-url")
        if let clientMetadataURL, let problem = ClientChoice.metadataURLProblem(clientMetadataURL) {
            throw UsageError(message: "--client-metadata-url: \(problem)", command: path)
        }
        if let id = arguments.value("client-id"), !ClientRegistration.isClientID(id) {
            throw UsageError(message: "--client-id: expected a client id without spaces", command: path)
        }
        var redirectPort: Int? = nil
        if let text = arguments.value("redirect-port") {
            guard let port = Int(text), (1...65535).contains(port) else {
                throw UsageError(message: "--redirect-port expects a port from 1 to 65535", command: path)
            }
            redirectPort = port
        }
        let caFile = try arguments.value("ca-file").map { try absoluteFile($0, flag: "--ca-file", path: path) }
        let originCA = try arguments.value("origin-ca-file").map {
            try absoluteFile($0, flag: "--origin-ca-file", path: path)
        }
        let loader = ConfigLoader(environment: context.environment)
        let file: String
        switch loader.locate(flag: arguments.value("config")) {
        case .explicit(let given), .standard(let given): file = given
        case .text:
            throw CommandFailure(
                message: "the configuration comes from $PROXYCTL_CONFIG_TEXT; unset it or give --config FILE")
        case .none: throw CommandFailure(message: "no home directory to write proxy.conf in: give --config FILE")
        }
        if FileManager.default.fileExists(atPath: file) && !arguments.flag("force") {
            throw CommandFailure(
                message:
                    "\(file) exists already; proxyctl init never replaces it without --force (check it with proxyctl doctor)"
            )
        }
        var resolve: [String: String] = [:]
        if let pairs = arguments.value("resolve") {
            var probe = Configuration()
            let errors = ConfigParser(homeDirectory: nil, baseDirectory: nil).applyOverrides(
                [("--resolve", "resolve", pairs)], to: &probe)
            if let first = errors.first { throw UsageError(message: "--resolve: \(first.message)", command: path) }
            resolve = probe.proxy.resolve
        }
        guard let stateDirectory = TokenStore.defaultStateDirectory(environment: context.environment) else {
            throw CommandFailure(message: "no state directory: set HOME or XDG_STATE_HOME")
        }

        let loopThread = LoopThread()
        let transport = CurlTransport(
            loop: loopThread.loop, upstreamProxy: nil, bypass: BypassList(), resolve: resolve)
        // The transport (and its libcurl multi handle, whose timer the loop may still fire) goes only once the
        // loop has stopped: released after its last use, it went from under a timer of the loop thread.
        defer {
            loopThread.stop()
            withExtendedLifetime(transport) {}
        }
        let discovery = OriginDiscovery(fetcher: MetadataFetcher(transport: transport, caFile: caFile))
        func failure(_ error: any Error) -> CommandFailure {
            CommandFailure(message: "cannot set up \(text) from its metadata: \(error)")
        }

        // 1. What the origin says about itself: nothing is sent anywhere else before this is read and checked.
        context.err("Reading what \(text) publishes about itself (RFC 9728) ...")
        let found: OriginDiscovery.ResourceFinding
        do {
            found = try runBlocking { try await discovery.resource(resourceURL, as: text) }
        } catch {
            throw failure(error)
        }
        let resource = found.metadata
        context.err(
            "  protected resource metadata: \(TargetText.withoutQuery(found.url)) ("
                + (found.viaChallenge
                    ? "named by resource_metadata in its answer to a request without a token" : "the well-known URL")
                + ")")
        context.err("  resource: \(resource.resource)" + (resource.resourceName.map { " (\($0))" } ?? ""))
        context.err("  authorization servers: \(resource.authorizationServers.joined(separator: ", "))")
        let issuer: String
        switch resource.chooseAuthorizationServer(named: namedIssuer) {
        case .failure(let error): throw CommandFailure(message: error.message)
        case .success(let chosen): issuer = chosen
        }

        // 2. The plan, named before the authorization server is contacted.
        let givenClientID = arguments.value("client-id")
        guard case .success(let issuerURL) = AbsoluteURL.parse(issuer) else {
            throw CommandFailure(message: "the authorization server \(issuer) is not a URL")
        }
        let derivedName = ProviderConfig.defaultName(issuerHost: issuerURL.authority.host)
        let name = arguments.value("name") ?? derivedName.name
        let store = RegistrationStore(stateDirectory: stateDirectory)
        let kept = givenClientID == nil && clientMetadataURL == nil ? store.load(issuer: issuer) : nil
        let redirect: (port: Int, uri: String, note: String)
        if redirectPort == nil, let kept, let port = kept.redirectPort, LoopbackReceiver.canListen(port: port) {
            redirect = (port, "http://127.0.0.1:\(port)\(ProviderConfig(name: name).redirectPath)", ", as registered")
        } else {
            // A client init registers takes any free port (a kept registration whose port is taken is made again);
            // a client of yours keeps the port of the file replaced, which is registered for it.
            let registering = givenClientID == nil && clientMetadataURL == nil
            redirect = chooseRedirectPort(
                given: redirectPort, replacing: registering ? "" : file, provider: name, context: context)
        }
        let reusable = kept.flatMap { $0.redirectURIs.contains(redirect.uri) ? $0 : nil }
        context.err("")
        context.err("The origin names the authorization server \(issuer).")
        if let givenClientID {
            context.err("proxyctl will read its metadata and sign in there as client \(givenClientID).")
        } else if let reusable {
            context.err(
                "proxyctl will read its metadata and use client \(reusable.clientID), registered there before (\(store.file(for: issuer)))."
            )
        } else {
            context.err(
                "proxyctl will read its metadata and, unless it accepts "
                    + (clientMetadataURL.map { "your client metadata document \($0)" } ?? "no client registration")
                    + ", register a native public client there (RFC 7591): no secret, redirect URI \(redirect.uri), the authorization code and refresh token grants (and the device grant where it offers one)."
            )
        }
        if namedIssuer != nil {
            context.err("(--issuer \(issuer) names it.)")
        } else if arguments.flag("yes") {
            context.err("(--yes: going ahead without asking.)")
        } else if context.isInteractive {
            guard Prompt.yesNo("Go ahead and write \(file)? [y/N] ", default: false) else {
                context.err("Nothing was sent to \(issuer) and nothing was written.")
                return ExitCode.failure
            }
        } else {
            throw CommandFailure(
                message:
                    "not a terminal, so nobody was asked: proxyctl talks to an authorization server an origin names only once you have seen it named. Nothing was sent to \(issuer); run again with --yes, or with --issuer \(issuer)"
            )
        }

        // 3. The authorization server, which must name itself exactly as the origin named it.
        context.err("Reading the metadata of \(issuer) (RFC 8414, then OpenID Connect Discovery) ...")
        let server: OriginDiscovery.ServerFinding
        do {
            server = try runBlocking { try await discovery.authorizationServer(issuer) }
        } catch {
            throw failure(error)
        }
        let metadata = server.metadata
        guard metadata.supportsS256 else {
            throw CommandFailure(
                message:
                    "\(issuer) does not offer PKCE with S256 (code_challenge_methods_supported), which proxyctl needs")
        }
        guard metadata.authorizationEndpoint != nil || metadata.deviceAuthorizationEndpoint != nil else {
            throw CommandFailure(message: "\(issuer) has neither an authorization endpoint nor a device endpoint")
        }
        let dpopAlgorithms = metadata.dpopSigningAlgorithms ?? []
        let dpop = resource.dpopBoundAccessTokensRequired || arguments.flag("dpop")
        if dpop && !dpopAlgorithms.contains("ES256") {
            throw CommandFailure(
                message:
                    "\(resource.dpopBoundAccessTokensRequired ? "the origin requires DPoP-bound tokens (dpop_bound_access_tokens_required)" : "--dpop"), but \(issuer) does not offer DPoP with ES256 (dpop_signing_alg_values_supported: \(dpopAlgorithms.isEmpty ? "none" : dpopAlgorithms.joined(separator: ", ")))"
            )
        }

        // Scopes: what the origin's challenge asked for, else what it supports; openid (added by proxyctl anyway)
        // and offline_access where the server has them.
        var scopes = ["openid"]
        let fromOrigin = found.challengeScopes ?? resource.scopesSupported ?? []
        for scope in fromOrigin where !scopes.contains(scope) { scopes.append(scope) }
        if metadata.scopesSupported?.contains("offline_access") == true && !scopes.contains("offline_access") {
            scopes.append("offline_access")
        }

        // 4. The client.
        var provenance = Provenance()
        let clientID: String
        var registrationReport: [String] = []
        let choice: ClientChoice
        switch ClientChoice.decide(
            clientID: givenClientID ?? reusable?.clientID, clientMetadataURL: clientMetadataURL,
            metadataDocumentsSupported: metadata.clientIDMetadataDocumentSupported,
            registrationEndpoint: metadata.registrationEndpoint, issuer: issuer)
        {
        case .failure(let error): throw CommandFailure(message: error.message)
        case .success(let decided): choice = decided
        }
        switch choice {
        case .given(let id):
            clientID = id
            if let reusable, givenClientID == nil {
                provenance.clientID = [
                    "client_id: registered at \(issuer) on \(Self.day(reusable.issuedAt)) (RFC 7591), kept in \(store.file(for: issuer))"
                ]
                registrationReport.append("client: \(id), registered before (\(store.file(for: issuer)))")
            } else {
                provenance.clientID = ["client_id: given with --client-id"]
            }
        case .metadataDocument(let url):
            clientID = url
            provenance.clientID = [
                "client_id: your Client ID Metadata Document (--client-metadata-url), which \(issuer) accepts (client_id_metadata_document_supported)"
            ]
            registrationReport.append("client: the Client ID Metadata Document \(url)")
        case .register(let endpoint):
            let device = metadata.deviceAuthorizationEndpoint != nil
            let request = ClientRegistrationRequest(
                redirectURI: redirect.uri, device: device, scopes: scopes, dpopBound: dpop)
            context.err("Registering \(request.summary) at \(TargetText.withoutQuery(endpoint)) ...")
            let registration: ClientRegistration
            do {
                let made = try runBlocking {
                    try await discovery.registerDroppingRefusedDeviceGrant(request, at: endpoint, issuer: issuer)
                }
                registration = made.registration
                if let refused = made.deviceRefused {
                    registrationReport.append(
                        "device flow: \(issuer) refused the device grant in the registration (\(refused.description)); browser sign-in only"
                    )
                }
            } catch let refused as OriginDiscovery.RegistrationRefused {
                throw CommandFailure(
                    message:
                        "\(issuer) refused the client registration (\(refused.description)): the provider needs an initial access token or does not allow open registration (docs/sign-in.md, \"From the origin alone\", names the settings); register a public client for proxyctl there with the redirect URI \(redirect.uri) and give --client-id ID"
                )
            } catch {
                throw failure(error)
            }
            do {
                try store.save(registration)
            } catch {
                throw CommandFailure(
                    message:
                        "\(issuer) registered client \(registration.clientID), but it cannot be kept in \(store.file(for: issuer)): \(error)"
                )
            }
            clientID = registration.clientID
            provenance.clientID = [
                "client_id: registered at \(issuer) on \(Self.day(registration.issuedAt)) (RFC 7591) with the redirect",
                "URI below; the registration is kept in \(store.file(for: issuer)).",
            ]
            registrationReport.append(
                "registered client \(registration.clientID) at \(issuer) (kept in \(store.file(for: issuer)))"
                    + (registration.registrationAccessToken != nil ? ", with its registration access token" : ""))
            if registration.secretIgnored {
                registrationReport.append("the provider sent a client secret nobody asked for; it was not kept")
            }
        }

        // 5. The file, with where each value came from.
        var provider = ProviderConfig(name: name)
        provider.issuer = issuer
        provider.clientID = clientID
        provider.scopes = scopes
        provider.redirectPort = redirect.port
        if server.usedCA { provider.caFile = caFile }
        let originNeedsCA = found.usedCA
        let originCAFile = originCA ?? (originNeedsCA ? caFile : nil)
        provenance.provider = [
            "The authorization server \(originURL) names, signed in to as a public client (no client secret)."
        ]
        provenance.issuer = [
            "issuer: from authorization_servers of the protected resource metadata at",
            "\(TargetText.withoutQuery(found.url)); its metadata (\(TargetText.withoutQuery(server.url))) names exactly this issuer.",
        ]
        provenance.scopes = [
            "scopes: openid"
                + (found.challengeScopes != nil
                    ? ", and the scope the origin's challenge asked for"
                    : resource.scopesSupported != nil ? ", and scopes_supported of the resource metadata" : "")
                + (scopes.contains("offline_access") ? ", and offline_access, which the provider supports" : "")
        ]
        provenance.providerCA = ["ca_file: --ca-file, which the provider's certificate needed"]
        provenance.dpop =
            resource.dpopBoundAccessTokensRequired
            ? ["The origin requires DPoP-bound tokens (dpop_bound_access_tokens_required in its metadata)."]
            : ["Tokens bound to a key of yours (RFC 9449; --dpop)."]
        provenance.origin = [
            "The origin init was given; its requests get the token of [provider \(name)]."
        ]
        provenance.resource = [
            "resource: the resource of its metadata, sent as the RFC 8707 resource indicator on the",
            "authorization and token requests, so that its token is for it alone.",
        ]
        provenance.originCA =
            originCA != nil
            ? ["ca_file: --origin-ca-file"] : ["ca_file: --ca-file, which the origin's certificate needed"]
        let listen = chooseListen(replacing: file, context: context)
        let written = configurationText(
            provider: provider, origins: [originURL], dpop: dpop, resolve: arguments.value("resolve"),
            issuer: issuer, listen: listen.address, originCAFile: originCAFile, originResource: resource.resource,
            provenance: provenance)
        let configuration = try writeChecked(written, to: file, context)
        context.err("Wrote \(file):")
        context.err("  issuer \(issuer), as the origin's metadata names it and its own metadata confirms")
        if arguments.value("name") == nil {
            context.err(
                derivedName.isAddress
                    ? "  provider name: \(name) (the issuer's host is an address; --name NAME gives it a name of your choice)"
                    : "  provider name: \(name), from the issuer's domain (--name NAME for another)")
        }
        for line in registrationReport { context.err("  \(line)") }
        context.err("  scopes: \(scopes.joined(separator: " "))")
        context.err("  resource (RFC 8707): \(resource.resource)")
        if dpop { context.err("  DPoP with ES256: tokens will be bound to a key of yours") }
        context.err(
            metadata.deviceAuthorizationEndpoint != nil
                ? "  device flow: offered (proxyctl login --device)"
                : "  device flow: not offered (browser sign-in only)")
        context.err("  sign-in redirect: \(redirect.uri) (redirect_port = \(redirect.port)\(redirect.note))")
        context.err("  proxyctl serve listens on \(listen.address)\(listen.note)")
        context.err(
            "  protected origin \(originURL)"
                + (originCAFile.map { ", its certificate checked against \($0)" } ?? ""))
        if !configuration.origins.tlsHosts.isEmpty {
            guard
                let stateDirectory = configuration.proxy.stateDir
                    ?? TokenStore.defaultStateDirectory(environment: context.environment)
            else { throw CommandFailure(message: "no state directory for the local CA: set HOME or XDG_STATE_HOME") }
            _ = try CACommand.establish(
                hosts: configuration.origins.tlsHosts, files: LocalCA.Files(stateDirectory: stateDirectory),
                force: false, context: context, style: .report)
        }
        let configFlag = arguments.value("config").map { " --config \(EnvCommand.quote($0))" } ?? ""
        if case .given = choice, givenClientID != nil {
            context.err("")
            context.err(
                "Register this redirect URI for client \(clientID) at the provider, exactly as written (many providers compare it character for character):"
            )
            context.err("    \(redirect.uri)")
        }
        context.err("")
        context.err("Next: sign in, then run your tools through the proxy:")
        context.out(
            "proxyctl login\(configFlag)\(metadata.deviceAuthorizationEndpoint != nil ? "    # or --device without a browser" : "")"
        )
        context.out("proxyctl exec\(configFlag) -- curl \(text)")
        return ExitCode.success
    }

    /// "2026-12-04", for the provenance comments.
    static func day(_ epoch: Int64) -> String {
        String(HTTPDate.utcText(epoch).prefix(10))
    }
}
