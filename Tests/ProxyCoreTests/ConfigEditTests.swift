import Testing

@testable import ProxyCore

@Suite struct ConfigEditTests {
    static let text = """
        # written by proxyctl init
        [proxy]
        listen = 127.0.0.1:8080

        [provider corp]
        # client_id: registered at https://login.example (RFC 7591)
        issuer = https://login.example
          client_id = old-client
        redirect_port = 17755
        scopes = openid api

        [provider other]
        client_id = old-client
        redirect_port = 17755

        """

    @Test func valuesAreReplacedInTheirSectionOnlyAndEverythingElseStays() throws {
        let edited = try #require(
            ConfigEdit.setting(
                [("client_id", "new-client"), ("redirect_port", "17760")], inSection: "provider", argument: "corp",
                of: Self.text))
        #expect(
            edited
                == Self.text.replacing(
                    "  client_id = old-client\nredirect_port = 17755\nscopes",
                    with: "  client_id = new-client\nredirect_port = 17760\nscopes"))
        let (document, errors) = INIDocument.parse(edited, file: "x")
        #expect(errors.isEmpty)
        #expect(document.sections.last?.entries.map(\.value) == ["old-client", "17755"])
    }

    @Test func aMissingKeyIsAddedAfterTheSectionsLastEntry() throws {
        let text =
            "[provider corp]\r\nissuer = https://login.example\r\nclient_id = a\r\n\r\n[origin https://api.example]\r\nprovider = corp\r\n"
        let edited = try #require(
            ConfigEdit.setting(
                [("client_id", "b"), ("redirect_port", "4000")], inSection: "provider", argument: "corp", of: text))
        #expect(
            edited
                == "[provider corp]\r\nissuer = https://login.example\r\nclient_id = b\r\nredirect_port = 4000\r\n\r\n[origin https://api.example]\r\nprovider = corp\r\n"
        )
        let unterminated = try #require(
            ConfigEdit.setting(
                [("redirect_port", "4000")], inSection: "provider", argument: "corp",
                of: "[provider corp]\nclient_id = a"))
        #expect(unterminated == "[provider corp]\nclient_id = a\nredirect_port = 4000\n")
    }

    @Test func nothingIsEditedThatCannotBeEditedSafely() {
        #expect(ConfigEdit.setting([("client_id", "b")], inSection: "provider", argument: "none", of: Self.text) == nil)
        #expect(
            ConfigEdit.setting([("client_id", "b\nc")], inSection: "provider", argument: "corp", of: Self.text) == nil)
        #expect(
            ConfigEdit.setting([("client_id", "b")], inSection: "provider", argument: "corp", of: "[provider corp\nx")
                == nil)
        let twice = "[provider corp]\nclient_id = a\n[provider corp]\nclient_id = a\n"
        #expect(ConfigEdit.setting([("client_id", "b")], inSection: "provider", argument: "corp", of: twice) == nil)
    }
}
