import Foundation
import ProxyCore
import Synchronization
import TestFixtures
import Testing

@testable import ProxyOAuth

/// A store whose state directory does not exist yet (two levels below a fresh temporary directory).
private func freshStore(_ temporary: TemporaryDirectory) -> TokenStore {
    TokenStore(stateDirectory: temporary.path + "/state/proxyctl")
}

private func fileNames(_ directory: String) throws -> [String] {
    try FileManager.default.contentsOfDirectory(atPath: directory).sorted()
}

@Suite struct TokenStoreFileTests {
    @Test func saveCreatesPrivateDirectoriesAndFile() throws {
        let temporary = try TemporaryDirectory()
        let store = freshStore(temporary)
        let tokens = storedTokens(issuedAt: 1000, expiresAt: 4600)
        try store.save(tokens)
        #expect(mode(store.stateDirectory) == 0o700)
        #expect(mode(store.tokensDirectory) == 0o700)
        #expect(mode(store.path(for: "test")) == 0o600)
        #expect(try store.load("test") == tokens)
        #expect(try fileNames(store.tokensDirectory) == ["test.json"])
    }

    @Test func permissiveUmaskDoesNotLoosenModes() async throws {
        let temporary = try TemporaryDirectory()
        let store = freshStore(temporary)
        // The umask belongs to the whole process, which runs other tests in parallel: open it only around
        // the synchronous save, without suspending.
        let previous = umask(0)
        let saved = Result { try store.save(storedTokens(issuedAt: 1000, expiresAt: nil)) }
        umask(previous)
        try saved.get()
        _ = try await store.withLock("test") { 0 }
        #expect(mode(store.stateDirectory) == 0o700)
        #expect(mode(store.tokensDirectory) == 0o700)
        #expect(mode(store.path(for: "test")) == 0o600)
        #expect(mode(store.lockPath(for: "test")) == 0o600)
    }

    @Test func loosenedDirectoriesAreTightened() throws {
        let temporary = try TemporaryDirectory()
        let store = freshStore(temporary)
        try store.prepare()
        chmod(store.stateDirectory, 0o755)
        chmod(store.tokensDirectory, 0o777)
        try store.save(storedTokens(issuedAt: 1000, expiresAt: nil))
        #expect(mode(store.stateDirectory) == 0o700)
        #expect(mode(store.tokensDirectory) == 0o700)
    }

    @Test func loosenedFileIsTightenedWhenRead() throws {
        let temporary = try TemporaryDirectory()
        let store = freshStore(temporary)
        let tokens = storedTokens(issuedAt: 1000, expiresAt: nil)
        try store.save(tokens)
        chmod(store.path(for: "test"), 0o644)
        #expect(try store.load("test") == tokens)
        #expect(mode(store.path(for: "test")) == 0o600)
    }

    @Test func stateDirectoryThatIsAFileIsAnError() throws {
        let temporary = try TemporaryDirectory()
        let store = TokenStore(stateDirectory: temporary.path + "/file")
        try writeInPlace(store.stateDirectory, "x")
        let error = try #require(throws: StoreError.self) { try store.prepare() }
        #expect(error.path == store.stateDirectory)
        #expect(error.reason == "is not a directory")
    }

    @Test(.enabled(if: getuid() == 0, "needs root to give a directory to another user"))
    func directoryOfAnotherUserIsRefused() throws {
        let temporary = try TemporaryDirectory()
        let store = freshStore(temporary)
        try store.prepare()
        try #require(chown(store.tokensDirectory, 4242, 4242) == 0)
        let error = try #require(throws: StoreError.self) { try store.save(storedTokens(issuedAt: 1, expiresAt: nil)) }
        #expect(error.path == store.tokensDirectory)
        #expect(error.reason.contains("belongs to another user"))
    }

    @Test func missingFileLoadsAsNothing() throws {
        let temporary = try TemporaryDirectory()
        #expect(try freshStore(temporary).load("test") == nil)
        #expect(freshStore(temporary).version("test") == nil)
    }

    @Test(arguments: ["", "{", "{\"version\":1}", "[]", "{\"version\":2,\"provider\":\"test\"}", "\u{FF}garbage"])
    func damagedFileNamesItsPath(_ content: String) throws {
        let temporary = try TemporaryDirectory()
        let store = freshStore(temporary)
        try store.prepare()
        try writeInPlace(store.path(for: "test"), content)
        let error = try #require(throws: StoreError.self) { try store.load("test") }
        #expect(error.path == store.path(for: "test"))
        #expect(error.description.hasPrefix(store.path(for: "test") + " "))
        #expect(error.description.contains("proxyctl login test"))
    }

    @Test func symbolicLinkIsNotFollowed() throws {
        let temporary = try TemporaryDirectory()
        let store = freshStore(temporary)
        let elsewhere = TokenStore(stateDirectory: temporary.path + "/elsewhere")
        try elsewhere.save(storedTokens(issuedAt: 1, expiresAt: nil))
        try store.prepare()
        try #require(symlink(elsewhere.path(for: "test"), store.path(for: "test")) == 0)
        let error = try #require(throws: StoreError.self) { try store.load("test") }
        #expect(error.path == store.path(for: "test"))
    }

    @Test func replaceIsAtomic() throws {
        let temporary = try TemporaryDirectory()
        let store = freshStore(temporary)
        let old = storedTokens(accessToken: "old", issuedAt: 1000, expiresAt: 4600, generation: 1)
        try store.save(old)
        let oldVersion = try #require(store.version("test"))
        // A reader that opened the old file keeps reading the old file: the new one is a different inode,
        // renamed over the name, never written in place.
        let reader = open(store.path(for: "test"), O_RDONLY)
        try #require(reader >= 0)
        defer { close(reader) }
        let new = storedTokens(accessToken: "new-and-longer", issuedAt: 2000, expiresAt: 5600, generation: 2)
        try store.save(new)
        var buffer = [UInt8](repeating: 0, count: 65536)
        let count = read(reader, &buffer, buffer.count)
        try #require(count > 0)
        let oldText = try JSON.parse(Array(buffer[0..<count])).get()
        #expect(TokenSet(json: oldText) == old)
        #expect(try store.load("test") == new)
        #expect(store.version("test")?.inode != oldVersion.inode)
        // No temporary file is left behind.
        #expect(try fileNames(store.tokensDirectory) == ["test.json"])
    }

    @Test func leftoverTemporaryFileFromACrashNeverReplacesTheTokens() throws {
        let temporary = try TemporaryDirectory()
        let store = freshStore(temporary)
        let old = storedTokens(accessToken: "old", issuedAt: 1000, expiresAt: 4600)
        try store.save(old)
        // A save that crashed after writing half of its temporary file, before the rename.
        let crashed = "\(store.tokensDirectory)/.test.99999.12345.tmp"
        let half = String(
            JSON.serialize(storedTokens(accessToken: "crashed", issuedAt: 2000, expiresAt: nil).json).prefix(40))
        try writeInPlace(crashed, half)
        #expect(try store.load("test") == old)
        // Later saves work beside it, and loading still reads only the real file.
        let new = storedTokens(accessToken: "new", issuedAt: 3000, expiresAt: nil, generation: 2)
        try store.save(new)
        #expect(try store.load("test") == new)
        #expect(try String(contentsOfFile: crashed, encoding: .utf8) == half)
        #expect(try fileNames(store.tokensDirectory) == [".test.99999.12345.tmp", "test.json"])
    }

    @Test func failedRenameRemovesItsTemporaryFile() throws {
        let temporary = try TemporaryDirectory()
        let store = freshStore(temporary)
        try store.prepare()
        // A non-empty directory in the way of the file: the rename fails after the temporary file was written.
        try FileManager.default.createDirectory(
            atPath: store.path(for: "test") + "/x", withIntermediateDirectories: true)
        let error = try #require(throws: StoreError.self) { try store.save(storedTokens(issuedAt: 1, expiresAt: nil)) }
        #expect(error.path == store.path(for: "test"))
        #expect(error.reason.hasPrefix("cannot be replaced"))
        // The temporary file was removed.
        #expect(try fileNames(store.tokensDirectory) == ["test.json"])
    }

    @Test func providersAreKeptApart() throws {
        let temporary = try TemporaryDirectory()
        let store = freshStore(temporary)
        let first = storedTokens(provider: "first", accessToken: "a", issuedAt: 1, expiresAt: nil)
        let second = storedTokens(provider: "second", accessToken: "b", issuedAt: 1, expiresAt: nil)
        try store.save(first)
        try store.save(second)
        #expect(try store.load("first") == first)
        #expect(try store.load("second") == second)
    }

    @Test func deleteReportsWhetherThereWereTokens() throws {
        let temporary = try TemporaryDirectory()
        let store = freshStore(temporary)
        try store.save(storedTokens(issuedAt: 1, expiresAt: nil))
        #expect(try store.delete("test"))
        #expect(try store.load("test") == nil)
        #expect(try !store.delete("test"))
    }

    @Test func versionChangesWithEverySave() throws {
        let temporary = try TemporaryDirectory()
        let store = freshStore(temporary)
        var versions: [TokenStore.FileVersion] = []
        for generation in Int64(1)...5 {
            try store.save(storedTokens(issuedAt: 1, expiresAt: nil, generation: generation))
            versions.append(try #require(store.version("test")))
        }
        for index in 1..<versions.count { #expect(versions[index] != versions[index - 1]) }
        #expect(store.version("test") == versions.last)
    }

    @Test func defaultStateDirectory() {
        #expect(
            TokenStore.defaultStateDirectory(environment: ["XDG_STATE_HOME": "/x/state", "HOME": "/home/u"])
                == "/x/state/proxyctl")
        // XDG Base Directory: a relative path is invalid and ignored.
        #expect(
            TokenStore.defaultStateDirectory(environment: ["XDG_STATE_HOME": "state", "HOME": "/home/u"])
                == "/home/u/.local/state/proxyctl")
        #expect(
            TokenStore.defaultStateDirectory(environment: ["XDG_STATE_HOME": "", "HOME": "/home/u"])
                == "/home/u/.local/state/proxyctl")
        #expect(TokenStore.defaultStateDirectory(environment: ["HOME": ""]) == nil)
        #expect(TokenStore.defaultStateDirectory(environment: [:]) == nil)
    }
}

/// What happened in which order, across tasks.
private final class EventLog: Sendable {
    private let events = Mutex<[String]>([])

    func add(_ event: String) { events.withLock { $0.append(event) } }
    var all: [String] { events.withLock { $0 } }
}

@Suite struct TokenStoreReservationTests {
    @Test func reservationHoldsTheRoomThenBecomesTheFile() throws {
        let temporary = try TemporaryDirectory()
        let store = freshStore(temporary)
        try store.save(storedTokens(accessToken: "old", issuedAt: 1, expiresAt: nil))
        let reservation = try store.reserve("test", bytes: 20_000)
        // Written and synced before the refresh token is spent: the room is really taken.
        let placeholder = try #require(try fileNames(store.tokensDirectory).first { $0.hasSuffix(".tmp") })
        var info = stat()
        try #require(stat("\(store.tokensDirectory)/\(placeholder)", &info) == 0)
        #expect(info.st_size == 20_000 && info.st_blocks * 512 >= 20_000)
        #expect(info.st_mode & 0o777 == 0o600)
        let new = storedTokens(accessToken: "new", issuedAt: 2, expiresAt: nil, generation: 2)
        try reservation.commit(new)
        #expect(try store.load("test") == new)
        #expect(try fileNames(store.tokensDirectory) == ["test.json"])
    }

    @Test func droppedReservationLeavesNothing() throws {
        let temporary = try TemporaryDirectory()
        let store = freshStore(temporary)
        try store.save(storedTokens(issuedAt: 1, expiresAt: nil))
        do { _ = try store.reserve("test", bytes: 100) }
        #expect(try fileNames(store.tokensDirectory) == ["test.json"])
    }

    @Test func staleTemporaryFilesAreRemovedOthersKept() throws {
        let temporary = try TemporaryDirectory()
        let store = freshStore(temporary)
        try store.save(storedTokens(issuedAt: 1, expiresAt: nil))
        for name in [".test.99999.12345.tmp", ".test.bar.1.2.tmp", ".test.bar.json", ".test.\(getpid()).3.tmp"] {
            try writeInPlace("\(store.tokensDirectory)/\(name)", "x")
        }
        store.removeStaleTemporaries("test")
        // Another provider's (test.bar), other names and this process's own are left alone.
        #expect(
            try fileNames(store.tokensDirectory)
                == [".test.\(getpid()).3.tmp", ".test.bar.1.2.tmp", ".test.bar.json", "test.json"])
    }

    @Test func errorsNameTheirCauseAndFix() {
        let full = StoreError(path: "/s/tokens/test.json", "cannot be written", errno: ENOSPC)
        guard case .storage(let reason) = full.authError(provider: "test") else {
            Issue.record("a full disk is a storage problem")
            return
        }
        #expect(reason.contains("/s/tokens/test.json cannot be written: No space left on device"))
        #expect(reason.contains("free space on the disk that holds /s/tokens"))
        let readOnly = StoreError(path: "/s/tokens/test.json", "cannot be written", errno: EROFS)
        #expect(readOnly.authError(provider: "test").description.contains("make /s/tokens writable"))
        let damaged = StoreError(path: "/s/tokens/test.json", "is damaged", kind: .damaged)
        #expect(damaged.authError(provider: "test").category == "reauthenticate")
    }
}

@Suite struct TokenStoreLockTests {
    @Test func secondHolderInTheProcessWaitsForTheFirst() async throws {
        let temporary = try TemporaryDirectory()
        let store = freshStore(temporary)
        let log = EventLog()
        let (entered, enteredContinuation) = AsyncStream.makeStream(of: Void.self)
        let first = Task {
            try await store.withLock("test") {
                log.add("first in")
                enteredContinuation.yield()
                try await Task.sleep(for: .milliseconds(300))
                log.add("first out")
            }
        }
        for await _ in entered { break }
        try await store.withLock("test", timeout: 10_000) { log.add("second in") }
        try await first.value
        #expect(log.all == ["first in", "first out", "second in"])
    }

    @Test func secondHolderTimesOutWithARecoverableError() async throws {
        let temporary = try TemporaryDirectory()
        let store = freshStore(temporary)
        let started = ContinuousClock.now
        try await store.withLock("test") {
            let error = try await #require(throws: AuthError.self) {
                try await store.withLock("test", timeout: 200) { Issue.record("entered a held lock") }
            }
            #expect(error.category == "recoverable")
            #expect(error.description.contains(store.lockPath(for: "test")))
        }
        #expect(ContinuousClock.now - started >= .milliseconds(200))
        // Released after the body: the next holder enters at once.
        #expect(try await store.withLock("test", timeout: 0) { 7 } == 7)
    }

    @Test func lockIsReleasedWhenTheBodyThrows() async throws {
        let temporary = try TemporaryDirectory()
        let store = freshStore(temporary)
        await #expect(throws: CancellationError.self) {
            try await store.withLock("test") { throw CancellationError() }
        }
        #expect(try await store.withLock("test", timeout: 0) { true })
    }

    @Test func locksOfDifferentProvidersAreIndependent() async throws {
        let temporary = try TemporaryDirectory()
        let store = freshStore(temporary)
        let value = try await store.withLock("first") {
            try await store.withLock("second", timeout: 0) { 1 }
        }
        #expect(value == 1)
    }

    @Test func anotherProcessHoldingTheLockIsWaitedFor() async throws {
        let temporary = try TemporaryDirectory()
        let store = freshStore(temporary)
        try store.prepare()
        let marker = temporary.path + "/child-holds-lock"
        let go = temporary.path + "/child-may-go"
        let released = temporary.path + "/child-lets-go"
        // util-linux flock(1) takes the same flock(2) lock from another process and holds it until told to go
        // (no fixed sleep: a loaded machine must not make the test pass or fail by timing).
        let child = Process()
        child.executableURL = URL(fileURLWithPath: "/usr/bin/flock")
        child.arguments = [
            "--exclusive", store.lockPath(for: "test"), "/bin/sh", "-c",
            "touch '\(marker)'; while [ ! -e '\(go)' ]; do sleep 0.02; done; touch '\(released)'",
        ]
        try child.run()
        defer { if child.isRunning { child.terminate() } }
        let deadline = ContinuousClock.now + .seconds(10)
        while !FileManager.default.fileExists(atPath: marker) {
            try #require(ContinuousClock.now < deadline, "the child never took the lock")
            try await Task.sleep(for: .milliseconds(10))
        }
        // While the child holds it: a short wait times out...
        await #expect(throws: AuthError.self) {
            try await store.withLock("test", timeout: 100) { Issue.record("entered a lock another process holds") }
        }
        // ...and a long one gets the lock only once the child has finished its command and let go.
        _ = FileManager.default.createFile(atPath: go, contents: nil)
        let childWasDone = try await store.withLock("test", timeout: 10_000) {
            FileManager.default.fileExists(atPath: released)
        }
        #expect(childWasDone)
        child.waitUntilExit()
        #expect(child.terminationStatus == 0)
    }

    @Test func anotherProcessCannotTakeTheLockWeHold() async throws {
        let temporary = try TemporaryDirectory()
        let store = freshStore(temporary)
        let status = try await store.withLock("test") {
            let child = Process()
            child.executableURL = URL(fileURLWithPath: "/usr/bin/flock")
            child.arguments = ["--nonblock", "--conflict-exit-code", "75", store.lockPath(for: "test"), "true"]
            try child.run()
            child.waitUntilExit()
            return child.terminationStatus
        }
        #expect(status == 75)
        // And can once we let go.
        let child = Process()
        child.executableURL = URL(fileURLWithPath: "/usr/bin/flock")
        child.arguments = ["--nonblock", "--conflict-exit-code", "75", store.lockPath(for: "test"), "true"]
        try child.run()
        child.waitUntilExit()
        #expect(child.terminationStatus == 0)
    }
}
