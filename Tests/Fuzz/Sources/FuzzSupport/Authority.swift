import ProxyCore

#if canImport(Glibc)
    import Glibc
#endif

private let credentials = try! ProxyCredentials.parse("alice:secret\nbob:hunter2\n", file: "users").get()

public func fuzzAuthority(_ data: UnsafeBufferPointer<UInt8>) {
    let raw = Array(data)
    let input = text(raw)
    checkHostPort(input)
    checkURL(input)
    checkOriginPattern(input)
    checkWebOrigin(raw)
    checkIPAddress(input)
    checkCIDR(input, raw)
    checkBase64(input, raw)
    checkValues(input)
}

private func checkHostPort(_ input: String) {
    for defaultPort in [nil, 80] as [Int?] {
        guard case .success(let authority) = HostPort.parse(input[...], defaultPort: defaultPort) else { continue }
        checkAuthority(authority)
        // description is the CONNECT form and parses back to the same authority.
        switch HostPort.parse(authority.description[...], defaultPort: nil) {
        case .success(let again):
            invariant(again == authority, "\(authority) (\(authority.kind)) parses back as \(again) (\(again.kind))")
        case .failure(let error):
            invariant(false, "\(authority) does not parse back: \(error)")
        }
    }
}

private func checkURL(_ input: String) {
    guard case .success(let url) = AbsoluteURL.parse(input) else { return }
    checkAuthority(url.authority)
    invariant(url.scheme == "http" || url.scheme == "https", "scheme \(url.scheme)")
    // On the bytes: "/" followed by a combining mark is one Character, and hasPrefix("/") would be false.
    invariant(url.pathAndQuery.utf8.first == UInt8(ascii: "/"), "origin-form \(url.pathAndQuery.debugDescription)")
    invariant(!url.pathAndQuery.utf8.contains(UInt8(ascii: "#")), "fragment in \(url.pathAndQuery.debugDescription)")
    let rebuilt = "\(url.scheme)://\(url.hostFieldValue)\(url.pathAndQuery)"
    switch AbsoluteURL.parse(rebuilt) {
    case .success(let again):
        // Byte for byte: String's == would call "é" and "e\u{301}" equal.
        invariant(
            again == url && Array(again.pathAndQuery.utf8) == Array(url.pathAndQuery.utf8),
            "\(rebuilt.debugDescription) parses to another URL")
    case .failure(let error):
        invariant(false, "\(rebuilt.debugDescription) does not parse: \(error)")
    }
}

/// `[origin URL]` as a section names it: a wildcard only as `https://*.DOMAIN[:PORT]`, DOMAIN a host name of two
/// labels or more without "*", covering exactly the names that end in "." and DOMAIN (none with a "*"); any other
/// origin has no "*" and is https with a host name or loopback http.
private func checkOriginPattern(_ input: String) {
    guard case .success(let origin) = OriginConfig.parseURL(input) else { return }
    let domain = origin.authority.host
    invariant(!domain.contains("*"), "\(input.debugDescription) keeps a * in \(domain)")
    guard origin.isWildcard else {
        invariant(
            origin.scheme == "https" ? origin.authority.kind == .name : MetadataURL.isLoopbackHost(domain),
            "origin \(origin.url)")
        return
    }
    invariant(origin.scheme == "https" && origin.authority.kind == .name, "wildcard \(origin.url)")
    invariant(domain.split(separator: ".").count >= 2 && !domain.hasPrefix("."), "wildcard domain \(domain)")
    invariant(OriginConfig.parseURL(origin.url).map(\.isWildcard) == .success(true), "\(origin.url) parses back")
    for (host, expected) in [
        ("a." + domain, true), ("a.b." + domain, true), (domain, false), ("a" + domain, false),
        ("*." + domain, false), (domain + ".a", false),
    ] {
        invariant(origin.covers(host: host, kind: .name) == expected, "\(origin.url) covers \(host): \(!expected)")
    }
}

/// An `Origin` value (or a configured origin) names exactly a scheme and an authority, and its serialisation
/// parses back to the same origin; a Referer's origin is its URL's.
private func checkWebOrigin(_ raw: [UInt8]) {
    if let origin = WebOrigin.parse(raw) {
        checkAuthority(origin.authority)
        invariant(origin.scheme == "http" || origin.scheme == "https", "origin scheme \(origin.scheme)")
        invariant(!raw.contains(UInt8(ascii: "/")) || raw.filter { $0 == UInt8(ascii: "/") }.count == 2, "a path")
        invariant(WebOrigin.parse(Array(origin.description.utf8)) == origin, "\(origin) does not parse back")
        invariant(WebOrigin.parse(raw + [UInt8(ascii: "/")]) == nil, "an Origin field with a path")
    }
    if let origin = WebOrigin.ofURL(raw), case .success(let url) = AbsoluteURL.parse(text(raw)) {
        invariant(origin.scheme == url.scheme && origin.authority == url.authority, "a Referer's origin")
    }
}

/// Dotted quad or eight full groups: a rendering the parser must read back.
func render(_ address: IPAddress) -> String {
    switch address {
    case .v4(let value):
        let octets: [UInt32] = [value >> 24, value >> 16 & 0xFF, value >> 8 & 0xFF, value & 0xFF]
        return octets.map { String($0) }.joined(separator: ".")
    case .v6(let high, let low):
        var groups: [UInt64] = []
        for half in [high, low] {
            for shift: UInt64 in [48, 32, 16, 0] { groups.append(half >> shift & 0xFFFF) }
        }
        return groups.map { String($0, radix: 16) }.joined(separator: ":")
    }
}

/// IPAddress.parse agrees with the C library's inet_pton, and reads its own rendering back.
private func checkIPAddress(_ input: String) {
    let ours = IPAddress.parse(input)
    if let ours {
        invariant(IPAddress.parse(render(ours)) == ours, "\(render(ours)) does not parse back")
        if case .v4(let value) = ours {
            let mapped = IPAddress.v6(0, 0xFFFF_0000_0000 | UInt64(value))
            invariant(mapped.isLoopback == ours.isLoopback, "IPv4-mapped \(render(ours)) has another isLoopback")
        }
    }
    #if canImport(Glibc)
        guard !input.utf8.contains(0) else { return }
        var v4 = in_addr()
        var v6 = in6_addr()
        let isV4 = inet_pton(AF_INET, input, &v4) == 1
        let isV6 = inet_pton(AF_INET6, input, &v6) == 1
        switch ours {
        case .v4(let value):
            invariant(
                isV4 && UInt32(bigEndian: v4.s_addr) == value,
                "\(input.debugDescription): IPv4 \(render(ours!)), inet_pton disagrees")
        case .v6(let high, let low):
            let octets = withUnsafeBytes(of: &v6) { Array($0) }
            let cHigh = octets[0..<8].reduce(UInt64(0)) { $0 << 8 | UInt64($1) }
            let cLow = octets[8..<16].reduce(UInt64(0)) { $0 << 8 | UInt64($1) }
            invariant(
                isV6 && cHigh == high && cLow == low,
                "\(input.debugDescription): IPv6 \(render(ours!)), inet_pton disagrees")
        case nil:
            invariant(!isV4 && !isV6, "\(input.debugDescription) is an address to inet_pton, not to IPAddress.parse")
        }
    #endif
}

/// The first `prefix` bits of two addresses agree: the reference for CIDR.contains.
private func samePrefix(_ a: IPAddress, _ b: IPAddress, _ prefix: Int) -> Bool {
    func bits(_ address: IPAddress) -> [Bool] {
        func bits(_ word: UInt64, _ count: Int) -> [Bool] {
            (0..<count).map { (word >> UInt64(count - 1 - $0)) & 1 == 1 }
        }
        switch address {
        case .v4(let value): return bits(UInt64(value), 32)
        case .v6(let high, let low): return bits(high, 64) + bits(low, 64)
        }
    }
    let x = bits(a)
    let y = bits(b)
    return x.count == y.count && x[0..<prefix] == y[0..<prefix]
}

private func checkCIDR(_ input: String, _ raw: [UInt8]) {
    guard let range = CIDR.parse(input) else { return }
    switch range.address {
    case .v4: invariant((0...32).contains(range.prefix), "IPv4 prefix \(range.prefix)")
    case .v6: invariant((0...128).contains(range.prefix), "IPv6 prefix \(range.prefix)")
    }
    invariant(range.contains(range.address), "\(input.debugDescription) does not contain its own address")
    // Addresses near and far from the range, derived from the input.
    var random = InputRandom(raw, salt: 0x33)
    for _ in 0..<6 {
        var other: IPAddress
        switch (range.address, random.next(in: 0...4)) {
        case (_, 0):
            other =
                random.nextBool() ? .v4(UInt32(truncatingIfNeeded: random.next())) : .v6(random.next(), random.next())
        case (.v4(let value), _): other = .v4(value ^ (UInt32(1) << UInt32(random.next(in: 0...31))))
        case (.v6(let high, let low), _):
            let bit = random.next(in: 0...127)
            other =
                bit < 64
                ? .v6(high ^ (UInt64(1) << UInt64(63 - bit)), low) : .v6(high, low ^ (UInt64(1) << UInt64(127 - bit)))
        }
        invariant(
            range.contains(other) == samePrefix(range.address, other, range.prefix),
            "\(input.debugDescription) contains \(render(other)): \(range.contains(other))")
    }
}

private func checkBase64(_ input: String, _ raw: [UInt8]) {
    let encoded = Base64.encode(raw)
    invariant(encoded.utf8.count == (raw.count + 2) / 3 * 4, "encoded length")
    invariant(Base64.decode(encoded) == raw, "Base64.decode(Base64.encode(x)) != x")
    invariant(Base64.decode(Base64.urlEncode(raw)) == raw, "Base64.decode(Base64.urlEncode(x)) != x")
    invariant(
        !Base64.urlEncode(raw).utf8.contains {
            $0 == UInt8(ascii: "=") || $0 == UInt8(ascii: "+") || $0 == UInt8(ascii: "/")
        }, "urlEncode alphabet")
    if let decoded = Base64.decode(input) {
        // Only canonical text decodes: encoding again gives the input, up to alphabet and padding.
        var normalized = Array(input.utf8)
        while normalized.last == UInt8(ascii: "=") { normalized.removeLast() }
        normalized = normalized.map {
            $0 == UInt8(ascii: "-") ? UInt8(ascii: "+") : $0 == UInt8(ascii: "_") ? UInt8(ascii: "/") : $0
        }
        var again = Array(Base64.encode(decoded).utf8)
        while again.last == UInt8(ascii: "=") { again.removeLast() }
        invariant(again == normalized, "\(input.debugDescription) decodes but is not canonical Base64")
    }

    // Basic credentials: exactly the listed user:password pairs get in.
    _ = credentials.check(input)
    let result = credentials.check("Basic " + encoded)
    switch text(raw) {
    case "alice:secret" where raw == bytes("alice:secret"):
        invariant(result == .allowed(user: "alice"), "alice not let in")
    case "bob:hunter2" where raw == bytes("bob:hunter2"): invariant(result == .allowed(user: "bob"), "bob not let in")
    default: invariant(result == .invalid, "\(text(raw).debugDescription) gets in as \(result)")
    }
}

private func checkValues(_ input: String) {
    if let duration = ConfigValue.duration(input) {
        invariant(duration >= 0, "negative duration")
        let described = ConfigValue.describeDuration(duration)
        invariant(
            ConfigValue.duration(described) == duration,
            "duration \(duration) described as \(described) reads back differently")
    }
    if let size = ConfigValue.size(input) {
        invariant(size >= 0, "negative size")
    }
    if let listen = ListenAddress.parse(input) {
        invariant((0...65535).contains(listen.port), "listen port \(listen.port)")
        invariant(ListenAddress.parse(listen.description) == listen, "\(listen) does not parse back")
    }
    if case .success(let upstream) = UpstreamProxy.parse(input) {
        checkAuthority(upstream.address)
        guard case .success(let again) = UpstreamProxy.parse(upstream.description) else {
            return invariant(false, "\(upstream) does not parse back")
        }
        invariant(again.address == upstream.address, "\(upstream) parses back as \(again)")
        if let authorization = upstream.authorization {
            let decoded = Base64.decode(authorization.dropFirst("Basic ".count))
            invariant(
                decoded == bytes("\(upstream.username ?? ""):\(upstream.password ?? "")"),
                "upstream credentials do not round-trip")
        }
    }
    if case .success(let list) = BypassList.parse(input) {
        for domain in list.domains {
            invariant(
                list.matches(HostPort(host: domain, port: 443, kind: .name)),
                "bypass list does not match its own \(domain)")
            invariant(
                list.matches(HostPort(host: "sub." + domain, port: 443, kind: .name)),
                "bypass list does not match a subdomain of \(domain)")
        }
        for range in list.ranges {
            let kind: HostPort.Kind
            switch range.address {
            case .v4: kind = .ipv4
            case .v6: kind = .ipv6
            }
            invariant(
                list.matches(HostPort(host: render(range.address), port: 443, kind: kind)),
                "bypass list does not match its own range")
        }
    }
}
