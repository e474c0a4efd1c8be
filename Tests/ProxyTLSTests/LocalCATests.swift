import COpenSSL
import Foundation
import ProxyCore
import TestFixtures
import Testing

@testable import ProxyTLS

/// The local CA's certificates, checked by the openssl command (an implementation this project did not
/// write): leaves for protected hosts verify through the intermediate; any other name, a subdomain or an IP
/// address is refused by the intermediate's name constraints even though its key signed it, and the CA itself
/// refuses to sign them.
@Suite struct LocalCATests {
    let scratch: TemporaryDirectory
    var directory: String { scratch.path }

    init() throws { scratch = try TemporaryDirectory() }

    func write(_ certificate: Certificate, _ name: String) throws -> String {
        let path = "\(directory)/\(name).pem"
        try Data(try certificate.pem()).write(to: URL(fileURLWithPath: path))
        return path
    }

    /// Runs `openssl verify` (the root trusted, the intermediate as a chain certificate) and returns its exit
    /// status and output.
    func opensslVerify(
        ca: String, intermediate: String? = nil, leaf: String, host: String? = nil
    ) throws -> (
        Int32, String
    ) {
        let process = Process()
        process.executableURL = URL(fileURLWithPath: "/usr/bin/openssl")
        var arguments = ["verify", "-CAfile", ca, "-purpose", "sslserver"]
        if let intermediate { arguments += ["-untrusted", intermediate] }
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
        #expect(!ca.isLegacy && ca.issuer.isSigned(by: ca.certificate))
        let caPath = try write(ca.certificate, "ca")
        let intermediate = try write(ca.issuer, "intermediate")
        let leafKey = try PrivateKey.generateP256()
        for host in ["api.test", "git.test"] {
            let leaf = try ca.issueLeaf(host: host, leafKey: leafKey)
            #expect(leaf.isSigned(by: ca.issuer) && !leaf.isSigned(by: ca.certificate))
            let (status, output) = try opensslVerify(
                ca: caPath, intermediate: intermediate, leaf: try write(leaf, host), host: host)
            #expect(status == 0, "\(host): \(output)")
        }
        // Without the intermediate the root alone vouches for nothing.
        let leaf = try write(try ca.issueLeaf(host: "api.test", leafKey: leafKey), "alone")
        #expect(try opensslVerify(ca: caPath, leaf: leaf).0 != 0)
    }

    @Test(arguments: ["other.test", "sub.api.test", "api.test.evil.test", "127.0.0.1"])
    func nameConstraintsRefuseEverythingElse(host: String) throws {
        let ca = try LocalCA.create(hosts: ["api.test"], label: "test")
        let caPath = try write(ca.certificate, "ca")
        let leafKey = try PrivateKey.generateP256()
        // The CA checks the name before it signs.
        #expect(throws: CryptoError.self) { try ca.issueLeaf(host: host, leafKey: leafKey) }
        // Sign the forbidden name directly with the intermediate's key, as a stolen key could.
        let extensions: [(Int32, String)] = [
            (NID_basic_constraints, "critical,CA:FALSE"), (NID_ext_key_usage, "serverAuth"),
            (NID_subject_alt_name, host.first!.isNumber ? "IP:\(host)" : "DNS:\(host)"),
        ]
        let now = Int64(time(nil))
        let forged = try CertificateBuilder.build(
            subject: .init(commonName: host, organization: nil), subjectKey: leafKey, issuer: ca.issuer,
            issuerKey: ca.key, notBefore: now - 60, notAfter: now + 3600, extensions: extensions)
        let (status, output) = try opensslVerify(
            ca: caPath, intermediate: try write(ca.issuer, "intermediate"), leaf: try write(forged, "forged"))
        #expect(status != 0, "\(host) verified: \(output)")
        #expect(output.contains("subtree violation"), "\(output)")
    }

    @Test func leafShapeAndValidity() throws {
        let ca = try LocalCA.create(hosts: ["api.test"], label: "test", now: 1_800_000_000)
        let leaf = try ca.issueLeaf(host: "api.test", leafKey: try PrivateKey.generateP256(), now: 1_800_000_000)
        #expect(leaf.notBefore == 1_800_000_000 - LocalCA.backdate)
        #expect(leaf.notAfter == 1_800_000_000 + LocalCA.leafValidity)
        for certificate in [ca.certificate, ca.issuer] {
            let constraints = try #require(certificate.extensionText(nid: Certificate.nameConstraintsNID))
            #expect(constraints.contains("DNS:api.test"))
            #expect(constraints.contains("DNS:.api.test"))
            #expect(try certificate.nameConstraints() == NameConstraints.exactly(["api.test"]))
        }
        #expect(ca.issuer.extensionText(nid: NID_basic_constraints)?.contains("pathlen:0") == true)
        #expect(ca.certificate.extensionText(nid: NID_basic_constraints)?.contains("pathlen:1") == true)
    }

    @Test func refusesIPAddresses() {
        #expect(throws: CryptoError.self) { try LocalCA.create(hosts: ["10.0.0.1"], label: "test") }
    }

    @Test func savesAndLoadsWithPrivateKeyFile() throws {
        let ca = try LocalCA.create(hosts: ["api.test"], label: "test")
        let files = LocalCA.Files(stateDirectory: directory)
        try ca.save(files, systemRoots: LocalCA.systemRootsPath())
        var info = stat()
        #expect(stat(files.intermediateKey, &info) == 0 && info.st_mode & 0o777 == 0o600)
        #expect(stat(files.directory, &info) == 0 && info.st_mode & 0o777 == 0o700)
        #expect(stat(files.key, &info) != 0, "no root key is written")
        let loaded = try #require(try LocalCA.load(files))
        #expect(loaded.hosts == ["api.test"] && !loaded.isLegacy)
        #expect(loaded.certificate.fingerprint == ca.certificate.fingerprint)
        #expect(loaded.issuer.fingerprint == ca.issuer.fingerprint)
        // No file of the directory holds the root's key: whatever loads as a key is the intermediate's.
        for name in try FileManager.default.contentsOfDirectory(atPath: files.directory) {
            guard let data = FileManager.default.contents(atPath: files.directory + "/" + name),
                let key = try? PrivateKey.fromPEM(Array(data))
            else { continue }
            #expect(!ca.certificate.matches(key) && ca.issuer.matches(key), "\(name)")
        }
        // An intermediate that is not the root's is refused.
        let other = try LocalCA.create(hosts: ["api.test"], label: "other")
        try SecureFile.write(try other.issuer.pem(), to: files.intermediate, mode: 0o644)
        try SecureFile.write(try other.key.pem(), to: files.intermediateKey, mode: 0o600)
        #expect(throws: CryptoError.self) { try LocalCA.load(files) }
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
            LocalCA.Plan.decide(existing: (["a.test"], valid, false), wanted: ["a.test"], force: false, now: now)
                == .keep(extra: []))
        #expect(
            LocalCA.Plan.decide(
                existing: (["a.test", "b.test"], valid, false), wanted: ["a.test"], force: false, now: now)
                == .keep(extra: ["b.test"]))
    }

    @Test func aHostItLacksWidensItToTheUnion() {
        #expect(
            LocalCA.Plan.decide(
                existing: (["a.test", "b.test"], valid, false), wanted: ["c.test"], force: false, now: now)
                == .widen(hosts: ["a.test", "b.test", "c.test"], added: ["c.test"]))
    }

    @Test func aCAAboutToExpireIsRenewedForTheUnion() {
        let soon = now + LocalCA.Plan.renewBefore - 1
        #expect(
            LocalCA.Plan.decide(existing: (["a.test"], soon, false), wanted: ["a.test"], force: false, now: now)
                == .renew(hosts: ["a.test"], added: []))
        #expect(
            LocalCA.Plan.decide(existing: (["a.test"], soon, false), wanted: ["b.test"], force: false, now: now)
                == .renew(hosts: ["a.test", "b.test"], added: ["b.test"]))
    }

    @Test func aLegacyCAIsReplacedByOneWithAnIntermediate() {
        #expect(
            LocalCA.Plan.decide(existing: (["a.test"], valid, true), wanted: ["a.test"], force: false, now: now)
                == .upgrade(hosts: ["a.test"], added: []))
        #expect(
            LocalCA.Plan.decide(existing: (["a.test"], valid, true), wanted: ["b.test"], force: false, now: now)
                == .upgrade(hosts: ["a.test", "b.test"], added: ["b.test"]))
    }

    @Test func forceMakesOneForExactlyTheHostsAskedForAndNamesWhatItDrops() {
        #expect(
            LocalCA.Plan.decide(
                existing: (["a.test", "b.test"], valid, false), wanted: ["a.test"], force: true, now: now)
                == .replace(hosts: ["a.test"], dropped: ["b.test"]))
        #expect(
            LocalCA.Plan.decide(existing: nil, wanted: ["a.test"], force: true, now: now) == .create(hosts: ["a.test"]))
    }
}

/// A CA replaced by a wider one is retired: its key goes, its certificate stays in the bundle until it expires,
/// so a proxy that still signs with it keeps working. `retainPrevious: false` (ca init --force) trusts it no more.
@Suite struct LocalCARetirementTests {
    let scratch: TemporaryDirectory
    /// A state directory that does not exist yet.
    let files: LocalCA.Files

    init() throws {
        scratch = try TemporaryDirectory()
        files = LocalCA.Files(stateDirectory: scratch.path + "/state")
    }

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
        let key = try String(contentsOfFile: files.intermediateKey, encoding: .utf8)
        #expect(key == String(decoding: try wider.key.pem(), as: UTF8.self))
        // Saving the same CA again (proxyctl env rewrites the bundle) retires nothing.
        try LocalCA.refreshBundle(files, systemRoots: nil)
        try wider.save(files, systemRoots: nil)
        #expect(LocalCA.retired(files).count == 1)
    }

    /// What a running proxy does when the directory's CA changes (`LocalCAWatch`, a SIGHUP): it keeps a retired CA
    /// the bundle still trusts, and gives way when the CA is trusted no more, nears its end, or lacks a host.
    @Test func aRunningProxyKeepsItsCAWhileTheBundleTrustsIt() throws {
        let first = try LocalCA.create(hosts: ["a.test"], label: "test")
        try first.save(files, systemRoots: nil)
        let now = Int64(time(nil))
        #expect(first.keepsSigning(hosts: ["a.test"], trusted: first.isTrusted(files), now: now))
        try LocalCA.create(hosts: ["a.test", "b.test"], label: "test").save(files, systemRoots: nil)
        #expect(first.keepsSigning(hosts: ["a.test"], trusted: first.isTrusted(files), now: now), "retired, trusted")
        #expect(!first.keepsSigning(hosts: ["a.test", "b.test"], trusted: true, now: now), "lacks a host")
        #expect(
            !first.keepsSigning(hosts: ["a.test"], trusted: true, now: first.certificate.notAfter - 86400),
            "within a week of its end")
        try LocalCA.create(hosts: ["a.test"], label: "test").save(files, systemRoots: nil, retainPrevious: false)
        #expect(!first.keepsSigning(hosts: ["a.test"], trusted: first.isTrusted(files), now: now), "--force")
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

/// A CA made before the intermediate (a constrained root that signs leaves itself, `ca-key.pem`): it loads and
/// keeps serving; `ca init` replaces it (`Plan.upgrade`), and its key goes with it.
@Suite struct LegacyCATests {
    let scratch: TemporaryDirectory
    /// A state directory that does not exist yet.
    let files: LocalCA.Files

    init() throws {
        scratch = try TemporaryDirectory()
        files = LocalCA.Files(stateDirectory: scratch.path + "/state")
    }

    /// What `ca init` wrote before: the root, its key, its hosts.
    func writeLegacy(hosts: [String]) throws -> Certificate {
        let key = try PrivateKey.generateP256()
        let now = Int64(time(nil))
        let root = try CertificateBuilder.build(
            subject: .init(commonName: "proxyctl local CA (legacy)", organization: "proxyctl"), subjectKey: key,
            issuer: nil, issuerKey: key, notBefore: now - 60, notAfter: now + LocalCA.validity,
            extensions: [
                (NID_basic_constraints, "critical,CA:TRUE,pathlen:0"), (NID_key_usage, "critical,keyCertSign,cRLSign"),
                (NID_subject_key_identifier, "hash"), (NID_name_constraints, LocalCA.nameConstraints(hosts)),
            ])
        try SecureFile.makePrivateDirectory(files.directory)
        try SecureFile.write(try key.pem(), to: files.key, mode: 0o600)
        try SecureFile.write(try root.pem(), to: files.certificate, mode: 0o644)
        try SecureFile.write(Array((hosts.joined(separator: "\n") + "\n").utf8), to: files.hosts, mode: 0o644)
        try LocalCA.refreshBundle(files, systemRoots: nil)
        return root
    }

    @Test func aLegacyCALoadsSignsAndIsRetiredWithItsKeyDeleted() throws {
        let root = try writeLegacy(hosts: ["a.test"])
        let legacy = try #require(try LocalCA.load(files))
        #expect(legacy.isLegacy && legacy.hosts == ["a.test"] && legacy.issuer === legacy.certificate)
        let leaf = try legacy.issueLeaf(host: "a.test", leafKey: try PrivateKey.generateP256())
        #expect(leaf.isSigned(by: root))
        #expect(throws: CryptoError.self) {
            try legacy.issueLeaf(host: "b.test", leafKey: try PrivateKey.generateP256())
        }
        let upgraded = try LocalCA.create(hosts: legacy.hosts, label: "test")
        try upgraded.save(files, systemRoots: nil)
        #expect(!FileManager.default.fileExists(atPath: files.key), "the legacy root's key is deleted")
        #expect(legacy.isTrusted(files), "its root stays in the bundle until it expires")
        #expect(try LocalCA.load(files)?.isLegacy == false)
    }
}

extension LocalCATests {
    /// A wildcard origin's `.DOMAIN`: leaves for every name below it verify with OpenSSL, the domain itself and
    /// everything else is refused by the CA and (forged with the intermediate's key) by OpenSSL.
    @Test func aWildcardDomainPermitsTheNamesBelowItOnly() throws {
        let ca = try LocalCA.create(hosts: [".corp.example", "api.test"], label: "test")
        #expect(ca.hosts == [".corp.example", "api.test"] && ca.covers([".corp.example"]))
        let caPath = try write(ca.certificate, "ca")
        let intermediate = try write(ca.issuer, "intermediate")
        let leafKey = try PrivateKey.generateP256()
        for host in ["a.corp.example", "x.y.corp.example", "api.test"] {
            let leaf = try ca.issueLeaf(host: host, leafKey: leafKey)
            let (status, output) = try opensslVerify(
                ca: caPath, intermediate: intermediate, leaf: try write(leaf, host), host: host)
            #expect(status == 0, "\(host): \(output)")
        }
        for host in ["corp.example", "evilcorp.example", "sub.api.test"] {
            #expect(throws: CryptoError.self) { try ca.issueLeaf(host: host, leafKey: leafKey) }
            let now = Int64(time(nil))
            let forged = try CertificateBuilder.build(
                subject: .init(commonName: host, organization: nil), subjectKey: leafKey, issuer: ca.issuer,
                issuerKey: ca.key, notBefore: now - 60, notAfter: now + 3600,
                extensions: [
                    (NID_basic_constraints, "critical,CA:FALSE"), (NID_ext_key_usage, "serverAuth"),
                    (NID_subject_alt_name, "DNS:\(host)"),
                ])
            let (status, output) = try opensslVerify(
                ca: caPath, intermediate: intermediate, leaf: try write(forged, "forged-\(host)"))
            #expect(status != 0 && output.contains("subtree violation"), "\(host): \(output)")
        }
    }
}
