import COpenSSL
import ProxyCore

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

/// The local certificate authority that signs the leaf certificates for protected origins.
///
/// Two certificates, both with name constraints (RFC 5280 §4.2.1.10) that permit exactly the protected host
/// names (subdomains excluded, every IPv4 and IPv6 address excluded):
/// - the root, self-signed, the one clients trust (`ca.pem`, in the bundle and Java's trust store). RFC 5280 lets
///   a relying party ignore constraints on a trust anchor, and Java's PKIX does: a constrained root alone would
///   vouch for any name to every Java program. Its key exists only while `create` runs: it signs the
///   intermediate and is gone, never written anywhere, so nothing can ever be signed outside the constraints
///   again;
/// - the intermediate (`intermediate.pem`, its key `intermediate-key.pem`, 0600), which every client constrains
///   (OpenSSL, curl, Go, Java, browsers) and which signs the leaves; a TLS server sends it after the leaf.
///
/// Before it signs a leaf the CA checks the name against the constraints of both certificates as they are
/// written in them (`NameConstraints`). A CA made before the intermediate existed (a constrained root that signs
/// leaves itself, `ca-key.pem`) still loads (`isLegacy`); `ca init` replaces it.
///
/// One CA serves every configuration that shares a state directory, so its hosts are those of all of them: a
/// CA is never replaced by one that drops a host (another configuration may protect it) unless asked
/// (`ca init --force`). Adding hosts makes a new CA for all of them, and the one it replaces is retired: its
/// key is deleted, and its root stays in the bundle until it expires, so that a proxy running with it
/// (which holds the key in memory) and every client that trusted it keep working (`Plan`, `save`).
public final class LocalCA: @unchecked Sendable {
    // @unchecked Sendable: immutable after creation.
    /// The root: what clients trust, and what names this CA (its fingerprint, its validity).
    public let certificate: Certificate
    /// The certificate that signs leaves: the intermediate (the root itself for a legacy CA).
    public let issuer: Certificate
    /// The key of `issuer`.
    let key: PrivateKey
    /// The permitted host names, sorted.
    public let hosts: [String]
    /// The constraints of the root and of the intermediate, as their extensions say: a name is signed only
    /// when every one permits it.
    public let constraints: [NameConstraints]

    /// CA validity: one year; it is reissued whenever the protected hosts change anyway.
    public static let validity: Int64 = 365 * 86400
    /// Leaves: two days, backdated an hour for clock skew.
    public static let leafValidity: Int64 = 2 * 86400
    public static let backdate: Int64 = 3600

    init(certificate: Certificate, issuer: Certificate, key: PrivateKey) throws {
        self.certificate = certificate
        self.issuer = issuer
        self.key = key
        var constraints: [NameConstraints] = []
        for cert in issuer === certificate ? [certificate] : [certificate, issuer] {
            guard let found = try cert.nameConstraints(), !found.permittedDNS.isEmpty else {
                throw CryptoError("\(cert.subject) has no name constraints; run proxyctl ca init --force to replace it")
            }
            constraints.append(found)
        }
        self.constraints = constraints
        // The hosts are what the signing certificate permits (not what a file beside it says): names, and `.DOMAIN`
        // for a wildcard origin's domain.
        hosts = Array(Set(constraints[constraints.count - 1].permittedDNS)).sorted()
    }

    /// A CA whose root signs leaves itself (made before the intermediate): Java ignores its constraints.
    public var isLegacy: Bool { issuer === certificate }

    /// Whether this CA may sign for every one of `wanted`: its own hosts, `.DOMAIN` when it has that wildcard
    /// domain, and a name below one of its wildcard domains (a host a wildcard origin covers) that its constraints
    /// permit.
    public func covers(_ wanted: [String]) -> Bool {
        wanted.allSatisfy { host in
            hosts.contains(host)
                || (!host.hasPrefix(".") && hosts.contains { $0.hasPrefix(".") && host.hasSuffix($0) }
                    && permits(host))
        }
    }

    /// Whether a running proxy goes on signing with this CA rather than the one in its directory now: while it
    /// covers the protected `hosts`, is more than `margin` from its end, and clients that use the bundle trust it
    /// (`trusted`: it is the CA there, or a retired one that has not expired). A CA replaced by a wider one thus
    /// stays in use (the clients that loaded the bundle before trust only it); one that `ca init --force` stopped
    /// trusting, or that nears its end, gives way.
    public func keepsSigning(hosts: [String], trusted: Bool, now: Int64, margin: Int64 = 7 * 86400) -> Bool {
        covers(hosts) && certificate.notAfter >= now + margin && trusted
    }

    /// Whether the constraints of every certificate of the CA permit `host`.
    public func permits(_ host: String) -> Bool { constraints.allSatisfy { $0.permits(dnsName: host) } }

    /// What `init` and `ca init` do with the CA of a state directory, given the hosts a configuration protects.
    public enum Plan: Equatable, Sendable {
        /// The CA covers every host asked for and is not about to expire. `extra`: the hosts it covers beyond
        /// them (those of other configurations sharing the state directory).
        case keep(extra: [String])
        /// There is no CA: one for these hosts.
        case create(hosts: [String])
        /// A new CA for `hosts`, the old CA's and the `added` ones; the old one is retired, not dropped.
        case widen(hosts: [String], added: [String])
        /// The old CA expires within `renewBefore`: a new one for its hosts and any `added`; the old one retired.
        case renew(hosts: [String], added: [String])
        /// The old CA is a legacy one (a root that signs leaves, whose constraints Java ignores): a new one with an
        /// intermediate for its hosts and any `added`; the old one retired (its key deleted).
        case upgrade(hosts: [String], added: [String])
        /// Asked for (`--force`): a new CA for exactly the hosts asked for; the old one and every retired one
        /// are no longer trusted. `dropped`: the old CA's hosts that go.
        case replace(hosts: [String], dropped: [String])

        /// A CA this close to its end is renewed by `ca init` and `init` (seconds).
        public static let renewBefore: Int64 = 30 * 86400

        /// The plan for a state directory whose CA (if any) covers `existing` until `notAfter` (`legacy`: made
        /// before the intermediate), when a configuration protects `wanted`.
        public static func decide(
            existing: (hosts: [String], notAfter: Int64, legacy: Bool)?, wanted: [String], force: Bool, now: Int64
        ) -> Plan {
            let wanted = Array(Set(wanted)).sorted()
            guard let existing else { return .create(hosts: wanted) }
            let have = Set(existing.hosts)
            if force { return .replace(hosts: wanted, dropped: have.subtracting(wanted).sorted()) }
            let added = Set(wanted).subtracting(have).sorted()
            let union = have.union(wanted).sorted()
            if existing.legacy { return .upgrade(hosts: union, added: added) }
            if existing.notAfter < now + renewBefore { return .renew(hosts: union, added: added) }
            if !added.isEmpty { return .widen(hosts: union, added: added) }
            return .keep(extra: have.subtracting(wanted).sorted())
        }
    }

    /// The name constraints extension value for `hosts`.
    static func nameConstraints(_ hosts: [String]) -> String {
        var parts = ["critical"]
        for host in hosts { parts.append("permitted;DNS:\(host)") }
        // A DNS constraint also admits subdomains; a leading dot excludes exactly those (RFC 5280 §4.2.1.10), but
        // not where a wildcard origin's `.DOMAIN` needs them (`NameConstraints.excluded`).
        for excluded in NameConstraints.excluded(hosts) { parts.append("excluded;DNS:\(excluded)") }
        parts.append("excluded;IP:0.0.0.0/0.0.0.0")
        parts.append("excluded;IP:::/::")
        return parts.joined(separator: ",")
    }

    /// A new CA for `hosts` (lower-case DNS names): a root whose key signs the intermediate and is then gone.
    public static func create(hosts: [String], label: String, now: Int64 = Int64(time(nil))) throws -> LocalCA {
        let sorted = Array(Set(hosts)).sorted()
        precondition(!sorted.isEmpty, "a CA needs at least one host")
        for host in sorted where IPAddress.parse(host) != nil || host.isEmpty {
            throw CryptoError("\(host) cannot be a protected TLS host: the local CA never signs for IP addresses")
        }
        let intermediateKey = try PrivateKey.generateP256()
        let (root, intermediate) = try rootAndIntermediate(
            sorted, label: label, intermediateKey: intermediateKey, now: now)
        return try LocalCA(certificate: root, issuer: intermediate, key: intermediateKey)
    }

    /// The root and the intermediate it signs. The root's key is made here and never leaves: when this returns,
    /// the last reference to it goes and OpenSSL frees it (`EVP_PKEY_free` clears the private scalar).
    private static func rootAndIntermediate(
        _ hosts: [String], label: String, intermediateKey: PrivateKey, now: Int64
    ) throws -> (root: Certificate, intermediate: Certificate) {
        let constraints = nameConstraints(hosts)
        let rootKey = try PrivateKey.generateP256()
        let root = try CertificateBuilder.build(
            subject: .init(commonName: "proxyctl local CA (\(label))", organization: "proxyctl"),
            subjectKey: rootKey, issuer: nil, issuerKey: rootKey, notBefore: now - backdate, notAfter: now + validity,
            extensions: [
                // One intermediate below it, and the constraints on it too for the clients that honour a root's.
                (NID_basic_constraints, "critical,CA:TRUE,pathlen:1"),
                (NID_key_usage, "critical,keyCertSign,cRLSign"),
                (NID_subject_key_identifier, "hash"),
                (NID_name_constraints, constraints),
            ])
        let intermediate = try CertificateBuilder.build(
            subject: .init(commonName: "proxyctl local CA intermediate (\(label))", organization: "proxyctl"),
            subjectKey: intermediateKey, issuer: root, issuerKey: rootKey, notBefore: now - backdate,
            notAfter: now + validity,
            extensions: [
                (NID_basic_constraints, "critical,CA:TRUE,pathlen:0"),
                (NID_key_usage, "critical,keyCertSign,cRLSign"),
                (NID_subject_key_identifier, "hash"),
                (NID_authority_key_identifier, "keyid:always"),
                (NID_name_constraints, constraints),
            ])
        return (root, intermediate)
    }

    /// A leaf certificate for `host`, carrying `leafKey`'s public key, signed by the intermediate. A name the
    /// constraints do not permit is refused before anything is signed.
    public func issueLeaf(host: String, leafKey: PrivateKey, now: Int64 = Int64(time(nil))) throws -> Certificate {
        guard permits(host) else {
            throw CryptoError(
                "\(host) is outside the local CA's name constraints (\(hosts.joined(separator: ", "))); nothing was signed. Run proxyctl ca init when a protected host is new"
            )
        }
        return try CertificateBuilder.build(
            subject: .init(commonName: host, organization: nil), subjectKey: leafKey, issuer: issuer,
            issuerKey: key,
            notBefore: now - Self.backdate, notAfter: now + Self.leafValidity,
            extensions: [
                (NID_basic_constraints, "critical,CA:FALSE"),
                (NID_key_usage, "critical,digitalSignature"),
                (NID_ext_key_usage, "serverAuth"),
                (NID_subject_alt_name, "DNS:\(host)"),
                (NID_subject_key_identifier, "hash"),
                (NID_authority_key_identifier, "keyid:always"),
            ])
    }

    // MARK: - Files

    /// The files of a CA under `<state_dir>/ca/`.
    public struct Files: Sendable {
        public let directory: String
        /// The root: what clients trust.
        public var certificate: String { directory + "/ca.pem" }
        /// The intermediate, which signs leaves, and its key (0600).
        public var intermediate: String { directory + "/intermediate.pem" }
        public var intermediateKey: String { directory + "/intermediate-key.pem" }
        /// The key of a legacy CA's root (deleted when it is replaced).
        public var key: String { directory + "/ca-key.pem" }
        public var hosts: String { directory + "/hosts" }
        /// The system roots plus this CA: what `proxyctl env` points runtimes at.
        public var bundle: String { directory + "/bundle.pem" }
        /// The same certificates as a PKCS#12 trust store, for Java (`javax.net.ssl.trustStore`).
        public var trustStore: String { directory + "/truststore.p12" }
        /// Certificates of CAs replaced by wider ones (their keys deleted), trusted until they expire.
        public var retired: String { directory + "/retired" }
        /// Serialises writers of the directory across processes (`flock`).
        var lock: String { directory + "/.lock" }

        public init(stateDirectory: String) { directory = stateDirectory + "/ca" }
    }

    /// Reads the CA, or nil when there is none; under the directory's lock, so that a CA another process is
    /// replacing is never read half old and half new. The intermediate must be signed by the root and match its
    /// key; a legacy CA (no intermediate) is its root and the root's key.
    public static func load(_ files: Files) throws -> LocalCA? {
        guard FileManager.default.fileExists(atPath: files.certificate) else { return nil }
        return try locked(files, shared: true) {
            guard let rootPEM = FileManager.default.contents(atPath: files.certificate) else { return nil }
            let root = try Certificate.fromPEM(Array(rootPEM))
            guard let intermediatePEM = FileManager.default.contents(atPath: files.intermediate) else {
                guard let keyPEM = FileManager.default.contents(atPath: files.key) else {
                    throw CryptoError(
                        "\(files.intermediate) and \(files.key) are missing; run proxyctl ca init --force to make a new CA"
                    )
                }
                let key = try PrivateKey.fromPEM(Array(keyPEM))
                guard root.matches(key) else {
                    throw CryptoError("\(files.key) is not the key of \(files.certificate)")
                }
                return try LocalCA(certificate: root, issuer: root, key: key)
            }
            let intermediate = try Certificate.fromPEM(Array(intermediatePEM))
            guard let keyPEM = FileManager.default.contents(atPath: files.intermediateKey) else {
                throw CryptoError("\(files.intermediateKey) is missing; run proxyctl ca init --force to make a new CA")
            }
            let key = try PrivateKey.fromPEM(Array(keyPEM))
            guard intermediate.isSigned(by: root), intermediate.matches(key) else {
                throw CryptoError(
                    "\(files.intermediate) and \(files.intermediateKey) do not belong to \(files.certificate); run proxyctl ca init --force to make a new CA"
                )
            }
            return try LocalCA(certificate: root, issuer: intermediate, key: key)
        }
    }

    /// Makes this the CA of `files` (the key 0600, everything replaced atomically, the directory 0700) and
    /// writes the bundle. The CA there before is retired when `retainPrevious` (its root kept in `retired/` and
    /// trusted until it expires, its key deleted); otherwise it and every retired one are trusted no more.
    public func save(_ files: Files, systemRoots: String?, retainPrevious: Bool = true) throws {
        try SecureFile.makePrivateDirectory(files.directory)
        try Self.locked(files) {
            try SecureFile.makePrivateDirectory(files.retired)
            if retainPrevious {
                if let data = FileManager.default.contents(atPath: files.certificate),
                    let previous = try? Certificate.fromPEM(Array(data)),
                    previous.fingerprint != certificate.fingerprint
                {
                    let previousHosts =
                        (try? String(contentsOfFile: files.hosts, encoding: .utf8))?
                        .split(separator: "\n").joined(separator: " ") ?? ""
                    try SecureFile.write(
                        Array("# proxyctl local CA for: \(previousHosts)\n".utf8) + (try previous.pem()),
                        to: Self.retiredPath(files, previous), mode: 0o644)
                }
            } else {
                for name in Self.retiredNames(files) { unlink(files.retired + "/" + name) }
            }
            if isLegacy {
                try SecureFile.write(try key.pem(), to: files.key, mode: 0o600)
                unlink(files.intermediate)
                unlink(files.intermediateKey)
            } else {
                try SecureFile.write(try key.pem(), to: files.intermediateKey, mode: 0o600)
                try SecureFile.write(try issuer.pem(), to: files.intermediate, mode: 0o644)
                // The key of the CA before, a legacy root's, goes: a retired CA can sign nothing.
                unlink(files.key)
            }
            try SecureFile.write(try certificate.pem(), to: files.certificate, mode: 0o644)
            try SecureFile.write(Array((hosts.joined(separator: "\n") + "\n").utf8), to: files.hosts, mode: 0o644)
            try Self.writeBundle(files, systemRoots: systemRoots)
        }
    }

    /// Writes the bundle (`systemRoots`, then every retired CA still valid, then the CA of `files`) and the
    /// Java trust store made from it, as the files are now. Retired CAs that have expired are deleted.
    public static func refreshBundle(_ files: Files, systemRoots: String?) throws {
        try locked(files) { try writeBundle(files, systemRoots: systemRoots) }
    }

    private static func writeBundle(_ files: Files, systemRoots: String?, now: Int64 = Int64(time(nil))) throws {
        guard let current = FileManager.default.contents(atPath: files.certificate) else {
            throw CryptoError("\(files.certificate) is missing; run proxyctl ca init")
        }
        var bundle: [UInt8] = []
        if let systemRoots, let roots = FileManager.default.contents(atPath: systemRoots) {
            bundle.append(contentsOf: roots)
            if bundle.last != 0x0A { bundle.append(0x0A) }
        }
        for (name, certificate, text) in retiredEntries(files) {
            guard certificate.notAfter > now else {
                unlink(files.retired + "/" + name)
                continue
            }
            bundle.append(contentsOf: Array(text.utf8))
            if bundle.last != 0x0A { bundle.append(0x0A) }
        }
        let hosts =
            (try? String(contentsOfFile: files.hosts, encoding: .utf8))?.split(separator: "\n").joined(separator: " ")
            ?? ""
        bundle.append(contentsOf: Array("# proxyctl local CA for: \(hosts)\n".utf8))
        bundle.append(contentsOf: Array(current))
        try SecureFile.write(bundle, to: files.bundle, mode: 0o644)
        try SecureFile.write(try TrustStore.pkcs12(pem: bundle), to: files.trustStore, mode: 0o644)
    }

    /// A retired CA: its certificate and the hosts it was made for.
    public struct Retired: Sendable {
        public let certificate: Certificate
        public let hosts: [String]
    }

    /// The retired CAs of `files` still trusted (not expired), oldest first.
    public static func retired(_ files: Files, now: Int64 = Int64(time(nil))) -> [Retired] {
        retiredEntries(files).filter { $0.certificate.notAfter > now }.map { entry in
            let first = entry.text.split(separator: "\n").first ?? ""
            let prefix = "# proxyctl local CA for: "
            let hosts =
                first.hasPrefix(prefix) ? first.dropFirst(prefix.count).split(separator: " ").map(String.init) : []
            return Retired(certificate: entry.certificate, hosts: hosts)
        }.sorted { $0.certificate.notAfter < $1.certificate.notAfter }
    }

    /// Whether clients that use the bundle of `files` trust this CA: it is the CA there, or a retired one that
    /// has not expired.
    public func isTrusted(_ files: Files, now: Int64 = Int64(time(nil))) -> Bool {
        if let data = FileManager.default.contents(atPath: files.certificate),
            let current = try? Certificate.fromPEM(Array(data)), current.fingerprint == certificate.fingerprint
        {
            return true
        }
        return Self.retired(files, now: now).contains { $0.certificate.fingerprint == certificate.fingerprint }
    }

    private static func retiredPath(_ files: Files, _ certificate: Certificate) -> String {
        files.retired + "/" + certificate.fingerprint.replacing(":", with: "").lowercased() + ".pem"
    }

    private static func retiredNames(_ files: Files) -> [String] {
        ((try? FileManager.default.contentsOfDirectory(atPath: files.retired)) ?? [])
            .filter { $0.hasSuffix(".pem") && !$0.hasPrefix(".") }.sorted()
    }

    private static func retiredEntries(_ files: Files) -> [(name: String, certificate: Certificate, text: String)] {
        retiredNames(files).compactMap { name in
            guard let data = FileManager.default.contents(atPath: files.retired + "/" + name),
                let certificate = try? Certificate.fromPEM(Array(data))
            else { return nil }
            return (name, certificate, String(decoding: data, as: UTF8.self))
        }
    }

    /// Runs `body` holding the CA directory's lock (`flock` on `.lock`), so that a bundle is never written
    /// from a CA another process is replacing. `shared`: a reader's lock; where the lock file cannot be made (a
    /// read-only state directory), a reader goes on without it.
    private static func locked<T>(_ files: Files, shared: Bool = false, _ body: () throws -> T) throws -> T {
        let fd = open(files.lock, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0o600)
        if fd < 0 && shared { return try body() }
        guard fd >= 0 else { throw CryptoError("\(files.lock) cannot be opened: \(String(cString: strerror(errno)))") }
        defer { close(fd) }
        while flock(fd, shared ? LOCK_SH : LOCK_EX) != 0 {
            guard errno == EINTR else {
                throw CryptoError("\(files.lock) cannot be locked: \(String(cString: strerror(errno)))")
            }
        }
        return try body()
    }

    /// Where this system keeps its trusted roots (OpenSSL's default, else the usual Debian and Red Hat places).
    public static func systemRootsPath() -> String? {
        var candidates: [String] = []
        if let path = X509_get_default_cert_file() { candidates.append(String(cString: path)) }
        candidates += [
            "/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt", "/etc/ssl/cert.pem",
        ]
        return candidates.first { FileManager.default.isReadableFile(atPath: $0) }
    }
}

/// Java's trust stores: Java cannot read a PEM bundle, and `keytool -importcert -file bundle.pem` imports only
/// the bundle's first certificate.
public enum TrustStore {
    /// Java's customary password for trust stores: it protects nothing (the certificates are public), it
    /// only lets Java check the file's integrity.
    public static let password = "changeit"

    /// Every certificate of the PEM `pem` as a trusted entry of a PKCS#12 trust store.
    public static func pkcs12(pem: [UInt8]) throws -> [UInt8] {
        var out: UnsafeMutablePointer<UInt8>? = nil
        var count: Int32 = 0
        let length = pem.withUnsafeBufferPointer { buffer in
            proxyctl_pkcs12_truststore(buffer.baseAddress, Int32(buffer.count), password, &out, &count)
        }
        guard length > 0, let out else {
            throw CryptoError("cannot make a PKCS#12 trust store (\(count) certificates read)")
        }
        defer { proxyctl_OPENSSL_free(out) }
        return Array(UnsafeBufferPointer(start: out, count: Int(length)))
    }
}

/// Secret files: created 0600 (or as asked) in 0700 directories, replaced atomically.
public enum SecureFile {
    public static func makePrivateDirectory(_ directory: String) throws {
        var info = stat()
        if stat(directory, &info) != 0 {
            try FileManager.default.createDirectory(
                atPath: directory, withIntermediateDirectories: true, attributes: [.posixPermissions: 0o700])
            guard stat(directory, &info) == 0 else { throw CryptoError("\(directory) cannot be created") }
        }
        guard info.st_mode & S_IFMT == S_IFDIR else { throw CryptoError("\(directory) is not a directory") }
        if info.st_mode & 0o077 != 0 { _ = chmod(directory, 0o700) }
    }

    /// Writes `bytes` to a temporary file in the same directory, fsyncs it, renames it over `path`, and
    /// fsyncs the directory.
    public static func write(_ bytes: [UInt8], to path: String, mode: mode_t) throws {
        let directory = PathText.parent(path)
        let temporary =
            "\(directory)/.\(PathText.lastComponent(path)).\(getpid()).\(UInt32.random(in: 0...UInt32.max)).tmp"
        let fd = open(temporary, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, mode)
        guard fd >= 0 else { throw CryptoError("\(temporary) cannot be created: \(String(cString: strerror(errno)))") }
        var written = 0
        var failed = false
        while written < bytes.count {
            let count = bytes[written...].withUnsafeBytes { writeDescriptor(fd, $0) }
            if count < 0 && errno == EINTR { continue }
            if count <= 0 {
                failed = true
                break
            }
            written += count
        }
        _ = fchmod(fd, mode)
        if !failed && fsync(fd) != 0 { failed = true }
        close(fd)
        guard !failed, rename(temporary, path) == 0 else {
            unlink(temporary)
            throw CryptoError("\(path) cannot be written: \(String(cString: strerror(errno)))")
        }
        let directoryFD = open(directory, O_RDONLY | O_DIRECTORY | O_CLOEXEC)
        if directoryFD >= 0 {
            _ = fsync(directoryFD)
            close(directoryFD)
        }
    }
}

/// write(2), under a name `SecureFile.write` does not hide (the C library's module is Glibc or Darwin).
private func writeDescriptor(_ fd: Int32, _ bytes: UnsafeRawBufferPointer) -> Int {
    write(fd, bytes.baseAddress, bytes.count)
}
