import Testing

@testable import ProxyCore

/// The provider name `proxyctl init` writes without `--name`: whose sign-in it is, never an address.
@Suite struct ProviderNameTests {
    @Test(arguments: [
        ("login.example.com", "example"),
        ("accounts.google.com", "google"),
        ("sso.corp.co.uk", "corp"),
        ("id.example.com.au", "example"),
        ("example.org", "example"),
        ("LOGIN.Example.COM", "example"),
        ("idp.test", "idp"),
    ])
    func aHostNameGivesItsRegistrableLabel(host: String, name: String) {
        #expect(ProviderConfig.defaultName(issuerHost: host) == (name, false))
    }

    @Test(arguments: ["127.0.0.1", "10.1.2.3", "::1", "[::1]", "localhost", "sso"])
    func anAddressOrOneLabelGivesDefault(host: String) {
        #expect(ProviderConfig.defaultName(issuerHost: host) == ("default", true))
    }
}
