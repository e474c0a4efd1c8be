import ProxyCore

private let parser = ConfigParser(homeDirectory: "/home/fuzz", baseDirectory: "/etc/proxyctl")

/// What a configuration parse decided, comparable across line endings.
private enum ConfigSummary: Equatable {
    case success(Configuration)
    /// Each error's line and key.
    case failure([ConfigError])
}

public func fuzzConfig(_ data: UnsafeBufferPointer<UInt8>) {
    let raw = Array(data)
    let config = text(raw)
    let lineCount = config.utf8.filter { $0 == 0x0A }.count + 1

    let summary = checkConfig(config, lineCount: lineCount)
    checkINI(config, lineCount: lineCount)
    let credentials = checkCredentials(config, lineCount: lineCount)

    // The same file saved with CRLF line endings means the same thing.
    if !config.utf8.contains(0x0D) {
        let crlf = String(decoding: config.utf8.flatMap { $0 == 0x0A ? [0x0D, 0x0A] : [$0] }, as: UTF8.self)
        let again = checkConfig(crlf, lineCount: lineCount)
        invariant(
            again == summary,
            "proxy.conf means something else with CRLF line endings:\n  LF:   \(summary)\n  CRLF: \(again)")
        let credentialsAgain = checkCredentials(crlf, lineCount: lineCount)
        invariant(
            credentialsAgain == credentials,
            "the user file means something else with CRLF line endings:\n  LF:   \(credentials)\n  CRLF: \(credentialsAgain)"
        )
    }
}

private func checkConfig(_ config: String, lineCount: Int) -> ConfigSummary {
    switch parser.parse(config, file: "fuzz.conf") {
    case .success(let parsed):
        invariant(parsed.source == "fuzz.conf", "configuration source")
        let proxy = parsed.proxy
        invariant(
            ListenAddress.parse(proxy.listen.description) == proxy.listen,
            "listen address \(proxy.listen) does not parse back")
        invariant(
            proxy.listen.isLoopback || proxy.proxyAuthFile != nil,
            "reachable from other machines without authentication")
        if let upstream = proxy.upstreamProxy {
            checkAuthority(upstream.address)
            switch UpstreamProxy.parse(upstream.description) {
            case .success(let again):
                invariant(
                    again.address == upstream.address && again.username == nil,
                    "upstream proxy \(upstream) does not parse back")
            case .failure(let error):
                invariant(false, "upstream proxy \(upstream) does not parse back: \(error)")
            }
        }
        invariant(
            proxy.connectTimeout > 0 && proxy.idleTimeout > 0 && proxy.keepAliveTimeout > 0 && proxy.headerTimeout > 0,
            "a timeout of zero")
        invariant(proxy.shutdownGrace >= 0, "negative shutdown grace")
        invariant((256...(1 << 20)).contains(proxy.headLimits.maxStartLine), "max_request_line out of range")
        invariant((1024...(16 << 20)).contains(proxy.headLimits.maxHeadBytes), "max_header_bytes out of range")
        invariant((8...10_000).contains(proxy.headLimits.maxFields), "max_headers out of range")
        invariant(proxy.maxConnections.map { (1...1_000_000).contains($0) } ?? true, "max_connections out of range")
        invariant((0...(1 << 30)).contains(proxy.replayMemory), "replay_memory out of range")
        invariant((0...(1 << 40)).contains(proxy.replaySpool), "replay_spool out of range")
        for (host, address) in proxy.resolve {
            guard case .success(let parsedHost) = HostPort.parse(host[...], defaultPort: 1) else {
                invariant(false, "resolve host \(host.debugDescription)")
                continue
            }
            invariant(parsedHost.kind == .name && parsedHost.host == host, "resolve host \(host) is not normalised")
            invariant(IPAddress.parse(address) != nil, "resolve address \(address.debugDescription)")
        }
        if let words = proxy.notifyCommand {
            invariant(
                !words.isEmpty && words.allSatisfy { !$0.isEmpty && !$0.contains(" ") }, "notify_command \(words)")
        }
        checkProviders(parsed.providers)
        checkOrigins(parsed.origins, providers: parsed.providers)
        return .success(parsed)
    case .failure(let errors):
        invariant(!errors.errors.isEmpty, "failure without errors")
        var previous = 0
        for error in errors.errors {
            invariant(error.file == "fuzz.conf", "error in file \(error.file)")
            if let line = error.line {
                invariant((1...lineCount).contains(line), "error on line \(line) of \(lineCount): \(error)")
                invariant(line >= previous, "errors not in line order")
                previous = line
            }
            invariant(!error.description.isEmpty, "empty error message")
        }
        return .failure(errors.errors)
    }
}

/// Authorization parameters that `param.NAME` must not override.
private let reservedParameters: Set<String> = [
    "client_id", "response_type", "redirect_uri", "scope", "state", "nonce", "code_challenge",
    "code_challenge_method", "request_uri", "dpop_jkt", "client_secret",
]

private func checkProviders(_ providers: [ProviderConfig]) {
    var names = Set<String>()
    for provider in providers {
        invariant(names.insert(provider.name).inserted, "provider \(provider.name) twice")
        invariant(
            !provider.name.isEmpty && provider.name.count <= 64 && !provider.name.hasPrefix(".")
                && provider.name.utf8.allSatisfy {
                    ($0 >= 0x30 && $0 <= 0x39) || ($0 | 0x20 >= 0x61 && $0 | 0x20 <= 0x7A) || $0 == 0x2D || $0 == 0x5F
                        || $0 == 0x2E
                }, "provider name \(provider.name.debugDescription)")
        invariant(ProviderConfig.checkIssuer(provider.issuer) == nil, "issuer \(provider.issuer.debugDescription)")
        invariant(!provider.clientID.isEmpty, "empty client_id")
        invariant(provider.scopes.first == "openid", "scopes \(provider.scopes) do not start with openid")
        invariant(Set(provider.scopes).count == provider.scopes.count, "scopes \(provider.scopes) repeat")
        invariant(provider.scopes.allSatisfy { !$0.isEmpty && !$0.contains(" ") }, "scopes \(provider.scopes)")
        invariant((0...65535).contains(provider.redirectPort), "redirect_port \(provider.redirectPort)")
        invariant(
            provider.redirectPath.hasPrefix("/") && !provider.redirectPath.contains("?")
                && !provider.redirectPath.contains("#")
                && provider.redirectPath.utf8.allSatisfy { $0 > 0x20 && $0 < 0x7F },
            "redirect_path \(provider.redirectPath.debugDescription)")
        invariant(provider.resources.allSatisfy { $0.contains("://") }, "resource \(provider.resources)")
        for (name, _) in provider.extraParameters {
            invariant(!reservedParameters.contains(name), "param.\(name) overrides what proxyctl sets")
            invariant(!name.isEmpty, "param. without a name")
        }
        invariant(provider.loginTimeout > 0, "login_timeout \(provider.loginTimeout)")
        invariant(!provider.dpopRequired || provider.tokenBinding == .dpop, "dpop_required without dpop")
        invariant(provider.acrValues != "" && provider.loginHint != "", "an empty acr_values or login_hint kept")
    }
}

/// Every origin is normalised, reachable through the table, names a configured provider, and is https with
/// a host name or loopback http; a wildcard section covers the hosts below its domain (not the domain), unless a
/// more specific section does, and its domain's subtree is in tlsHosts.
private func checkOrigins(_ origins: OriginTable, providers: [ProviderConfig]) {
    var keys = Set<String>()
    for origin in origins.origins {
        invariant(keys.insert(origin.url).inserted, "origin \(origin.url) twice")
        if origin.isWildcard {
            checkWildcard(origin, in: origins)
        } else {
            invariant(
                origins.match(scheme: origin.scheme, authority: origin.authority) == origin, "\(origin.url) not found")
        }
        invariant(providers.contains { $0.name == origin.provider }, "\(origin.url) names no provider")
        checkAuthority(origin.authority)
        switch OriginConfig.parseURL(origin.url) {
        case .success(let again):
            invariant(
                again.scheme == origin.scheme && again.authority == origin.authority
                    && again.isWildcard == origin.isWildcard,
                "\(origin.url) parses back as \(again.url)")
        case .failure(let error):
            invariant(false, "\(origin.url) does not parse back: \(error.message)")
        }
        switch origin.scheme {
        case "https":
            invariant(origin.authority.kind == .name, "https origin \(origin.url) without a host name")
            invariant(
                origins.tlsHosts.contains((origin.isWildcard ? "." : "") + origin.authority.host),
                "\(origin.url) missing from tlsHosts")
            // The CA's constraints permit an exact host, and never a wildcard's domain itself unless another https
            // section names it or a name above it (whose subtree the constraints then permit).
            let host = origin.authority.host
            let permitted = NameConstraints.exactly(origins.tlsHosts).permits(dnsName: host)
            let above = origins.origins.contains {
                $0.scheme == "https" && $0 != origin
                    && (host == $0.authority.host || host.hasSuffix("." + $0.authority.host))
            }
            invariant(
                origin.isWildcard ? (!permitted || above) : permitted,
                "the CA's constraints and \(origin.url) disagree about \(host)")
        case "http":
            let host = origin.authority.host
            invariant(
                host == "localhost" || (IPAddress.parse(host)?.isLoopback ?? false), "http origin \(origin.url)")
        default:
            invariant(false, "origin scheme \(origin.scheme)")
        }
    }
}

private func checkWildcard(_ wildcard: OriginConfig, in origins: OriginTable) {
    let domain = wildcard.authority
    invariant(wildcard.scheme == "https" && domain.kind == .name, "wildcard \(wildcard.url)")
    invariant(domain.host.split(separator: ".").count >= 2 && !domain.host.contains("*"), "domain \(domain.host)")
    invariant(wildcard.url.hasPrefix("https://*."), "wildcard URL \(wildcard.url)")
    let constraints = NameConstraints.exactly(origins.tlsHosts)
    for label in ["a", "x.y", "*"] {
        let host = HostPort(host: "\(label).\(domain.host)", port: domain.port, kind: .name)
        let found = origins.match(scheme: "https", authority: host)
        if label == "*" {
            invariant(found == nil, "\(host) matched \(String(describing: found?.url))")
            continue
        }
        guard let found else { return invariant(false, "\(host) not covered by \(wildcard.url)") }
        invariant(found.authority == host && !found.isWildcard, "\(host) matched as \(found.url)")
        invariant(constraints.permits(dnsName: host.host), "the CA's constraints refuse \(host.host)")
        if found.pattern == wildcard.url {
            invariant(found.provider == wildcard.provider, "\(host) got another provider")
        }
        invariant(found.resource?.contains("*") != true, "\(host)'s resource \(found.resource ?? "")")
        if let pattern = found.pattern {
            // The most specific wildcard section covering the host.
            let covering = origins.origins.filter {
                $0.isWildcard && $0.covers(host: host.host, kind: .name)
                    && $0.authority.port == host.port
            }
            let best = covering.max { $0.authority.host.utf8.count < $1.authority.host.utf8.count }
            invariant(best?.url == pattern, "\(host) got \(pattern), not \(best?.url ?? "none")")
        } else {
            invariant(origins.origins.contains { $0 == found }, "\(host) got a section that is not one")
        }
    }
    invariant(
        origins.match(scheme: "https", authority: HostPort(host: domain.host, port: domain.port, kind: .name))?.pattern
            != wildcard.url, "\(wildcard.url) covers its own domain")
}

private func checkINI(_ config: String, lineCount: Int) {
    let (document, errors) = INIDocument.parse(config, file: "fuzz.conf")
    var previous = 0
    for section in document.sections {
        invariant(section.line > previous && section.line <= lineCount, "section on line \(section.line)")
        previous = section.line
        var keys = Set<String>()
        for entry in section.entries {
            invariant(entry.line > previous && entry.line <= lineCount, "entry on line \(entry.line)")
            previous = entry.line
            invariant(keys.insert(entry.key).inserted, "key \(entry.key) twice in one section")
            invariant(!entry.key.isEmpty && entry.key.allSatisfy(\.isASCII), "key \(entry.key.debugDescription)")
        }
    }
    for error in errors {
        invariant(error.line.map { (1...lineCount).contains($0) } ?? false, "syntax error without a line in range")
    }
}

/// What a user file decided, comparable across line endings.
private enum CredentialsSummary: Equatable {
    case success(ProxyCredentials)
    case failure(line: Int?)
}

/// `ProxyCredentials.parse` on the same text: errors name a line in range, and every user line it accepted
/// lets that user in with that password (RFC 7617: the user ends at the first colon).
private func checkCredentials(_ config: String, lineCount: Int) -> CredentialsSummary {
    switch ProxyCredentials.parse(config, file: "users") {
    case .failure(let error):
        invariant(
            error.line.map { (1...lineCount).contains($0) } ?? true,
            "user file error on line \(error.line!) of \(lineCount)")
        return .failure(line: error.line)
    case .success(let credentials):
        invariant(credentials.count >= 1, "no users")
        var users = 0
        for rawLine in Array(config.utf8).split(separator: 0x0A, omittingEmptySubsequences: false) {
            var line = rawLine[...]
            if line.last == 0x0D { line = line.dropLast() }
            // "pw\r\r\n": the parser takes "\r\n" as the line end and then drops one more CR; not checked.
            if line.last == 0x0D { continue }
            if line.allSatisfy({ $0 == 0x20 || $0 == 0x09 }) || line.first == UInt8(ascii: "#") { continue }
            guard let colon = line.firstIndex(of: UInt8(ascii: ":")), colon > line.startIndex, colon + 1 < line.endIndex
            else { continue }
            users += 1
            let user = text(Array(line[..<colon]))
            let header = "Basic " + Base64.encode(line)
            invariant(
                credentials.check(header) == .allowed(user: user),
                "user \(user.debugDescription) from the file is not let in: \(credentials.check(header))")
            var wrong = Array(line)
            wrong[wrong.count - 1] ^= 0x01
            invariant(
                credentials.check("Basic " + Base64.encode(wrong)) != .allowed(user: user),
                "a wrong password lets \(user.debugDescription) in")
        }
        // Not equal: a line that starts with "#" and a combining mark is not a comment to the parser.
        invariant(users <= credentials.count, "\(credentials.count) users parsed from \(users) user lines")
        return .success(credentials)
    }
}
