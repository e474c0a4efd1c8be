import Testing

@testable import ProxyOAuth

/// What the browser's last page says when a sign-in ends: the provider, the account, where to go; or why not
/// and the command to try again.
@Suite struct SignInEndTests {
    @Test func signedInNamesTheProviderAndTheAccount() {
        var identity = Identity(subject: "alice-0001")
        identity.name = "Alice Liddell"
        identity.email = "alice@example.test"
        let end = SignInEnd.signedIn(provider: "corp", account: SignInEnd.account(identity))
        #expect(end.title == "Signed in to corp")
        #expect(
            end.message
                == "You are signed in to corp as Alice Liddell <alice@example.test>, and proxyctl has stored the tokens. Go back to the terminal; you can close this tab."
        )
        #expect(
            SignInEnd.signedIn(provider: "corp", account: nil).message.hasPrefix(
                "You are signed in to corp, and proxyctl"))
    }

    @Test func theAccountIsTheBestNameTheIDTokenGives() {
        var identity = Identity(subject: "s-1")
        #expect(SignInEnd.account(identity) == "s-1")
        identity.email = "a@example.test"
        #expect(SignInEnd.account(identity) == "a@example.test")
        identity.email = nil
        identity.name = "Ada"
        #expect(SignInEnd.account(identity) == "Ada")
    }

    @Test func aFailureGivesTheReasonAndTheCommand() {
        let end = SignInEnd.failed(
            provider: "corp", reason: "the sign-in was declined (access_denied)", retry: "proxyctl login corp")
        #expect(end.title == "Sign-in to corp failed")
        #expect(
            end.message
                == "proxyctl could not sign you in: The sign-in was declined (access_denied). Nothing was stored. To try again, run in the terminal: proxyctl login corp"
        )
    }
}
