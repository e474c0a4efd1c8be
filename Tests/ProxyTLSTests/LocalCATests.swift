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

/// What `init` and `ca init` do with the CA of a state directory several configurations may share: keep it
/// when it covers the hosts asked for, widen it (never narrow it) when it lacks one, narrow only when forced.
@Suite struct LocalCAPlanTests {
    let now: Int64 = 1_800_000_000
    var valid: Int64 { now + LocalCA.validity }

    @Test func noCAMakesOneForTheHostsAskedFor() {
        #expect(
            LocalCA.Plan.decide(existing: nil, wanted: ["b.test", "a.test"], force: false, now: now)
                == .create(hosts: ["a.test", "b.test"]))
    }

    @Test func aCAThatCoversTheHostsIsKeptWhateverElseItCovers() {
        #expect(
            LocalCA.Plan.decide(existing: (["a.test"], valid), wanted: ["a.test"], force: false, now: now)
                == .keep(extra: []))
        #expect(
            LocalCA.Plan.decide(existing: (["a.test", "b.test"], valid), wanted: ["a.test"], force: false, now: now)
                == .keep(extra: ["b.test"]))
    }

    @Test func aHostItLacksWidensItToTheUnion() {
        #expect(
            LocalCA.Plan.decide(existing: (["a.test", "b.test"], valid), wanted: ["c.test"], force: false, now: now)
                == .widen(hosts: ["a.test", "b.test", "c.test"], added: ["c.test"]))
    }

    @Test func aCAAboutToExpireIsRenewedForTheUnion() {
        let soon = now + LocalCA.Plan.renewBefore - 1
        #expect(
            LocalCA.Plan.decide(existing: (["a.test"], soon), wanted: ["a.test"], force: false, now: now)
                == .renew(hosts: ["a.test"], added: []))
        #expect(
            LocalCA.Plan.decide(existing: (["a.test"], soon), wanted: ["b.test"], force: false, now: now)
                == .renew(hosts: ["a.test", "b.test"], added: ["b.test"]))
    }

    @Test func forceMakesOneForExactlyTheHostsAskedForAndNamesWhatItDrops() {
        #expect(
            LocalCA.Plan.decide(existing: (["a.test", "b.test"], valid), wanted: ["a.test"], force: true, now: now)
                == .replace(hosts: ["a.test"], dropped: ["b.test"]))
        #expect(
            LocalCA.Plan.decide(existing: nil, wanted: ["a.test"], force: true, now: now) == .create(hosts: ["a.test"]))
    }
}

/// A CA replaced by a wider one is retired: its key goes, its certificate stays in the bundle until it expires,
/// so a proxy that still signs with it keeps working. `retainPrevious: false` (ca init --force) trusts it no more.
@Suite struct LocalCARetirementTests {
    let files = LocalCA.Files(
        stateDirectory: NSTemporaryDirectory() + "proxyctl-ca-retire-\(UUID().uuidString)")

    func bundle() throws -> String { try String(contentsOfFile: files.bundle, encoding: .utf8) }

    @Test func aWiderCARetiresTheOldOneWhichStaysTrusted() throws {
        let first = try LocalCA.create(hosts: ["a.test"], label: "test")
        try first.save(files, systemRoots: nil)
        #expect(LocalCA.retired(files).isEmpty && first.isTrusted(files))
        let wider = try LocalCA.create(hosts: ["a.test", "b.test"], label: "test")
        try wider.save(files, systemRoots: nil)
        let loaded = try #require(try LocalCA.load(files))
        #expect(
            loaded.certificate.fingerprint == wider.certificate.fingerprint && loaded.hosts == ["a.test", "b.test"])
        let retired = LocalCA.retired(files)
        #expect(retired.count == 1 && retired[0].certificate.fingerprint == first.certificate.fingerprint)
        #expect(retired[0].hosts == ["a.test"])
        #expect(first.isTrusted(files) && wider.isTrusted(files))
        // Both in the bundle, the current one last; the old key is gone from the directory.
        let text = try bundle()
        #expect(text.contains(String(decoding: try first.certificate.pem(), as: UTF8.self)))
        #expect(text.hasSuffix(String(decoding: try wider.certificate.pem(), as: UTF8.self)))
        let key = try String(contentsOfFile: files.key, encoding: .utf8)
        #expect(key == String(decoding: try wider.key.pem(), as: UTF8.self))
        // Saving the same CA again (proxyctl env rewrites the bundle) retires nothing.
        try LocalCA.refreshBundle(files, systemRoots: nil)
        try wider.save(files, systemRoots: nil)
        #expect(LocalCA.retired(files).count == 1)
    }

    @Test func replacingWithoutRetainingTrustsTheOldOnesNoMore() throws {
        let first = try LocalCA.create(hosts: ["a.test"], label: "test")
        try first.save(files, systemRoots: nil)
        try LocalCA.create(hosts: ["a.test", "b.test"], label: "test").save(files, systemRoots: nil)
        let forced = try LocalCA.create(hosts: ["a.test"], label: "test")
        try forced.save(files, systemRoots: nil, retainPrevious: false)
        #expect(LocalCA.retired(files).isEmpty)
        #expect(!first.isTrusted(files) && forced.isTrusted(files))
        #expect(try bundle().components(separatedBy: "BEGIN CERTIFICATE").count == 2)
    }

    @Test func anExpiredRetiredCALeavesTheBundle() throws {
        let old = try LocalCA.create(hosts: ["a.test"], label: "test", now: Int64(time(nil)) - LocalCA.validity - 10)
        try old.save(files, systemRoots: nil)
        try LocalCA.create(hosts: ["a.test", "b.test"], label: "test").save(files, systemRoots: nil)
        #expect(LocalCA.retired(files).isEmpty && !old.isTrusted(files))
        #expect(try bundle().components(separatedBy: "BEGIN CERTIFICATE").count == 2)
        #expect(try FileManager.default.contentsOfDirectory(atPath: files.retired).isEmpty)
    }
}
