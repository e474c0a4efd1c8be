import Foundation
import ProxyCore
import Synchronization
import TestFixtures
import Testing

@testable import ProxyOAuth

/// "Now" for these tests: inside the fixture ID token's validity, so refreshed ID tokens validate.
private let start: Int64 = JWSFixtures.issuedAt + 100

/// A clock the test moves.
private final class TestClock: Sendable {
    private let seconds = Mutex<Int64>(start)

    var now: Int64 { seconds.withLock { $0 } }
    func advance(_ by: Int64) { seconds.withLock { $0 += by } }
}

/// The seconds ProviderClient asked to sleep, without sleeping.
private final class SleepLog: Sendable {
    private let waits = Mutex<[Int]>([])

    var all: [Int] { waits.withLock { $0 } }
    func add(_ seconds: Int) { waits.withLock { $0.append(seconds) } }
}

/// A token manager over a fresh store holding expired tokens (generation 1, refresh token "refresh-1"), and a
/// fake provider.
private struct Harness {
    let temporary: TemporaryDirectory
    let store: TokenStore
    let fake: FakeProvider
    let client: ProviderClient
    let manager: TokenManager
    let clock = TestClock()
    let sleeps = SleepLog()

    init(
        initial: TokenSet? = storedTokens(issuedAt: start - 3700, expiresAt: start - 100),
        delay: Duration = .zero, tokenTimeout: Int = unhurriedTokenTimeout,
        tokenReply: @escaping @Sendable (FakeProvider.TokenRequest) async throws -> HTTPResponse
    ) async throws {
        temporary = try TemporaryDirectory()
        store = TokenStore(stateDirectory: temporary.path + "/state")
        if let initial { try store.save(initial) }
        fake = FakeProvider(delay: delay, tokenReply: tokenReply)
        client = ProviderClient(config: testProvider(tokenTimeout: tokenTimeout), transport: fake)
        let sleeps = self.sleeps
        await client.setSleep { seconds in sleeps.add(seconds) }
        let clock = self.clock
        manager = TokenManager(
            provider: testProvider(tokenTimeout: tokenTimeout), store: store, client: client, clock: { clock.now })
    }

    /// Another process's manager: same files, its own memory, the same provider.
    func secondManager() async -> TokenManager {
        let clock = self.clock
        return TokenManager(
            provider: testProvider(), store: TokenStore(stateDirectory: store.stateDirectory), client: client,
            clock: { clock.now })
    }

    /// The tokens as on disk, read by a store of its own.
    func onDisk() throws -> TokenSet? {
        try TokenStore(stateDirectory: store.stateDirectory).load("test")
    }
}

/// The error `body` threw, as an AuthError; records an issue when it returned or threw something else.
private func authFailure<T>(
    sourceLocation: SourceLocation = #_sourceLocation, _ body: () async throws -> T
) async -> AuthError? {
    do {
        let value = try await body()
        Issue.record("succeeded with \(value)", sourceLocation: sourceLocation)
    } catch let error as AuthError {
        return error
    } catch {
        Issue.record("unexpected error \(error)", sourceLocation: sourceLocation)
    }
    return nil
}

@Suite struct TokenManagerRefreshTests {
    @Test func freshTokensNeedNoRequest() async throws {
        let harness = try await Harness(initial: storedTokens(issuedAt: start - 10, expiresAt: start + 3600)) { _ in
            FakeProvider.tokens(access: "unexpected")
        }
        let tokens = try await harness.manager.currentTokens()
        #expect(tokens.accessToken == "access-1")
        #expect(harness.fake.tokenRequests.isEmpty)
        #expect(harness.fake.discoveryRequests == 0)
    }

    @Test func expiredTokensAreRefreshedWithTheStoredRefreshToken() async throws {
        let harness = try await Harness { _ in
            FakeProvider.tokens(access: "access-2", refresh: "refresh-2", expiresIn: 600)
        }
        let tokens = try await harness.manager.currentTokens()
        #expect(tokens.accessToken == "access-2")
        #expect(tokens.refreshToken == "refresh-2")
        #expect(tokens.generation == 2)
        #expect(tokens.issuedAt == start)
        #expect(tokens.expiresAt == start + 600)
        #expect(tokens.lastRefresh == TokenSet.RefreshRecord(at: start, outcome: "ok"))
        let form = try #require(harness.fake.tokenRequests.first?.form)
        #expect(
            form == ["grant_type": "refresh_token", "refresh_token": "refresh-1", "client_id": JWSFixtures.clientID])
        #expect(try harness.onDisk() == tokens)
    }

    @Test func hundredConcurrentCallersCauseOneRequest() async throws {
        let harness = try await Harness(delay: .milliseconds(200)) { _ in
            FakeProvider.tokens(access: "access-2", refresh: "refresh-2")
        }
        let manager = harness.manager
        let results = try await withThrowingTaskGroup(of: TokenSet.self) { group in
            for _ in 0..<100 { group.addTask { try await manager.currentTokens() } }
            var results: [TokenSet] = []
            for try await tokens in group { results.append(tokens) }
            return results
        }
        #expect(results.count == 100)
        #expect(harness.fake.tokenRequests.count == 1)
        #expect(await manager.refreshCount == 1)
        #expect(Set(results.map(\.accessToken)) == ["access-2"])
        #expect(Set(results.map(\.generation)) == [2])
    }

    @Test func twoProcessesRefreshingAtOnceCauseOneRequest() async throws {
        // Two managers with their own memory share the file and its lock, like two proxyctl processes.
        let harness = try await Harness(delay: .milliseconds(200)) { _ in
            FakeProvider.tokens(access: "access-2", refresh: "refresh-2")
        }
        let first = harness.manager
        let second = await harness.secondManager()
        let results = try await withThrowingTaskGroup(of: TokenSet.self) { group in
            for index in 0..<40 {
                let manager = index.isMultiple(of: 2) ? first : second
                group.addTask { try await manager.currentTokens() }
            }
            var results: [TokenSet] = []
            for try await tokens in group { results.append(tokens) }
            return results
        }
        #expect(harness.fake.tokenRequests.count == 1)
        #expect(Set(results.map(\.accessToken)) == ["access-2"])
        #expect(try harness.onDisk()?.refreshToken == "refresh-2")
    }

    @Test func refreshReplacingAnOlderGenerationReturnsTheNewerTokens() async throws {
        let harness = try await Harness { request in
            FakeProvider.tokens(access: "access-\(request.index + 1)", refresh: "refresh-\(request.index + 1)")
        }
        let refreshed = try await harness.manager.currentTokens()
        #expect(refreshed.generation == 2)
        // A request that failed with generation 1 asks again: someone already refreshed, so no new request.
        let again = try await harness.manager.refresh(replacing: 1)
        #expect(again == refreshed)
        #expect(harness.fake.tokenRequests.count == 1)
        // Generation 2 rejected by the resource: a real refresh.
        let newer = try await harness.manager.refresh(replacing: 2)
        #expect(newer.generation == 3)
        #expect(newer.accessToken == "access-3")
        #expect(harness.fake.tokenRequests.count == 2)
        #expect(harness.fake.tokenRequests.last?.form["refresh_token"] == "refresh-2")
    }

    @Test func rotatedRefreshTokenIsOnDiskBeforeTheAccessTokenIsHandedOut() async throws {
        let store = Shared<TokenStore?>(nil)
        let seenOnDisk = Shared<[String?]>([])
        let harness = try await Harness { request in
            // What is on disk while the provider answers each request.
            let onDisk = try store.value?.load("test")
            seenOnDisk.update { $0.append(onDisk?.refreshToken) }
            switch request.index {
            case 1: return FakeProvider.tokens(access: "access-2", refresh: "refresh-2", expiresIn: 600)
            // RFC 6749 §6: an answer without a refresh token keeps the current one.
            default: return FakeProvider.tokens(access: "access-3", expiresIn: 600)
            }
        }
        store.set(TokenStore(stateDirectory: harness.store.stateDirectory))
        let tokens = try await harness.manager.currentTokens()
        #expect(tokens.accessToken == "access-2")
        // By the time the caller holds access-2, the rotated refresh token has replaced the old one on disk.
        let afterFirst = try #require(try harness.onDisk())
        #expect(afterFirst.refreshToken == "refresh-2")
        #expect(afterFirst.accessToken == "access-2")
        #expect(afterFirst.generation == 2)

        // The next refresh, by another process, uses the rotated token read from disk.
        harness.clock.advance(600)
        let other = await harness.secondManager()
        let third = try await other.currentTokens()
        #expect(third.accessToken == "access-3")
        #expect(third.refreshToken == "refresh-2")
        #expect(harness.fake.tokenRequests.map { $0.form["refresh_token"] } == ["refresh-1", "refresh-2"])
        #expect(seenOnDisk.value == ["refresh-1", "refresh-2"])
        #expect(try harness.onDisk()?.refreshToken == "refresh-2")
    }

    @Test func invalidGrantAsksForSignInAndDropsTheRefreshToken() async throws {
        let harness = try await Harness { _ in
            FakeProvider.json(400, ["error": "invalid_grant", "error_description": "Token is not active"])
        }
        let error = await authFailure { try await harness.manager.currentTokens() }
        guard case .reauthenticate(let reason) = error else {
            Issue.record("expected reauthenticate, got \(String(describing: error))")
            return
        }
        #expect(reason.contains("proxyctl login test"))
        let onDisk = try #require(try harness.onDisk())
        #expect(onDisk.refreshToken == nil)
        #expect(onDisk.lastRefresh?.outcome == "reauthenticate")
        #expect(onDisk.lastRefresh?.at == start)
        // The dead token is not tried again.
        let again = await authFailure { try await harness.manager.currentTokens() }
        #expect(again?.category == "reauthenticate")
        #expect(harness.fake.tokenRequests.count == 1)
    }

    @Test func emptyRejectionFromGlewlwydAlsoAsksForSignIn() async throws {
        let harness = try await Harness { _ in HTTPResponse(status: 400) }
        let error = await authFailure { try await harness.manager.currentTokens() }
        #expect(error?.category == "reauthenticate")
        #expect(try harness.onDisk()?.refreshToken == nil)
    }

    @Test func invalidGrantAfterAnotherProcessRotatedTheTokenAdoptsTheirTokens() async throws {
        let theirs = storedTokens(
            accessToken: "access-theirs", refreshToken: "refresh-theirs", issuedAt: start, expiresAt: start + 3600,
            generation: 7)
        let stateDirectory = Shared("")
        let harness = try await Harness { _ in
            // A process that does not take the lock rotated the token while our request was under way.
            try TokenStore(stateDirectory: stateDirectory.value).save(theirs)
            return FakeProvider.json(400, ["error": "invalid_grant"])
        }
        stateDirectory.set(harness.store.stateDirectory)
        let tokens = try await harness.manager.currentTokens()
        #expect(tokens == theirs)
        #expect(try harness.onDisk() == theirs)
        #expect(harness.fake.tokenRequests.count == 1)
    }

    @Test func retryAfterOneSecondIsWaitedForThenSucceeds() async throws {
        let harness = try await Harness { request in
            request.index == 1
                ? HTTPResponse(status: 503, headers: [("Retry-After", "1")])
                : FakeProvider.tokens(access: "access-2", refresh: "refresh-2")
        }
        let tokens = try await harness.manager.currentTokens()
        #expect(tokens.accessToken == "access-2")
        #expect(harness.sleeps.all == [1])
        #expect(harness.fake.tokenRequests.count == 2)
        #expect(await harness.manager.refreshCount == 1)
    }

    @Test func longRetryAfterIsReportedAtOnce() async throws {
        let harness = try await Harness { _ in HTTPResponse(status: 503, headers: [("Retry-After", "120")]) }
        let error = await authFailure { try await harness.manager.currentTokens() }
        guard case .recoverable(_, let retryAfter) = error else {
            Issue.record("expected recoverable, got \(String(describing: error))")
            return
        }
        #expect(retryAfter == 120)
        #expect(harness.sleeps.all.isEmpty)
        #expect(harness.fake.tokenRequests.count == 1)
        // The refresh token stays: the provider was down, it did not refuse the token.
        let onDisk = try #require(try harness.onDisk())
        #expect(onDisk.refreshToken == "refresh-1")
        #expect(onDisk.lastRefresh?.outcome == "recoverable")
    }

    @Test func outageWithoutRetryAfterBacksOffWithinTheBudget() async throws {
        let harness = try await Harness { _ in HTTPResponse(status: 502) }
        let error = await authFailure { try await harness.manager.currentTokens() }
        #expect(
            error == .recoverable(reason: "the provider's token endpoint is unavailable (HTTP 502)", retryAfter: nil))
        #expect(harness.sleeps.all == [1, 2])
        #expect(harness.fake.tokenRequests.count == 3)
    }

    @Test func networkErrorsAreRetried() async throws {
        let harness = try await Harness { request in
            if request.index < 3 { throw TransportError.unreachable("connection refused") }
            return FakeProvider.tokens(access: "access-2")
        }
        let tokens = try await harness.manager.currentTokens()
        #expect(tokens.accessToken == "access-2")
        // No rotation: the old refresh token stays.
        #expect(tokens.refreshToken == "refresh-1")
        #expect(harness.sleeps.all == [1, 2])
    }

    @Test func certificateErrorsAreNotRetried() async throws {
        let harness = try await Harness { _ in throw TransportError.certificate("self-signed certificate") }
        let error = await authFailure { try await harness.manager.currentTokens() }
        #expect(error?.category == "configuration")
        #expect(harness.sleeps.all.isEmpty)
        #expect(harness.fake.tokenRequests.count == 1)
    }

    @Test func refreshedIDTokenIsValidatedAgainstTheProviderKeys() async throws {
        let harness = try await Harness { _ in
            FakeProvider.tokens(access: "access-2", refresh: "refresh-2", idToken: JWSFixtures.rs256)
        }
        let tokens = try await harness.manager.currentTokens()
        #expect(tokens.identity?.subject == JWSFixtures.subject)
        #expect(tokens.idToken == JWSFixtures.rs256)
        #expect(harness.fake.jwksRequests == 1)
        #expect(harness.fake.discoveryRequests == 1)
    }

    @Test func refreshedIDTokenForAnotherUserIsRefused() async throws {
        let harness = try await Harness(
            initial: storedTokens(issuedAt: start - 3700, expiresAt: start - 100, subject: "bob")
        ) { _ in FakeProvider.tokens(access: "access-2", refresh: "refresh-2", idToken: JWSFixtures.rs256) }
        let error = await authFailure { try await harness.manager.currentTokens() }
        #expect(error?.category == "reauthenticate")
        #expect(try harness.onDisk()?.accessToken == "access-1")
    }

    @Test func forgedIDTokenOnRefreshIsRefused() async throws {
        let pieces = JWSFixtures.rs256.split(separator: ".").map(String.init)
        let forged = [
            pieces[0], encodedPart(JSONObject([("sub", "alice"), ("iss", .string(JWSFixtures.issuer))])), pieces[2],
        ]
        .joined(separator: ".")
        let harness = try await Harness { _ in FakeProvider.tokens(access: "access-2", idToken: forged) }
        let error = await authFailure { try await harness.manager.currentTokens() }
        #expect(error?.category == "rejected")
        #expect(try harness.onDisk()?.accessToken == "access-1")
    }

    @Test func unsupportedTokenTypeIsAConfigurationError() async throws {
        let harness = try await Harness { _ in
            FakeProvider.json(200, ["access_token": "a", "token_type": "mac", "expires_in": 60])
        }
        let error = await authFailure { try await harness.manager.currentTokens() }
        #expect(error?.category == "configuration")
    }

    @Test func withoutARefreshTokenTheUserMustSignIn() async throws {
        let harness = try await Harness(
            initial: storedTokens(refreshToken: nil, issuedAt: start - 3700, expiresAt: start - 100)
        ) { _ in FakeProvider.tokens(access: "unexpected") }
        let error = await authFailure { try await harness.manager.currentTokens() }
        #expect(error?.category == "reauthenticate")
        #expect(harness.fake.tokenRequests.isEmpty)
    }

    @Test func notSignedIn() async throws {
        let harness = try await Harness(initial: nil) { _ in FakeProvider.tokens(access: "unexpected") }
        let error = await authFailure { try await harness.manager.currentTokens() }
        #expect(error?.category == "reauthenticate")
        #expect(error?.description.contains("proxyctl login test") == true)
    }

    @Test func tokensOfAnotherIssuerAreNotUsed() async throws {
        var foreign = storedTokens(issuedAt: start - 10, expiresAt: start + 3600)
        foreign.issuer = "https://other.example.com"
        let harness = try await Harness(initial: foreign) { _ in FakeProvider.tokens(access: "unexpected") }
        let error = await authFailure { try await harness.manager.currentTokens() }
        #expect(error?.category == "reauthenticate")
        #expect(harness.fake.tokenRequests.isEmpty)
    }
}

@Suite struct TokenManagerStoreWatchTests {
    @Test func tokensSavedByAnotherProcessArePickedUp() async throws {
        let harness = try await Harness(initial: storedTokens(issuedAt: start - 10, expiresAt: start + 3600)) { _ in
            FakeProvider.tokens(access: "unexpected")
        }
        #expect(try await harness.manager.storedTokens()?.generation == 1)
        let theirs = storedTokens(
            accessToken: "access-from-login", refreshToken: "refresh-from-login", issuedAt: start,
            expiresAt: start + 3600, generation: 5)
        try TokenStore(stateDirectory: harness.store.stateDirectory).save(theirs)
        #expect(try await harness.manager.storedTokens() == theirs)
        #expect(try await harness.manager.currentTokens() == theirs)
        #expect(harness.fake.tokenRequests.isEmpty)
    }

    @Test func fileWrittenDirectlyIsPickedUp() async throws {
        let harness = try await Harness(initial: storedTokens(issuedAt: start - 10, expiresAt: start + 3600)) { _ in
            FakeProvider.tokens(access: "unexpected")
        }
        #expect(try await harness.manager.storedTokens()?.accessToken == "access-1")
        let theirs = storedTokens(
            accessToken: "access-written-in-place", issuedAt: start, expiresAt: start + 7200, generation: 9)
        try writeInPlace(harness.store.path(for: "test"), JSON.serialize(theirs.json))
        #expect(try await harness.manager.storedTokens() == theirs)
        // A refresh that was about to replace generation 1 returns the newer tokens instead.
        #expect(try await harness.manager.refresh(replacing: 1) == theirs)
        #expect(harness.fake.tokenRequests.isEmpty)
    }

    @Test func deletedFileMeansSignedOut() async throws {
        let harness = try await Harness(initial: storedTokens(issuedAt: start - 10, expiresAt: start + 3600)) { _ in
            FakeProvider.tokens(access: "unexpected")
        }
        #expect(try await harness.manager.storedTokens() != nil)
        try harness.store.delete("test")
        #expect(try await harness.manager.storedTokens() == nil)
        let error = await authFailure { try await harness.manager.currentTokens() }
        #expect(error?.category == "reauthenticate")
    }

    @Test func damagedFileAsksForSignInAndNamesTheFile() async throws {
        let harness = try await Harness { _ in FakeProvider.tokens(access: "unexpected") }
        try writeInPlace(harness.store.path(for: "test"), "{\"version\":1")
        let error = await authFailure { try await harness.manager.currentTokens() }
        // Not "the provider is unavailable": the file is the problem, and signing in replaces it.
        #expect(error?.category == "reauthenticate")
        #expect(error?.description.contains(harness.store.path(for: "test") + " is damaged") == true)
        #expect(error?.description.contains("proxyctl login test") == true)
    }
}

/// Opens when the test says so: a provider that stalls until released.
private final class Latch: Sendable {
    private let stream: AsyncStream<Void>
    private let continuation: AsyncStream<Void>.Continuation

    init() { (stream, continuation) = AsyncStream.makeStream(of: Void.self) }

    func open() { continuation.finish() }
    func wait() async { for await _ in stream {} }
}

/// Refreshes under faults: a stalled or silent provider, a process stopping, a disk that cannot be written.
@Suite struct TokenManagerFaultTests {
    @Test func refreshWithoutAnAnswerIsNeverSentAgain() async throws {
        // The request went out and the connection died: the provider may have rotated the token.
        let harness = try await Harness { _ in throw TransportError.noAnswer("connection reset after the request") }
        let error = await authFailure { try await harness.manager.currentTokens() }
        #expect(error?.category == "reauthenticate")
        #expect(error?.description.contains("not sent again") == true)
        #expect(harness.fake.tokenRequests.count == 1)
        #expect(harness.sleeps.all.isEmpty)
        // Dropped, so no later caller (or process) sends it either.
        #expect(try harness.onDisk()?.refreshToken == nil)
        _ = await authFailure { try await harness.manager.currentTokens() }
        #expect(harness.fake.tokenRequests.count == 1)
    }

    @Test func stalledRefreshIsPendingAndLaterCallersJoinTheSameFlight() async throws {
        let latch = Latch()
        let harness = try await Harness(tokenTimeout: 200) { _ in
            await latch.wait()
            return FakeProvider.tokens(access: "access-2", refresh: "refresh-2")
        }
        let manager = harness.manager
        let first = await authFailure { try await manager.currentTokens() }
        guard case .pending(let reason, let retryAfter) = first else {
            Issue.record("expected pending, got \(String(describing: first))")
            return
        }
        #expect(reason.contains("not sent again"))
        #expect(retryAfter == 5)
        // The flight is still out: the gate says so, and the next caller joins it instead of sending again.
        #expect(!manager.gate.isIdle)
        #expect(await authFailure { try await manager.refresh(replacing: 1) }?.category == "pending")
        let waiting = Task { try await manager.currentTokens(waitingAtMost: nil) }
        latch.open()
        let tokens = try await waiting.value
        #expect(tokens.accessToken == "access-2")
        #expect(harness.fake.tokenRequests.count == 1)
        // The answer that came after everyone stopped waiting is on disk.
        #expect(try harness.onDisk()?.refreshToken == "refresh-2")
        #expect(manager.gate.isIdle)
        #expect(try await manager.currentTokens().accessToken == "access-2")
    }

    @Test func refreshThatEndsBeforeTheDeadlineIsNeverReportedPending() async throws {
        // The flight's end and the deadline's timer race to answer each caller: the end must win whenever it
        // comes first (a timer cancelled by it once answered "pending ... in 0s"). Many callers per flight
        // and many flights make a lost race likely when the order is wrong.
        let harness = try await Harness(delay: .milliseconds(1)) { request in
            FakeProvider.tokens(access: "access-\(request.index + 1)", refresh: "refresh-\(request.index + 1)")
        }
        let manager = harness.manager
        for generation in Int64(1)...300 {
            try await withThrowingTaskGroup(of: Int64.self) { group in
                for _ in 0..<20 { group.addTask { try await manager.refresh(replacing: generation).generation } }
                for try await refreshed in group { #expect(refreshed == generation + 1) }
            }
        }
    }

    @Test func stoppingBeforeTheRequestSendsNothing() async throws {
        let harness = try await Harness { _ in FakeProvider.tokens(access: "access-2", refresh: "refresh-2") }
        #expect(harness.manager.gate.close())
        let error = await authFailure { try await harness.manager.currentTokens() }
        #expect(error?.category == "cancelled")
        #expect(harness.fake.tokenRequests.isEmpty)
        #expect(try harness.onDisk()?.refreshToken == "refresh-1")
    }

    @Test func stoppingDuringTheRequestWaitsForItsAnswerToBeStored() async throws {
        let latch = Latch()
        let harness = try await Harness { _ in
            await latch.wait()
            return FakeProvider.tokens(access: "access-2", refresh: "refresh-2")
        }
        let manager = harness.manager
        let refresh = Task { try await manager.currentTokens() }
        try await pollUntil { harness.fake.tokenRequests.count == 1 }
        #expect(!manager.gate.close())
        latch.open()
        _ = try await refresh.value
        // Closable only once the answer is on disk.
        #expect(try harness.onDisk()?.refreshToken == "refresh-2")
        #expect(manager.gate.close())
    }

    @Test func providerKeysAreFetchedBeforeTheRefreshTokenIsSpent() async throws {
        // With the keys at hand, only local work stands between reading the answer and writing it.
        var initial = storedTokens(issuedAt: start - 3700, expiresAt: start - 100)
        initial.idToken = JWSFixtures.rs256
        let harness = try await Harness(initial: initial) { _ in
            FakeProvider.tokens(access: "access-2", refresh: "refresh-2", idToken: JWSFixtures.rs256)
        }
        _ = try await harness.manager.currentTokens()
        #expect(harness.fake.order == ["jwks", "token"])
    }

    @Test func answerThatCannotBeWrittenIsKeptAndWrittenLater() async throws {
        let blockPath = Shared<String?>(nil)
        let harness = try await Harness { _ in
            // While the provider answers, a directory takes the file's place: the write after it fails.
            if let file = blockPath.value {
                unlink(file)
                try FileManager.default.createDirectory(atPath: file + "/x", withIntermediateDirectories: true)
            }
            return FakeProvider.tokens(access: "access-2", refresh: "refresh-2")
        }
        let manager = harness.manager
        let file = harness.store.path(for: "test")
        blockPath.set(file)
        let tokens = try await manager.currentTokens()
        #expect(tokens.refreshToken == "refresh-2")
        #expect(await manager.hasUnsavedTokens)
        // The lock stays held meanwhile: no other process reads the file and spends the replaced token.
        let other = TokenStore(stateDirectory: harness.store.stateDirectory)
        await #expect(throws: AuthError.self) { try await other.withLock("test", timeout: 0) {} }
        #expect(!manager.gate.isIdle)
        #expect(try await manager.currentTokens().accessToken == "access-2")
        // Room again: the next use writes them, and lets the lock and the gate go.
        try FileManager.default.removeItem(atPath: file)
        #expect(try await manager.currentTokens().accessToken == "access-2")
        #expect(await !manager.hasUnsavedTokens)
        #expect(try harness.onDisk()?.refreshToken == "refresh-2")
        #expect(try await other.withLock("test", timeout: 0) { true })
        #expect(manager.gate.isIdle)
        #expect(harness.fake.tokenRequests.count == 1)
    }

    @Test func killedWritersTemporaryFilesAreRemovedByTheNextRefresh() async throws {
        let harness = try await Harness { _ in FakeProvider.tokens(access: "access-2", refresh: "refresh-2") }
        let directory = harness.store.tokensDirectory
        let leftovers = [".test.99999.12345.tmp", ".test.1.2.tmp"]
        let kept = [".other.99999.1.tmp", ".test.keep.tmp", ".test.\(getpid()).7.tmp"]
        for name in leftovers + kept { try writeInPlace("\(directory)/\(name)", "{\"refresh_token\":\"secret\"}") }
        _ = try await harness.manager.currentTokens()
        let names = Set(try FileManager.default.contentsOfDirectory(atPath: directory))
        #expect(names.isDisjoint(with: leftovers))
        #expect(names.isSuperset(of: kept))
    }
}

/// Polls `condition` every 10 ms for up to 60 s. A liveness wait, not a timing check: on a busy 2-core machine
/// a task started by a test can wait seconds before it first runs (10 s was exceeded once, 2026-12-02, while the
/// exhaustive walks of ProxyCoreTests still held the cooperative threads; they run on threads of their own
/// now, see `offThePool` there).
private func pollUntil(_ condition: () throws -> Bool) async throws {
    let deadline = ContinuousClock.now + .seconds(60)
    while try !condition() {
        guard ContinuousClock.now < deadline else {
            Issue.record("condition not met within 60 s")
            return
        }
        try await Task.sleep(for: .milliseconds(10))
    }
}
