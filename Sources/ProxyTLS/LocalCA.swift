import COpenSSL
import Foundation
import ProxyCore

/// The local certificate authority that signs the leaf certificates for protected origins.
///
/// An EC P-256 key and a self-signed certificate whose name constraints (RFC 5280 §4.2.1.10) permit exactly
/// the protected host names (subdomains excluded, every IPv4 and IPv6 address excluded), so that even a
/// stolen CA key cannot impersonate any other site to a client that trusts it.
public final class LocalCA: @unchecked Sendable {
    // @unchecked Sendable: immutable after creation.
    public let certificate: Certificate
    let key: PrivateKey
    /// The permitted host names, sorted.
    public let hosts: [String]

    /// CA validity: one year; it is reissued whenever the protected hosts change anyway.
    public static let validity: Int64 = 365 * 86400
    /// Leaves: two days, backdated an hour for clock skew.
    public static let leafValidity: Int64 = 2 * 86400
    public static let backdate: Int64 = 3600

    init(certificate: Certificate, key: PrivateKey, hosts: [String]) {
        self.certificate = certificate
        self.key = key
        self.hosts = hosts
    }

    /// The name constraints extension value for `hosts`.
    static func nameConstraints(_ hosts: [String]) -> String {
        var parts = ["critical"]
        for host in hosts { parts.append("permitted;DNS:\(host)") }
        // A DNS constraint also admits subdomains; a leading dot excludes exactly those (RFC 5280 §4.2.1.10).
        for host in hosts { parts.append("excluded;DNS:.\(host)") }
        parts.append("excluded;IP:0.0.0.0/0.0.0.0")
        parts.append("excluded;IP:::/::")
        return parts.joined(separator: ",")
    }

    /// A new CA for `hosts` (lower-case DNS names).
    public static func create(hosts: [String], label: String, now: Int64 = Int64(time(nil))) throws -> LocalCA {
        let sorted = Array(Set(hosts)).sorted()
        precondition(!sorted.isEmpty, "a CA needs at least one host")
        for host in sorted where IPAddress.parse(host) != nil || host.isEmpty {
            throw CryptoError("\(host) cannot be a protected TLS host: the local CA never signs for IP addresses")
        }
        let key = try PrivateKey.generateP256()
        let certificate = try CertificateBuilder.build(
            subject: .init(commonName: "proxyctl local CA (\(label))", organization: "proxyctl"),
            subjectKey: key, issuer: nil, issuerKey: key, notBefore: now - backdate, notAfter: now + validity,
            extensions: [
                (NID_basic_constraints, "critical,CA:TRUE,pathlen:0"),
                (NID_key_usage, "critical,keyCertSign,cRLSign"),
                (NID_subject_key_identifier, "hash"),
                (NID_name_constraints, nameConstraints(sorted)),
            ])
        return LocalCA(certificate: certificate, key: key, hosts: sorted)
    }

    /// A leaf certificate for `host`, carrying `leafKey`'s public key.
    public func issueLeaf(host: String, leafKey: PrivateKey, now: Int64 = Int64(time(nil))) throws -> Certificate {
        try CertificateBuilder.build(
            subject: .init(commonName: host, organization: nil), subjectKey: leafKey, issuer: certificate,
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
        public var certificate: String { directory + "/ca.pem" }
        public var key: String { directory + "/ca-key.pem" }
        public var hosts: String { directory + "/hosts" }
        /// The system roots plus this CA: what `proxyctl env` points runtimes at.
        public var bundle: String { directory + "/bundle.pem" }
        /// The same certificates as a PKCS#12 trust store, for Java (`javax.net.ssl.trustStore`).
        public var trustStore: String { directory + "/truststore.p12" }

        public init(stateDirectory: String) { directory = stateDirectory + "/ca" }
    }

    /// Reads the CA, or nil when there is none.
    public static func load(_ files: Files) throws -> LocalCA? {
        guard let certificatePEM = FileManager.default.contents(atPath: files.certificate) else { return nil }
        guard let keyPEM = FileManager.default.contents(atPath: files.key) else {
            throw CryptoError("\(files.key) is missing; run proxyctl ca init to make a new CA")
        }
        let hosts =
            (try? String(contentsOfFile: files.hosts, encoding: .utf8))?
            .split(separator: "\n").map(String.init).filter { !$0.isEmpty } ?? []
        return LocalCA(
            certificate: try Certificate.fromPEM(Array(certificatePEM)), key: try PrivateKey.fromPEM(Array(keyPEM)),
            hosts: hosts.sorted())
    }

    /// Writes the CA: the key 0600, everything replaced atomically, the directory 0700.
    public func save(_ files: Files, systemRoots: String?) throws {
        try SecureFile.makePrivateDirectory(files.directory)
        try SecureFile.write(try key.pem(), to: files.key, mode: 0o600)
        let pem = try certificate.pem()
        try SecureFile.write(pem, to: files.certificate, mode: 0o644)
        try SecureFile.write(Array((hosts.joined(separator: "\n") + "\n").utf8), to: files.hosts, mode: 0o644)
        var bundle: [UInt8] = []
        if let systemRoots, let roots = FileManager.default.contents(atPath: systemRoots) {
            bundle.append(contentsOf: roots)
            if bundle.last != 0x0A { bundle.append(0x0A) }
        }
        bundle.append(contentsOf: Array("# proxyctl local CA for: \(hosts.joined(separator: " "))\n".utf8))
        bundle.append(contentsOf: pem)
        try SecureFile.write(bundle, to: files.bundle, mode: 0o644)
        try SecureFile.write(try TrustStore.pkcs12(pem: bundle), to: files.trustStore, mode: 0o644)
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
        let directory = (path as NSString).deletingLastPathComponent
        let temporary =
            "\(directory)/.\((path as NSString).lastPathComponent).\(getpid()).\(UInt32.random(in: 0...UInt32.max)).tmp"
        let fd = open(temporary, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, mode)
        guard fd >= 0 else { throw CryptoError("\(temporary) cannot be created: \(String(cString: strerror(errno)))") }
        var written = 0
        var failed = false
        while written < bytes.count {
            let count = bytes[written...].withUnsafeBytes { Glibc.write(fd, $0.baseAddress, $0.count) }
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
