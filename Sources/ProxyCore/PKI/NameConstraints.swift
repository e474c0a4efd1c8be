/// The name constraints of a CA certificate (RFC 5280 §4.2.1.10) as they bear on a TLS server's DNS name: the
/// subtrees permitted and excluded. The local CA checks every name against its own before it signs a leaf
/// (`LocalCA.issueLeaf`), so that nothing it signs is outside what every client enforces.
public struct NameConstraints: Sendable, Equatable {
    /// DNS subtrees, lower case: `api.example.com` is that name and every name below it; `.api.example.com` (the
    /// form OpenSSL, Go and Java read as "below it only") the names below it alone; "" every name.
    public var permittedDNS: [String]
    public var excludedDNS: [String]
    /// Whether the certificate also constrains IP addresses, and excludes every one of them (v4 and v6).
    public var excludesEveryAddress: Bool

    public init(permittedDNS: [String], excludedDNS: [String], excludesEveryAddress: Bool) {
        self.permittedDNS = permittedDNS.map { $0.lowercased() }
        self.excludedDNS = excludedDNS.map { $0.lowercased() }
        self.excludesEveryAddress = excludesEveryAddress
    }

    /// Whether `name` (a DNS name, any case, a trailing dot ignored) is inside the constraints: within a
    /// permitted subtree when there are any (RFC 5280: a name of a type with no permitted subtree is not
    /// restricted by them), and within no excluded one. An IP address literal is never a DNS name here.
    public func permits(dnsName name: String) -> Bool {
        var name = name.lowercased()
        if name.hasSuffix(".") { name.removeLast() }
        // A wildcard name ("*.example") is never one the local CA signs, whatever its constraints permit.
        guard !name.isEmpty, IPAddress.parse(name) == nil, !name.hasPrefix("."), !name.contains(".."),
            !name.contains("*")
        else {
            return false
        }
        if !permittedDNS.isEmpty && !permittedDNS.contains(where: { Self.within(name, $0) }) { return false }
        return !excludedDNS.contains { Self.within(name, $0) }
    }

    /// RFC 5280 §4.2.1.10: a DNS constraint is satisfied by the name itself and by any name made by adding labels
    /// on its left (`example.com`: `example.com`, `a.example.com`; never `badexample.com`); a leading dot leaves
    /// the name itself out.
    static func within(_ name: String, _ constraint: String) -> Bool {
        if constraint.isEmpty { return true }
        if constraint.hasPrefix(".") { return name.hasSuffix(constraint) }
        return name == constraint || name.hasSuffix("." + constraint)
    }

    /// The constraints the local CA writes for `hosts`: exactly those names, no name below them, no address; a
    /// host written `.DOMAIN` (a wildcard origin's) permits every name below DOMAIN and not DOMAIN itself.
    public static func exactly(_ hosts: [String]) -> NameConstraints {
        NameConstraints(permittedDNS: hosts, excludedDNS: excluded(hosts), excludesEveryAddress: true)
    }

    /// The subtrees excluded for `hosts`: `.HOST` below each exact host, so that a DNS constraint permits the name
    /// alone (RFC 5280 §4.2.1.10: it would admit every name below). Except where another host lies in that
    /// subtree or overlaps it: an exact host below HOST (`api.corp.example` below `corp.example`), or a wildcard's
    /// `.DOMAIN` below HOST, equal to it or above it. An exclusion wins over every permission and has no holes, so
    /// it would take that other host from the CA. Then the host's subtree is permitted as far as the constraints
    /// go; the proxy still mints leaves only for hosts its origins match.
    public static func excluded(_ hosts: [String]) -> [String] {
        let domains = hosts.filter { $0.hasPrefix(".") }.map { String($0.dropFirst()) }
        let exact = hosts.filter { !$0.hasPrefix(".") }
        return exact.filter { host in
            !domains.contains { domain in
                domain == host || domain.hasSuffix("." + host) || host.hasSuffix("." + domain)
            } && !exact.contains { $0.hasSuffix("." + host) }
        }.map { "." + $0 }
    }

    /// A host of the local CA as people read it: `.DOMAIN` is `*.DOMAIN`.
    public static func display(_ host: String) -> String { host.hasPrefix(".") ? "*" + host : host }
}
