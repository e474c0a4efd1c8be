import Foundation
import ProxyCore
import TestFixtures
import Testing

@testable import ProxyOAuth

/// The owner credential file (docs/porting.md): made once, this user's alone, the same for every process.
@Suite struct OwnerCredentialTests {
    @Test func madeOnceInAPrivateFileAndReadBackTheSame() throws {
        let temporary = try TemporaryDirectory()
        let state = temporary.path + "/state/proxyctl"
        let first = try OwnerCredential.secret(stateDirectory: state)
        #expect(first.count >= 32 && !first.contains(":"))
        #expect(mode(state) == 0o700)
        #expect(mode(OwnerCredential.path(stateDirectory: state)) == 0o600)
        #expect(try OwnerCredential.secret(stateDirectory: state) == first)
        // No temporary file is left beside it.
        #expect(try FileManager.default.contentsOfDirectory(atPath: state) == ["proxy-credential"])
        let other = try TemporaryDirectory()
        #expect(try OwnerCredential.secret(stateDirectory: other.path) != first)
    }

    @Test func processesMakingItAtOnceGetTheSameOne() async throws {
        let temporary = try TemporaryDirectory()
        let state = temporary.path + "/state"
        let secrets = try await withThrowingTaskGroup(of: String.self) { group in
            for _ in 0..<16 { group.addTask { try OwnerCredential.secret(stateDirectory: state) } }
            return try await group.reduce(into: Set<String>()) { $0.insert($1) }
        }
        #expect(secrets.count == 1)
    }

    @Test func aFileOthersMayReadIsRefused() throws {
        let temporary = try TemporaryDirectory()
        _ = try OwnerCredential.secret(stateDirectory: temporary.path)
        chmod(OwnerCredential.path(stateDirectory: temporary.path), 0o644)
        #expect(throws: OwnerCredential.Failure.self) { try OwnerCredential.secret(stateDirectory: temporary.path) }
        try writeInPlace(OwnerCredential.path(stateDirectory: temporary.path), "\n")
        chmod(OwnerCredential.path(stateDirectory: temporary.path), 0o600)
        #expect(throws: OwnerCredential.Failure.self) { try OwnerCredential.secret(stateDirectory: temporary.path) }
    }

    @Test func theProxyURLCarriesItAndTheFrontDoorChecksIt() throws {
        #expect(
            OwnerCredential.proxyURL("http://127.0.0.1:8080", secret: "s3cret")
                == "http://proxyctl:s3cret@127.0.0.1:8080")
        let credentials = try #require(OwnerCredential.credentials(secret: "s3cret"))
        #expect(
            credentials.check("Basic " + Base64.encode(Array("proxyctl:s3cret".utf8))) == .allowed(user: "proxyctl"))
        #expect(credentials.check("Basic " + Base64.encode(Array("proxyctl:other".utf8))) == .invalid)
    }
}
