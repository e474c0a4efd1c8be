import Testing

@testable import ProxyCore

private func basic(_ userPass: String) -> String { "Basic " + Base64.encode(userPass.utf8) }

private func basic(_ bytes: [UInt8]) -> String { "Basic " + Base64.encode(bytes) }

/// `proxy_auth_file` and the check of `Proxy-Authorization: Basic` (RFC 9110 §11.7.1, RFC 7617).
@Suite struct ProxyAuthorizationTests {
    private func credentials(_ text: String = "alice:wonderland\nbob:pa:ss word\n") throws -> ProxyCredentials {
        try ProxyCredentials.parse(text, file: "users").get()
    }

    @Test func parseUsersFile() throws {
        let users = try credentials("# proxy users\nalice:wonderland\n\n   \n#bob:disabled\ncarol: spaced pass \n")
        #expect(users.count == 2)
        #expect(users.check(basic("alice:wonderland")) == .allowed(user: "alice"))
        // The password is everything after the first colon, spaces included.
        #expect(users.check(basic("carol: spaced pass ")) == .allowed(user: "carol"))
        #expect(users.check(basic("carol:spaced pass")) == .invalid)
        #expect(users.check(basic("bob:disabled")) == .invalid)
        #expect(users.check(basic("#bob:disabled")) == .invalid)
    }

    @Test func passwordsMayHoldColonsAndSpaces() throws {
        let users = try credentials()
        #expect(users.count == 2)
        #expect(users.check(basic("bob:pa:ss word")) == .allowed(user: "bob"))
        #expect(users.check(basic("bob:pa")) == .invalid)
    }

    @Test func crlfUsersFile() throws {
        let users = try credentials("# users\r\nalice:wonderland\r\n\r\nbob:builder\r\n")
        #expect(users.count == 2)
        #expect(users.check(basic("alice:wonderland")) == .allowed(user: "alice"))
        #expect(users.check(basic("bob:builder")) == .allowed(user: "bob"))
    }

    @Test(arguments: [
        ("alice:wonderland\nnocolon\n", 2),
        ("alice:wonderland\n:password\n", 2),
        ("alice:wonderland\n\n\nbob:\n", 4),
        ("alice:wonderland\nalice:again\n", 2),
    ])
    func badLineNamesItsLine(text: String, line: Int) {
        guard case .failure(let error) = ProxyCredentials.parse(text, file: "users") else {
            Issue.record("a bad users file was accepted")
            return
        }
        #expect(error == ConfigError(file: "users", line: line, ""))
        #expect(!error.description.contains("wonderland"))
        #expect(!error.description.contains("again"))
    }

    @Test(arguments: ["", "\n", "# only comments\n\n"])
    func fileWithoutUsersIsAnError(text: String) {
        guard case .failure(let error) = ProxyCredentials.parse(text, file: "users") else {
            Issue.record("an empty users file was accepted")
            return
        }
        #expect(error == ConfigError(file: "users", line: nil, ""))
    }

    @Test func check() throws {
        let users = try credentials()
        #expect(users.check(nil) == .missing)
        #expect(users.check(basic("alice:wonderland")) == .allowed(user: "alice"))
        #expect(users.check("basic " + Base64.encode("alice:wonderland".utf8)) == .allowed(user: "alice"))
        #expect(users.check("BASIC  " + Base64.encode("alice:wonderland".utf8) + " ") == .allowed(user: "alice"))
        #expect(users.check(basic("alice:wonderlanD")) == .invalid)
        #expect(users.check(basic("alice:wonderlan")) == .invalid)
        #expect(users.check(basic("alice:wonderland!")) == .invalid)
        #expect(users.check(basic("alice:")) == .invalid)
        #expect(users.check(basic("Alice:wonderland")) == .invalid)
        #expect(users.check(basic("mallory:wonderland")) == .invalid)
        #expect(users.check(basic("alicewonderland")) == .invalid)
        #expect(users.check(basic(":wonderland")) == .invalid)
        #expect(users.check("Bearer " + Base64.encode("alice:wonderland".utf8)) == .invalid)
        #expect(users.check("Basic") == .invalid)
        #expect(users.check("Basic !!!!") == .invalid)
        #expect(users.check("") == .invalid)
        #expect(users.check(Base64.encode("alice:wonderland".utf8)) == .invalid)
    }

    @Test func lengthsThatDifferBy256AreNotEqual() throws {
        // A password followed by 256 NUL bytes must not pass as the password.
        let users = try credentials()
        let padded = "alice:wonderland".bytes + [UInt8](repeating: 0, count: 256)
        #expect(users.check(basic(padded)) == .invalid)
        #expect(!ProxyCredentials.constantTimeEqual([], [UInt8](repeating: 0, count: 256)))
        #expect(!ProxyCredentials.constantTimeEqual([1], [1] + [UInt8](repeating: 0, count: 256)))
    }

    @Test func constantTimeEqual() {
        #expect(ProxyCredentials.constantTimeEqual([], []))
        #expect(ProxyCredentials.constantTimeEqual([1, 2, 3], [1, 2, 3]))
        #expect(!ProxyCredentials.constantTimeEqual([1, 2, 3], [1, 2, 4]))
        #expect(!ProxyCredentials.constantTimeEqual([1, 2, 3], [1, 2]))
        #expect(!ProxyCredentials.constantTimeEqual([1, 2], [1, 2, 0]))
        #expect(!ProxyCredentials.constantTimeEqual([0], []))
    }
}
