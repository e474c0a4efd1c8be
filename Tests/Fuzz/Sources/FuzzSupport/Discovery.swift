import ProxyCore

/// What an origin and an authorization server publish, as `proxyctl init --origin` and `serve` read it: each line
/// of the input as a URL through `MetadataURL` (the rules of every fetch, redirect and browser start), and the input
/// as JSON through `ProtectedResourceMetadata` (RFC 9728), `ResourceMetadataVerdict` and `ClientRegistration`
/// (RFC 7591). Nothing accepted may break the rules the decisions rely on.
public func fuzzDiscovery(_ data: UnsafeBufferPointer<UInt8>) {
    let input = Array(data)
    for line in input.split(separator: 0x0A, omittingEmptySubsequences: true).prefix(8) {
        checkURL(String(decoding: line, as: UTF8.self))
    }
    guard case .success(let json) = JSON.parse(input) else { return }
    checkResourceMetadata(json)
    checkRegistration(json)
}

private let uriCharacters = Set(Array("-._~:/?#[]@!$&'()*+,;=%".utf8))

/// RFC 3986 §2, read independently of `MetadataURL.isURICharacter`.
private func isURIByte(_ byte: UInt8) -> Bool {
    (byte >= 0x30 && byte <= 0x39) || (byte | 0x20 >= 0x61 && byte | 0x20 <= 0x7A) || uriCharacters.contains(byte)
}

private func isLoopbackHost(_ host: String) -> Bool {
    host == "localhost" || (IPAddress.parse(host)?.isLoopback ?? false)
}

private func checkURL(_ text: String) {
    let problem = MetadataURL.problem(text, allowQuery: true)
    if !text.utf8.allSatisfy(isURIByte) || text.contains("#") {
        invariant(problem != nil, "\(text.debugDescription) accepted with a byte no URL holds")
    }
    if problem == nil {
        guard case .success(let url) = AbsoluteURL.parse(text) else {
            return invariant(false, "\(text.debugDescription) accepted but does not parse")
        }
        invariant(
            url.scheme == "https" || (url.scheme == "http" && isLoopbackHost(url.authority.host)),
            "\(text.debugDescription) accepted: \(url.scheme) to \(url.authority.host)")
        let lowered = text.lowercased()
        invariant(lowered.hasPrefix("https://") || lowered.hasPrefix("http://"), "\(text.debugDescription) accepted")
        // Its well-known metadata URL is on its origin and follows the same rules.
        let wellKnown = ProtectedResourceMetadata.wellKnownURL(for: url)
        invariant(
            MetadataURL.problem(wellKnown, allowQuery: true) == nil && MetadataURL.sameOrigin(wellKnown, text),
            "the well-known URL of \(text.debugDescription) is \(wellKnown.debugDescription)")
        invariant(ProtectedResourceMetadata.matches(text, url), "\(text.debugDescription) does not match itself")
    }
    invariant((MetadataURL.browserProblem(text) == nil) == (problem == nil), "a browser URL by other rules")
    if MetadataURL.problem(text, allowQuery: false) == nil {
        invariant(problem == nil && !text.contains("?"), "\(text.debugDescription) without a query by other rules")
    }
    // A redirect goes nowhere but the origin it came from.
    for base in ["https://api.example.com/.well-known/oauth-protected-resource", "http://127.0.0.1:8/a?b"] {
        if case .success(let target) = MetadataURL.redirect(from: base, to: text) {
            invariant(
                MetadataURL.sameOrigin(target, base) && MetadataURL.problem(target, allowQuery: true) == nil,
                "a redirect from \(base) to \(text.debugDescription) goes to \(target.debugDescription)")
        }
    }
    if let scopes = ScopeText.split(text) {
        invariant(!scopes.isEmpty && scopes.allSatisfy(ScopeText.isScopeToken), "scopes \(scopes)")
        invariant(!text.contains("\"") && !text.contains("\\"), "a scope with a quote: \(text.debugDescription)")
    }
}

private func checkResourceMetadata(_ json: JSONValue) {
    guard case .success(let metadata) = ProtectedResourceMetadata.parse(json) else { return }
    invariant(MetadataURL.problem(metadata.resource, allowQuery: true) == nil, "resource \(metadata.resource)")
    let servers = metadata.authorizationServers
    invariant(!servers.isEmpty && servers.count <= 16, "\(servers.count) authorization servers")
    invariant(Set(servers).count == servers.count, "an authorization server twice")
    for server in servers {
        invariant(
            ProviderConfig.checkIssuer(server) == nil && MetadataURL.problem(server, allowQuery: false) == nil,
            "authorization server \(server.debugDescription)")
        invariant(
            (try? metadata.chooseAuthorizationServer(named: server).get()) == server, "\(server) cannot be chosen")
    }
    if case .success(let chosen) = metadata.chooseAuthorizationServer(named: nil) {
        invariant(servers == [chosen], "\(chosen) chosen among \(servers) without the user")
    } else {
        invariant(servers.count > 1, "the one server was not chosen")
    }
    invariant(
        (try? metadata.chooseAuthorizationServer(named: "https://not-listed.invalid").get()) == nil,
        "an unlisted server chosen")
    for scope in metadata.scopesSupported ?? [] {
        invariant(ScopeText.isScopeToken(scope), "scope \(scope.debugDescription)")
    }
    if let name = metadata.resourceName {
        invariant(name.utf8.allSatisfy { $0 >= 0x20 && $0 < 0x7F }, "resource_name \(name.debugDescription)")
    }
    // The verdict serve reaches: on the resource's own origin, the provider's issuer is listed or it is not.
    guard case .success(let resource) = AbsoluteURL.parse(metadata.resource) else {
        return invariant(false, "resource \(metadata.resource) does not parse")
    }
    let origin = "\(resource.scheme)://\(resource.hostFieldValue)"
    invariant(
        ResourceMetadataVerdict.judge(json, origin: origin, issuer: servers[0]) == .consistent,
        "its own first server is another")
    invariant(
        ResourceMetadataVerdict.judge(json, origin: origin, issuer: "https://not-listed.invalid")
            == .otherServers(servers), "an unlisted issuer is not another")
    if case .consistent = ResourceMetadataVerdict.judge(json, origin: "https://elsewhere.invalid", issuer: servers[0]) {
        invariant(origin == "https://elsewhere.invalid", "metadata for another origin judged consistent")
    }
}

private let request = ClientRegistrationRequest(
    redirectURI: "http://127.0.0.1:17755/callback", device: true, scopes: ["openid", "api"], dpopBound: true)

private func checkRegistration(_ json: JSONValue) {
    guard
        case .success(let registration) = ClientRegistration.parse(
            json, issuer: "https://as.example", request: request, now: 1_700_000_000)
    else { return }
    invariant(
        ClientRegistration.isClientID(registration.clientID), "client_id \(registration.clientID.debugDescription)")
    invariant(
        !registration.clientID.contains(" ") && !registration.clientID.contains("\n"), "a client_id proxy.conf splits")
    invariant(registration.redirectURIs.contains(request.redirectURI), "registered without proxyctl's redirect URI")
    invariant(registration.grantTypes.contains("authorization_code"), "registered without the code grant")
    if let token = registration.registrationAccessToken {
        invariant(!token.isEmpty && token.utf8.allSatisfy { $0 > 0x20 && $0 < 0x7F }, "registration_access_token")
    }
    if let uri = registration.registrationClientURI {
        invariant(MetadataURL.problem(uri, allowQuery: true) == nil, "registration_client_uri \(uri)")
    }
    // What is kept holds no secret and reads back as itself.
    invariant(registration.stored["client_secret"] == nil, "a client secret kept")
    var expected = registration
    expected.secretIgnored = false
    invariant(ClientRegistration(stored: registration.stored) == expected, "the kept registration reads back otherwise")
    invariant(ClientRegistration(stored: registration.stored)?.redirectPort != nil, "no redirect port kept")
}
