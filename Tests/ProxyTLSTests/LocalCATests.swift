import COpenSSL
import Foundation
import Testing

@testable import ProxyTLS

/// The local CA's certificates, checked by the openssl command (an implementation this project did not
/// write): leaves for protected hosts verify; any other name, a subdomain or an IP address is refused by
/// the name constraints even though the CA signed it.
@Suite struct LocalCATests {
    let directory: String = {
        let path = NSTemporaryDirectory() + "proxyctl-ca-\(UUID().uuidString)"
        try! FileManager.default.createDirectory(atPath: path, withIntermediateDirectories: true)
        return path
    }()

    func write(_ certificate: Certificate, _ name: String) throws -> String {
        let path = "\(directory)/\(name).pem"
        try Data(try certificate.pem()).write(to: URL(fileURLWithPath: path))
        return path
    }

    /// Runs `openssl verify` and returns its exit status and output.
    func opensslVerify(ca: String, leaf: String, host: String? = nil) throws -> (Int32, String) {
        let process = Process()
        process.executableURL = URL(fileURLWithPath: "/usr/bin/openssl")
        var arguments = ["verify", "-CAfile", ca, "-purpose", "sslserver"]
        if let host { arguments += ["-verify_hostname", host] }
        process.arguments = arguments + [leaf]
        let pipe = Pipe()
        process.standardOutput = pipe
        process.standardError = pipe
        try process.run()
        let output = String(decoding: pipe.fileHandleForReading.readDataToEndOfFile(), as: UTF8.self)
        process.waitUntilExit()
        return (process.terminationStatus, output)
    }

    @Test func leavesForProtectedHostsVerify() throws {
        let ca = try LocalCA.create(hosts: ["api.test", "git.test"], label: "test")
        let caPath = try write(ca.certificate, "ca")
        let leafKey = try PrivateKey.generateP256()
        for host in ["api.test", "git.test"] {
            let leaf = try ca.issueLeaf(host: host, leafKey: leafKey)
            let (status, output) = try opensslVerify(ca: caPath, leaf: try write(leaf, host), host: host)
            #expect(status == 0, "\(host): \(output)")
        }
    }

    @Test(arguments: ["other.test", "sub.api.test", "api.test.evil.test", "127.0.0.1"])
    func nameConstraintsRefuseEverythingElse(host: String) throws {
        let ca = try LocalCA.create(hosts: ["api.test"], label: "test")
        let caPath = try write(ca.certificate, "ca")
        let leafKey = try PrivateKey.generateP256()
        // Sign the forbidden name directly, as a stolen CA key could.
        let extensions: [(Int32, String)] = [
            (NID_basic_constraints, "critical,CA:FALSE"), (NID_ext_key_usage, "serverAuth"),
            (NID_subject_alt_name, host.first!.isNumber ? "IP:\(host)" : "DNS:\(host)"),
        ]
        let now = Int64(time(nil))
        let forged = try CertificateBuilder.build(
            subject: .init(commonName: host, organization: nil), subjectKey: leafKey, issuer: ca.certificate,
            issuerKey: ca.key, notBefore: now - 60, notAfter: now + 3600, extensions: extensions)
        let (status, output) = try opensslVerify(ca: caPath, leaf: try write(forged, "forged"))
        #expect(status != 0, "\(host) verified: \(output)")
        #expect(output.contains("subtree violation"), "\(output)")
    }

    @Test func leafShapeAndValidity() throws {
        let ca = try LocalCA.create(hosts: ["api.test"], label: "test", now: 1_800_000_000)
        let leaf = try ca.issueLeaf(host: "api.test", leafKey: try PrivateKey.generateP256(), now: 1_800_000_000)
        #expect(leaf.notBefore == 1_800_000_000 - LocalCA.backdate)
        #expect(leaf.notAfter == 1_800_000_000 + LocalCA.leafValidity)
        let constraints = try #require(ca.certificate.extensionText(nid: Certificate.nameConstraintsNID))
        #expect(constraints.contains("DNS:api.test"))
        #expect(constraints.contains("DNS:.api.test"))
    }

    @Test func refusesIPAddresses() {
        #expect(throws: CryptoError.self) { try LocalCA.create(hosts: ["10.0.0.1"], label: "test") }
    }

    @Test func savesAndLoadsWithPrivateKeyFile() throws {
        let ca = try LocalCA.create(hosts: ["api.test"], label: "test")
        let files = LocalCA.Files(stateDirectory: directory)
        try ca.save(files, systemRoots: LocalCA.systemRootsPath())
        var info = stat()
        #expect(stat(files.key, &info) == 0 && info.st_mode & 0o777 == 0o600)
        #expect(stat(files.directory, &info) == 0 && info.st_mode & 0o777 == 0o700)
        let loaded = try #require(try LocalCA.load(files))
        #expect(loaded.hosts == ["api.test"])
        #expect(loaded.certificate.fingerprint == ca.certificate.fingerprint)
        let bundle = try String(contentsOfFile: files.bundle, encoding: .utf8)
        #expect(bundle.hasSuffix(String(decoding: try ca.certificate.pem(), as: UTF8.self)))
    }
}
