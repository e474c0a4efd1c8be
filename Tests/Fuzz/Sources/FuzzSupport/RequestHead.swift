import ProxyCore

/// The front doors every parsed request goes through: the default settings (loopback, no credentials, no
/// upstream proxy) and a locked-down one (credentials, an upstream proxy with its own credentials, a bypass
/// list, listening on every address).
let frontDoors: [FrontDoor] = {
    let plain = FrontDoor(settings: ProxySettings(), credentials: nil, boundAddress: .default)
    var settings = ProxySettings()
    settings.listen = ListenAddress(host: "0.0.0.0", port: 3128, isIPv6: false)
    settings.upstreamProxy = try! UpstreamProxy.parse("http://corp%40user:p%3Ass@proxy.corp.example:3128").get()
    settings.noUpstreamProxy = try! BypassList.parse("localhost, .internal.example, 10.0.0.0/8, fd00::/8").get()
    settings.proxyAuthFile = "/dev/null"
    let credentials = try! ProxyCredentials.parse("alice:secret\nbob:hunter2\n", file: "users").get()
    let guarded = FrontDoor(settings: settings, credentials: credentials, boundAddress: settings.listen)
    let intercepting = FrontDoor(
        settings: ProxySettings(), credentials: nil, boundAddress: .default, origins: protectedOrigins)
    return [plain, guarded, intercepting]
}()

/// Protected origins for the intercepting front door: https ones (CONNECT is intercepted) and loopback http
/// ones (absolute-form requests are intercepted), with both `client_authorization` policies.
let protectedOrigins: OriginTable = {
    func origin(_ url: String, _ policy: ClientAuthorizationPolicy) -> OriginConfig {
        var origin = try! OriginConfig.parseURL(url).get()
        origin.provider = "corp"
        origin.clientAuthorization = policy
        return origin
    }
    return OriginTable([
        origin("https://api.example.com", .replace),
        origin("https://git.example.com:8443", .keep),
        origin("http://127.0.0.1:8000", .replace),
        origin("http://[::1]:8080", .keep),
        origin("http://localhost", .replace),
    ])
}()

/// Fields a forwarded request must never carry to the next hop (RFC 9110 §7.6.1), whatever the client sent.
private let neverForwarded: [StaticString] = ["proxy-connection", "keep-alive", "te"]

public func fuzzHTTPRequestHead(_ data: UnsafeBufferPointer<UInt8>) {
    let input = Array(data)
    let defaults = HTTPHeadLimits()
    let run = parseAllWays(input, kind: .request, limits: defaults, splits: [.mixed(salt: 1), .tiny(salt: 2)])
    let tight = tightLimits(input)
    let tightRun = parseAllWays(input, kind: .request, limits: tight, splits: [.mixed(salt: 3)])
    for found in tightRun.heads {
        checkHeadStructure(found, kind: .request, limits: tight, input: input)
    }
    for found in run.heads {
        checkHeadStructure(found, kind: .request, limits: defaults, input: input)
        checkRequest(found.head)
    }
}

func checkRequest(_ head: HTTPHead) {
    let semantics = MessageSemantics.request(head)
    if case .success(let checked) = semantics {
        checkRequestSemantics(head, checked)
    }
    for door in frontDoors {
        checkDecision(door.decide(head), door: door, head: head, semantics: semantics)
    }
    for door in adminDoors { checkAdminRoute(door.route(head), door: door, head: head) }
}

/// The admin listener on loopback, on every address with a name of admin_hosts, and on one address.
private let adminDoors = [
    AdminDoor(bound: ListenAddress(host: "127.0.0.1", port: 9464, isIPv6: false)),
    AdminDoor(bound: ListenAddress(host: "0.0.0.0", port: 9464, isIPv6: false), names: ["proxyctl"]),
    AdminDoor(bound: ListenAddress(host: "10.1.2.3", port: 9464, isIPv6: false)),
]

/// The admin listener serves its endpoints only to GET and HEAD requests with one Host (or none in HTTP/1.0)
/// that names its own address: never a host name but localhost and admin_hosts (DNS rebinding).
private func checkAdminRoute(_ route: AdminDoor.Route, door: AdminDoor, head: HTTPHead) {
    guard case .answer = route else {
        invariant(head.method == "GET" || head.method == "HEAD", "admin served \(head.method)")
        let hosts = head.indices(named: "host")
        invariant(hosts.count == 1 || (hosts.isEmpty && head.version == .http1_0), "admin served \(hosts.count) Hosts")
        if let index = hosts.first {
            switch HostPort.parse(head.value(at: index)[...], defaultPort: 80) {
            case .success(let authority):
                invariant(
                    authority.kind != .name || authority.host == "localhost" || door.names.contains(authority.host),
                    "admin served Host \(authority.host.debugDescription)")
            case .failure:
                invariant(false, "admin served an unreadable Host \(head.value(at: index).debugDescription)")
            }
        }
        return
    }
}

private func checkRequestSemantics(_ head: HTTPHead, _ semantics: RequestSemantics) {
    invariant(semantics.dropped.allSatisfy(head.fields.indices.contains), "dropped index out of range")
    invariant(head.indices(named: "host").count <= 1, "accepted more than one Host")
    if let index = semantics.proxyAuthorization {
        invariant(head.field(index, isNamed: "proxy-authorization"), "proxyAuthorization is another field")
        invariant(semantics.dropped.contains(index), "Proxy-Authorization would be forwarded")
    }
    for name in neverForwarded {
        for index in head.indices(named: name) {
            invariant(semantics.dropped.contains(index), "\(name) would be forwarded")
        }
    }

    // The framing the proxy follows is the framing the raw bytes give a server downstream.
    let codings = rawListElements(head, "transfer-encoding")
    let lengths = head.indices(named: "content-length")
    switch semantics.framing {
    case .chunked:
        invariant(
            codings.last == bytes("chunked"),
            "chunked framing, but the last coding on the wire is \(codings.last.map(text) ?? "none")")
        invariant(codings.filter { $0 == bytes("chunked") }.count == 1, "chunked framing with chunked applied twice")
        invariant(lengths.isEmpty, "chunked framing with a Content-Length")
    case .contentLength(let length):
        invariant(length > 0, "Content-Length framing of zero bytes")
        invariant(head.indices(named: "transfer-encoding").isEmpty, "Content-Length framing with a Transfer-Encoding")
        for index in lengths {
            for element in head.value(at: index).split(separator: ",", omittingEmptySubsequences: false) {
                let digits = element.utf8.filter { $0 != 0x20 && $0 != 0x09 }
                invariant(
                    UInt64(text(digits)) == length,
                    "Content-Length element \(element.debugDescription) is not \(length)")
            }
        }
    case .none:
        invariant(head.indices(named: "transfer-encoding").isEmpty, "no framing despite a Transfer-Encoding")
        for index in lengths {
            invariant(
                head.value(at: index).utf8.allSatisfy {
                    $0 == UInt8(ascii: "0") || $0 == 0x20 || $0 == 0x09 || $0 == UInt8(ascii: ",")
                }, "no framing despite a Content-Length")
        }
    case .untilClose:
        invariant(false, "a request framed until close")
    }

    let options = rawListElements(head, "connection")
    invariant(
        semantics.keepAlive == (head.version == .http1_1 && !options.contains(bytes("close"))),
        "keepAlive \(semantics.keepAlive) disagrees with Connection on the wire")
    invariant(
        semantics.upgrade == (options.contains(bytes("upgrade")) && !head.indices(named: "upgrade").isEmpty),
        "upgrade \(semantics.upgrade) disagrees with Connection on the wire")

    switch semantics.target {
    case .connect(let authority):
        invariant(head.method == "CONNECT", "connect target for \(head.method)")
        invariant(semantics.framing == .none, "CONNECT with a body")
        checkAuthority(authority)
    case .absolute(let url):
        invariant(head.method != "CONNECT", "absolute target for CONNECT")
        invariant(url.scheme == "http" || url.scheme == "https", "scheme \(url.scheme)")
        invariant(
            url.pathAndQuery.utf8.first == UInt8(ascii: "/"),
            "origin-form \(url.pathAndQuery.debugDescription) without a slash")
        checkAuthority(url.authority)
    case .notProxyRequest:
        invariant(
            head.target.utf8.first == UInt8(ascii: "/") || head.target == "*",
            "not a proxy request: \(head.target.debugDescription)")
    }
}

private func checkDecision(
    _ decision: FrontDoorDecision, door: FrontDoor, head: HTTPHead, semantics: Result<RequestSemantics, HTTPParseError>
) {
    switch decision {
    case .respond(let answer):
        // With a body; the answer to HEAD is the same head without it.
        let response = answer.response
        let out = response.serialized()
        var parser = HTTPHeadParser(kind: .response, limits: generousLimits)
        guard case .complete(let responseHead, let consumed) = parser.parse(out) else {
            return invariant(false, "the proxy's own \(response.status) response does not parse")
        }
        invariant(responseHead.status == response.status, "the proxy's response has another status")
        invariant(
            response.serialized(headRequest: true) == Array(out[..<consumed]), "the answer to HEAD is another head")
        switch MessageSemantics.response(responseHead, requestMethod: "GET", upgradeRequested: false) {
        case .success(let checked):
            invariant(
                checked.framing == .contentLength(UInt64(out.count - consumed)), "the proxy's response body length")
        case .failure(let error):
            invariant(false, "the proxy's own response is invalid: \(error)")
        }
        if case .failure(let error) = semantics {
            invariant(response.status == error.status, "rejected with \(response.status), not \(error.status)")
        }
    case .tunnel(let target, let upstream):
        guard case .success(let checked) = semantics, case .connect(let authority) = checked.target else {
            return invariant(false, "tunnel for a request that is not a valid CONNECT")
        }
        invariant(authority == target, "tunnel to \(target), asked for \(authority)")
        invariant(upstream == nil || upstream == door.settings.upstreamProxy, "tunnel through an unknown upstream")
        invariant(
            door.origins.match(scheme: "https", authority: target) == nil, "blind tunnel to protected origin \(target)")
    case .forward(let forward):
        guard case .success(let checked) = semantics, case .absolute(let url) = checked.target else {
            return invariant(false, "forward for a request without an absolute target")
        }
        invariant(url == forward.url && url.scheme == "http", "forwarded to \(forward.url), asked for \(url)")
        invariant(forward.framing == checked.framing, "forwarded framing differs")
        invariant(
            door.origins.match(scheme: "http", authority: url.authority) == nil,
            "request to protected origin \(url.authority) forwarded without interception")
        checkForwardedHead(forward, original: head, door: door)
    case .interceptTunnel(let origin):
        guard case .success(let checked) = semantics, case .connect(let authority) = checked.target else {
            return invariant(false, "interceptTunnel for a request that is not a valid CONNECT")
        }
        checkConfiguredOrigin(origin, door: door, scheme: "https", authority: authority)
    case .interceptRequest(let origin, let request):
        guard case .success(let checked) = semantics, case .absolute(let url) = checked.target else {
            return invariant(false, "interceptRequest for a request without an absolute target")
        }
        invariant(url.scheme == "http", "interceptRequest for \(url.scheme)")
        checkConfiguredOrigin(origin, door: door, scheme: "http", authority: url.authority)
        let attached = origin.clientAuthorization == .replace || !request.clientAuthorization
        checkInterceptedRequest(request, head: head, scheme: "http", origin: origin.authority, attached: attached)
    }
}

/// Interception happens exactly for the configured origins: same scheme, same normalised host, same port.
private func checkConfiguredOrigin(_ origin: OriginConfig, door: FrontDoor, scheme: String, authority: HostPort) {
    invariant(
        door.origins.origins.contains { $0 == origin }, "intercepted for \(origin.url), which is not configured")
    invariant(
        origin.scheme == scheme && origin.authority.host == authority.host && origin.authority.port == authority.port
            && origin.authority.kind == authority.kind,
        "intercepted \(scheme)://\(authority) as origin \(origin.url)")
}

/// The head sent on must be a valid request with the same framing, one Host naming the target, and no
/// hop-by-hop fields or client credentials.
private func checkForwardedHead(_ forward: FrontDoorDecision.Forward, original: HTTPHead, door: FrontDoor) {
    var parser = HTTPHeadParser(kind: .request, limits: generousLimits)
    guard case .complete(let sent, let consumed) = parser.parse(forward.head) else {
        return invariant(
            false, "the forwarded head does not parse: \(text(Array(forward.head.prefix(200))).debugDescription)")
    }
    invariant(consumed == forward.head.count, "the forwarded head has trailing bytes")
    invariant(sent.method == original.method && sent.version == original.version, "forwarded method or version changed")
    let direct = forward.upstream == nil
    invariant(
        sent.target == (direct ? forward.url.pathAndQuery : original.target),
        "forwarded target \(sent.target.debugDescription)")

    let hosts = sent.indices(named: "host")
    invariant(hosts.count == 1, "forwarded head has \(hosts.count) Host fields")
    if let host = hosts.first {
        // RFC 9110 §7.2: a Host without a port names the scheme's default port.
        let schemePort = forward.url.scheme == "https" ? 443 : 80
        switch HostPort.parse(sent.value(at: host)[...], defaultPort: schemePort) {
        case .success(let authority):
            invariant(
                authority == forward.url.authority,
                "forwarded Host \(sent.value(at: host).debugDescription) is not \(forward.url.authority)")
        case .failure(let error):
            invariant(false, "forwarded Host does not parse: \(error)")
        }
    }

    for name in neverForwarded {
        invariant(sent.indices(named: name).isEmpty, "forwarded head carries \(name)")
    }
    let proxyAuthorizations = sent.indices(named: "proxy-authorization")
    if direct {
        invariant(proxyAuthorizations.isEmpty, "client credentials forwarded to the origin")
    } else {
        invariant(
            proxyAuthorizations.count == 1 && sent.value(at: proxyAuthorizations[0]) == forward.upstream?.authorization,
            "forwarded head does not carry exactly the upstream proxy's credentials")
    }
    if !forward.upgrade {
        invariant(sent.indices(named: "connection").isEmpty, "Connection forwarded without an upgrade")
        invariant(sent.indices(named: "upgrade").isEmpty, "Upgrade forwarded without an upgrade")
    }

    switch MessageSemantics.request(sent) {
    case .success(let again):
        invariant(again.framing == forward.framing, "the forwarded head has another framing")
        if direct {
            invariant(again.target == .notProxyRequest, "direct request not in origin-form")
        } else {
            invariant(again.target == .absolute(forward.url), "upstream request names another URL")
        }
    case .failure(let error):
        invariant(false, "the forwarded head is not a valid request: \(error)")
    }
}

/// A parsed authority is normalised.
func checkAuthority(_ authority: HostPort) {
    invariant((1...65535).contains(authority.port), "port \(authority.port)")
    invariant(!authority.host.isEmpty, "empty host")
    invariant(!authority.host.utf8.contains { $0 >= 0x41 && $0 <= 0x5A }, "host \(authority.host) not lower-case")
    switch authority.kind {
    case .ipv4:
        guard case .v4 = IPAddress.parse(authority.host) else { return invariant(false, "ipv4 host \(authority.host)") }
    case .ipv6:
        guard case .v6 = IPAddress.parse(authority.host) else { return invariant(false, "ipv6 host \(authority.host)") }
    case .name:
        invariant(!authority.host.contains(":"), "name with a colon")
    }
}
