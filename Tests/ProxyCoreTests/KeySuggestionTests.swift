import Testing

@testable import ProxyCore

/// An unknown key is answered with the key meant when it is a typo of one, else with the section's keys.
@Suite struct KeySuggestionTests {
    @Test(arguments: [
        ("clientid", "client_id"),
        ("client-id", "client_id"),
        ("Client_ID", "client_id"),
        ("cilent_id", "client_id"),
        ("client_idd", "client_id"),
        ("isuer", "issuer"),
        ("redirect_prot", "redirect_port"),
        ("scope", "scopes"),
    ])
    func aTypoOfAProviderKeyNamesIt(typed: String, meant: String) {
        #expect(KeySuggestion.closest(to: typed, among: ProviderConfig.keys) == meant)
        #expect(KeySuggestion.message(for: typed, among: ProviderConfig.keys) == "unknown key; did you mean \(meant)?")
    }

    @Test(arguments: [("listn", "listen"), ("state-dir", "state_dir"), ("idle_timout", "idle_timeout")])
    func aTypoOfAProxyKeyNamesIt(typed: String, meant: String) {
        #expect(KeySuggestion.closest(to: typed, among: ConfigParser.proxyKeys) == meant)
    }

    @Test(arguments: ["bogus", "x", "frobnicate_everything", "id"])
    func aKeyNearNoneListsThemAll(typed: String) {
        #expect(KeySuggestion.closest(to: typed, among: ProviderConfig.keys) == nil)
        #expect(
            KeySuggestion.message(for: typed, among: ["issuer", "client_id"])
                == "unknown key; expected one of issuer, client_id")
    }

    @Test func twoKeysAsNearAreNotGuessedBetween() {
        #expect(KeySuggestion.closest(to: "abd", among: ["abc", "abe"]) == nil)
        #expect(KeySuggestion.closest(to: "abcd", among: ["abce", "abcdef"]) == "abce")
    }

    @Test func editDistanceCountsASwapAsOneEdit() {
        func distance(_ a: String, _ b: String) -> Int { KeySuggestion.editDistance(Array(a.utf8), Array(b.utf8)) }
        #expect(distance("", "abc") == 3)
        #expect(distance("abc", "abc") == 0)
        #expect(distance("acb", "abc") == 1)
        #expect(distance("kitten", "sitting") == 3)
        #expect(distance("clientid", "client_id") == 1)
    }

    @Test func theParserSaysWhichKeyWasMeant() {
        let text = "[provider corp]\nissuer = https://login.example.test\nclientid = proxyctl\n"
        guard case .failure(let errors) = ConfigParser(homeDirectory: nil, baseDirectory: nil).parse(text, file: "p")
        else {
            Issue.record("accepted")
            return
        }
        #expect(
            errors.errors.map(\.description).contains(
                "p:3: [provider corp] clientid: unknown key; did you mean client_id?"))
        let origin = "[origin https://api.test]\nprovidr = corp\n"
        guard case .failure(let more) = ConfigParser(homeDirectory: nil, baseDirectory: nil).parse(origin, file: "p")
        else {
            Issue.record("accepted")
            return
        }
        #expect(
            more.errors.map(\.description).contains(
                "p:2: [origin https://api.test] providr: unknown key; did you mean provider?"))
    }
}
