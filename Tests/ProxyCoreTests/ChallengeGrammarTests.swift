import ProxyCore
import Testing

/// `ChallengeParser` against the grammar of RFC 9110 §11.6.1 and §5.6 (token68 or auth-params, BWS around
/// "=", quoted-pairs, list elements), against real `WWW-Authenticate` headers of major providers, and
/// against random input. The basics are in `ChallengeParserTests`.
@Suite struct ChallengeGrammarTests {
    // MARK: token68 or auth-params

    @Test func token68WithoutPadding() {
        #expect(ChallengeParser.parse("Negotiate abc") == [Challenge(scheme: "negotiate", token68: "abc")])
    }

    @Test func token68WithEveryAllowedCharacterAndPadding() {
        let parsed = ChallengeParser.parse("Custom AZaz09-._~+/==")
        #expect(parsed == [Challenge(scheme: "custom", token68: "AZaz09-._~+/==")])
    }

    @Test func token68EndingInEqualsBeforeAnotherChallenge() {
        // "abc=" could be a parameter with an empty value, but a parameter needs a value: it is token68.
        let parsed = ChallengeParser.parse("Negotiate abc=, Basic")
        #expect(parsed == [Challenge(scheme: "negotiate", token68: "abc="), Challenge(scheme: "basic")])
    }

    @Test func equalsFollowedByATokenIsAParameterNotToken68() {
        let parsed = ChallengeParser.parse("Bearer realm=api")
        #expect(parsed == [Challenge(scheme: "bearer", parameters: [("realm", "api")])])
        #expect(parsed.first?.token68 == nil)
    }

    @Test func equalsFollowedByAQuotedStringIsAParameter() {
        let parsed = ChallengeParser.parse(#"Bearer realm="api""#)
        #expect(parsed == [Challenge(scheme: "bearer", parameters: [("realm", "api")])])
    }

    @Test func token68FollowedByWhitespaceThenComma() {
        let parsed = ChallengeParser.parse("Negotiate YII=  ,\tBearer")
        #expect(parsed == [Challenge(scheme: "negotiate", token68: "YII="), Challenge(scheme: "bearer")])
    }

    @Test func secondEqualsAfterAValueEndsTheLine() {
        // "a=b=" is neither token68 nor a parameter list; what came before the garbage is kept.
        let parsed = ChallengeParser.parse("Bearer a=b=, Basic")
        #expect(parsed == [Challenge(scheme: "bearer", parameters: [("a", "b")])])
    }

    // MARK: BWS around "="

    @Test func spacesAroundEquals() {
        let parsed = ChallengeParser.parse(#"Bearer realm = "api" , error =invalid_token"#)
        #expect(parsed == [Challenge(scheme: "bearer", parameters: [("realm", "api"), ("error", "invalid_token")])])
    }

    @Test func tabsAroundEquals() {
        let parsed = ChallengeParser.parse("Bearer realm\t=\t\"api\",error\t= \"x\"")
        #expect(parsed == [Challenge(scheme: "bearer", parameters: [("realm", "api"), ("error", "x")])])
    }

    @Test func spaceBeforeEqualsOnTheFirstParameterIsNotToken68() {
        let parsed = ChallengeParser.parse("Bearer abc =def")
        #expect(parsed == [Challenge(scheme: "bearer", parameters: [("abc", "def")])])
    }

    // MARK: quoted-string and quoted-pair

    @Test func quotedPairsAreUnescaped() {
        let parsed = ChallengeParser.parse(#"Bearer error_description="a \"quoted\" word, a \\ backslash, an \x""#)
        #expect(parsed.first?["error_description"] == #"a "quoted" word, a \ backslash, an x"#)
    }

    @Test func commasAndEqualsInsideQuotesDoNotSplit() {
        let parsed = ChallengeParser.parse(#"Digest qop="auth, auth-int", realm="a=b, Basic c", Basic"#)
        #expect(
            parsed == [
                Challenge(scheme: "digest", parameters: [("qop", "auth, auth-int"), ("realm", "a=b, Basic c")]),
                Challenge(scheme: "basic"),
            ])
    }

    @Test func emptyQuotedStringAndEscapedTab() {
        let parsed = ChallengeParser.parse("Bearer realm=\"\", scope=\"a\\\tb\"")
        #expect(parsed == [Challenge(scheme: "bearer", parameters: [("realm", ""), ("scope", "a\tb")])])
    }

    @Test func obsTextInQuotedStringIsKept() {
        let parsed = ChallengeParser.parse("Bearer realm=\"caf\u{E9} \u{1F600}\"")
        #expect(parsed.first?["realm"] == "caf\u{E9} \u{1F600}")
    }

    @Test func controlCharacterInQuotedStringStopsTheLineKeepingEarlierParameters() {
        for bad in ["\u{7F}", "\u{1}", "\\\u{7F}", "\\\u{0}"] {
            let parsed = ChallengeParser.parse("Bearer a=\"ok\", b=\"x\(bad)y\", c=\"z\"")
            #expect(parsed == [Challenge(scheme: "bearer", parameters: [("a", "ok")])], "\(bad.debugDescription)")
        }
    }

    @Test func unterminatedQuotedString() {
        #expect(ChallengeParser.parse(#"Bearer realm="api"#) == [Challenge(scheme: "bearer")])
        #expect(ChallengeParser.parse(#"Bearer realm="api\"#) == [Challenge(scheme: "bearer")])
    }

    // MARK: list elements

    @Test func emptyListElementsAreIgnored() {
        let parsed = ChallengeParser.parse(#" , ,Bearer realm="x" , , error="y",, Basic ,, "#)
        #expect(
            parsed == [
                Challenge(scheme: "bearer", parameters: [("realm", "x"), ("error", "y")]), Challenge(scheme: "basic"),
            ])
    }

    @Test func onlySeparators() {
        for value in ["", " ", ",", " , ,\t,", "\t"] {
            #expect(ChallengeParser.parse(value).isEmpty, "\(value.debugDescription)")
        }
    }

    @Test func bareSchemesSeparatedByCommas() {
        let parsed = ChallengeParser.parse("Negotiate,NTLM , Basic")
        #expect(parsed.map(\.scheme) == ["negotiate", "ntlm", "basic"])
        #expect(parsed.allSatisfy { $0.token68 == nil && $0.parameters.isEmpty })
    }

    // MARK: case

    @Test func schemeAndParameterNamesAreCaseInsensitiveValuesAreNot() {
        let parsed = ChallengeParser.parse(#"BEARER Realm="Api", ERROR=Invalid_Token"#)
        #expect(parsed == [Challenge(scheme: "bearer", parameters: [("realm", "Api"), ("error", "Invalid_Token")])])
        #expect(parsed.first?["REALM"] == "Api")
        #expect(parsed.first?["Error"] == "Invalid_Token")
    }

    @Test func mixedCaseDPoP() {
        let parsed = ChallengeParser.parse(#"dPoP Error="use_dpop_nonce""#)
        #expect(parsed.first?.scheme == "dpop")
        #expect(parsed.first?["error"] == "use_dpop_nonce")
    }

    @Test func token68KeepsItsCase() {
        #expect(ChallengeParser.parse("NEGOTIATE AbC=").first?.token68 == "AbC=")
    }

    // MARK: several challenges, several lines

    @Test func rfc9110ExampleWithTwoChallengesOnOneLine() {
        let parsed = ChallengeParser.parse(
            #"Newauth realm="apps", type=1, title="Login to \"apps\"", Basic realm="simple""#)
        #expect(
            parsed == [
                Challenge(
                    scheme: "newauth", parameters: [("realm", "apps"), ("type", "1"), ("title", #"Login to "apps""#)]),
                Challenge(scheme: "basic", parameters: [("realm", "simple")]),
            ])
    }

    @Test func challengeAfterParametersStartsWithItsScheme() {
        let parsed = ChallengeParser.parse(#"Bearer realm="a", DPoP algs="ES256", Basic, Negotiate YII="#)
        #expect(
            parsed == [
                Challenge(scheme: "bearer", parameters: [("realm", "a")]),
                Challenge(scheme: "dpop", parameters: [("algs", "ES256")]),
                Challenge(scheme: "basic"),
                Challenge(scheme: "negotiate", token68: "YII="),
            ])
    }

    @Test func challengesAcrossLinesKeepTheirOrder() {
        let lines = [#"Basic realm="simple""#, #"Newauth realm="apps", type=1"#, "Negotiate", #"Bearer error="x""#]
        let expected = [
            Challenge(scheme: "basic", parameters: [("realm", "simple")]),
            Challenge(scheme: "newauth", parameters: [("realm", "apps"), ("type", "1")]),
            Challenge(scheme: "negotiate"),
            Challenge(scheme: "bearer", parameters: [("error", "x")]),
        ]
        #expect(ChallengeParser.parse(lines) == expected)
        // A recipient may combine field lines with ", " (RFC 9110 §5.3): the same challenges.
        #expect(ChallengeParser.parse(lines.joined(separator: ", ")) == expected)
    }

    @Test func garbageOnOneLineDoesNotAffectTheNext() {
        let parsed = ChallengeParser.parse([#"Bearer realm="x" junk"#, #"DPoP algs="ES256""#])
        #expect(
            parsed == [
                Challenge(scheme: "bearer", parameters: [("realm", "x")]),
                Challenge(scheme: "dpop", parameters: [("algs", "ES256")]),
            ])
    }

    // MARK: real-world headers

    struct RealWorld: Sendable, CustomTestStringConvertible {
        let name: String
        let lines: [String]
        let expected: [Challenge]
        var testDescription: String { name }
    }

    static let realWorld: [RealWorld] = [
        RealWorld(
            name: "Google APIs, expired token",
            lines: [#"Bearer realm="https://accounts.google.com/", error="invalid_token""#],
            expected: [
                Challenge(
                    scheme: "bearer",
                    parameters: [("realm", "https://accounts.google.com/"), ("error", "invalid_token")])
            ]),
        RealWorld(
            name: "Google Cloud Storage, insufficient scope",
            lines: [
                #"Bearer realm="https://accounts.google.com/", error="insufficient_scope", "#
                    + #"scope="https://www.googleapis.com/auth/cloud-platform""#
            ],
            expected: [
                Challenge(
                    scheme: "bearer",
                    parameters: [
                        ("realm", "https://accounts.google.com/"), ("error", "insufficient_scope"),
                        ("scope", "https://www.googleapis.com/auth/cloud-platform"),
                    ])
            ]),
        RealWorld(
            name: "Microsoft Graph (Entra ID), empty realm",
            lines: [
                #"Bearer realm="", authorization_uri="https://login.microsoftonline.com/common/oauth2/authorize", "#
                    + #"client_id="00000003-0000-0000-c000-000000000000""#
            ],
            expected: [
                Challenge(
                    scheme: "bearer",
                    parameters: [
                        ("realm", ""),
                        ("authorization_uri", "https://login.microsoftonline.com/common/oauth2/authorize"),
                        ("client_id", "00000003-0000-0000-c000-000000000000"),
                    ])
            ]),
        RealWorld(
            name: "Microsoft Entra ID continuous access evaluation claims challenge",
            lines: [
                #"Bearer realm="", authorization_uri="https://login.microsoftonline.com/common/oauth2/authorize", "#
                    + #"error="insufficient_claims", "#
                    + #"claims="eyJhY2Nlc3NfdG9rZW4iOnsibmJmIjp7ImVzc2VudGlhbCI6dHJ1ZX19fQ==""#
            ],
            expected: [
                Challenge(
                    scheme: "bearer",
                    parameters: [
                        ("realm", ""),
                        ("authorization_uri", "https://login.microsoftonline.com/common/oauth2/authorize"),
                        ("error", "insufficient_claims"),
                        ("claims", "eyJhY2Nlc3NfdG9rZW4iOnsibmJmIjp7ImVzc2VudGlhbCI6dHJ1ZX19fQ=="),
                    ])
            ]),
        RealWorld(
            name: "Azure Key Vault",
            lines: [
                #"Bearer authorization="https://login.microsoftonline.com/72f988bf-86f1-41af-91ab-2d7cd011db47", "#
                    + #"resource="https://vault.azure.net""#
            ],
            expected: [
                Challenge(
                    scheme: "bearer",
                    parameters: [
                        ("authorization", "https://login.microsoftonline.com/72f988bf-86f1-41af-91ab-2d7cd011db47"),
                        ("resource", "https://vault.azure.net"),
                    ])
            ]),
        RealWorld(
            name: "Okta userinfo",
            lines: [
                #"Bearer authorization_uri="https://dev-123456.okta.com/oauth2/v1/authorize", "#
                    + #"realm="https://dev-123456.okta.com", scope="openid", error="invalid_token", "#
                    + #"error_description="The access token is invalid.", resource="/oauth2/v1/userinfo""#
            ],
            expected: [
                Challenge(
                    scheme: "bearer",
                    parameters: [
                        ("authorization_uri", "https://dev-123456.okta.com/oauth2/v1/authorize"),
                        ("realm", "https://dev-123456.okta.com"), ("scope", "openid"), ("error", "invalid_token"),
                        ("error_description", "The access token is invalid."), ("resource", "/oauth2/v1/userinfo"),
                    ])
            ]),
        RealWorld(
            name: "Okta DPoP proof missing",
            lines: [
                #"DPoP algs="RS256 RS384 RS512 ES256 ES384 ES512", realm="https://dev-123456.okta.com", "#
                    + #"error="invalid_dpop_proof", error_description="'DPoP' proof JWT header is missing.""#
            ],
            expected: [
                Challenge(
                    scheme: "dpop",
                    parameters: [
                        ("algs", "RS256 RS384 RS512 ES256 ES384 ES512"), ("realm", "https://dev-123456.okta.com"),
                        ("error", "invalid_dpop_proof"), ("error_description", "'DPoP' proof JWT header is missing."),
                    ])
            ]),
        RealWorld(
            name: "Auth0 (express-oauth2-jwt-bearer), no token",
            lines: [#"Bearer realm="api""#],
            expected: [Challenge(scheme: "bearer", parameters: [("realm", "api")])]),
        RealWorld(
            name: "Auth0 (express-oauth2-jwt-bearer), expired token with escaped quotes",
            lines: [
                #"Bearer realm="api", error="invalid_token", error_description="\"exp\" claim timestamp check failed""#
            ],
            expected: [
                Challenge(
                    scheme: "bearer",
                    parameters: [
                        ("realm", "api"), ("error", "invalid_token"),
                        ("error_description", #""exp" claim timestamp check failed"#),
                    ])
            ]),
        RealWorld(
            name: "GitHub, git over HTTPS",
            lines: [#"Basic realm="GitHub""#],
            expected: [Challenge(scheme: "basic", parameters: [("realm", "GitHub")])]),
        RealWorld(
            name: "GitHub Container Registry, no spaces after commas",
            lines: [#"Bearer realm="https://ghcr.io/token",service="ghcr.io",scope="repository:octocat/hello:pull""#],
            expected: [
                Challenge(
                    scheme: "bearer",
                    parameters: [
                        ("realm", "https://ghcr.io/token"), ("service", "ghcr.io"),
                        ("scope", "repository:octocat/hello:pull"),
                    ])
            ]),
        RealWorld(
            name: "AWS Elastic Container Registry",
            lines: [
                #"Basic realm="https://123456789012.dkr.ecr.us-east-1.amazonaws.com/",service="ecr.amazonaws.com""#
            ],
            expected: [
                Challenge(
                    scheme: "basic",
                    parameters: [
                        ("realm", "https://123456789012.dkr.ecr.us-east-1.amazonaws.com/"),
                        ("service", "ecr.amazonaws.com"),
                    ])
            ]),
        RealWorld(
            name: "Windows integrated authentication on two lines",
            lines: ["Negotiate", "NTLM"],
            expected: [Challenge(scheme: "negotiate"), Challenge(scheme: "ntlm")]),
        RealWorld(
            name: "RFC 9470 step-up with acr_values",
            lines: [
                #"Bearer error="insufficient_user_authentication", "#
                    + #"error_description="A different authentication level is required", acr_values="myACR""#
            ],
            expected: [
                Challenge(
                    scheme: "bearer",
                    parameters: [
                        ("error", "insufficient_user_authentication"),
                        ("error_description", "A different authentication level is required"), ("acr_values", "myACR"),
                    ])
            ]),
        RealWorld(
            name: "RFC 9470 step-up with max_age",
            lines: [
                #"Bearer error="insufficient_user_authentication", "#
                    + #"error_description="More recent authentication is required", max_age="5""#
            ],
            expected: [
                Challenge(
                    scheme: "bearer",
                    parameters: [
                        ("error", "insufficient_user_authentication"),
                        ("error_description", "More recent authentication is required"), ("max_age", "5"),
                    ])
            ]),
        RealWorld(
            name: "RFC 9449 §7.1 algs",
            lines: [#"DPoP algs="ES256 PS256""#],
            expected: [Challenge(scheme: "dpop", parameters: [("algs", "ES256 PS256")])]),
        RealWorld(
            name: "RFC 9449 §7.1 invalid key binding",
            lines: [#"DPoP error="invalid_token", error_description="Invalid DPoP key binding", algs="ES256""#],
            expected: [
                Challenge(
                    scheme: "dpop",
                    parameters: [
                        ("error", "invalid_token"), ("error_description", "Invalid DPoP key binding"),
                        ("algs", "ES256"),
                    ])
            ]),
        RealWorld(
            name: "RFC 9449 §9 resource server nonce",
            lines: [#"DPoP error="use_dpop_nonce", error_description="Resource server requires nonce in DPoP proof""#],
            expected: [
                Challenge(
                    scheme: "dpop",
                    parameters: [
                        ("error", "use_dpop_nonce"),
                        ("error_description", "Resource server requires nonce in DPoP proof"),
                    ])
            ]),
        RealWorld(
            name: "Bearer and DPoP offered together",
            lines: [#"Bearer, DPoP algs="ES256 PS256""#],
            expected: [Challenge(scheme: "bearer"), Challenge(scheme: "dpop", parameters: [("algs", "ES256 PS256")])]),
        RealWorld(
            name: "RFC 7616 Digest with a quoted comma list and a token value",
            lines: [
                #"Digest realm="http-auth@example.org", qop="auth, auth-int", algorithm=SHA-256, "#
                    + #"nonce="7ypf/xlj9XXwfDPEoM4URrv/xwf94BcCAzFZH4GiTo0v", opaque="FQhe/qaU925kfnzjCev0ciny7QMkPqMAFRtzCUYo5tdS""#
            ],
            expected: [
                Challenge(
                    scheme: "digest",
                    parameters: [
                        ("realm", "http-auth@example.org"), ("qop", "auth, auth-int"), ("algorithm", "SHA-256"),
                        ("nonce", "7ypf/xlj9XXwfDPEoM4URrv/xwf94BcCAzFZH4GiTo0v"),
                        ("opaque", "FQhe/qaU925kfnzjCev0ciny7QMkPqMAFRtzCUYo5tdS"),
                    ])
            ]),
    ]

    @Test(arguments: realWorld) func realWorldHeader(_ header: RealWorld) {
        #expect(ChallengeParser.parse(header.lines) == header.expected)
        // The same header as one combined line means the same.
        #expect(ChallengeParser.parse(header.lines.joined(separator: ", ")) == header.expected)
    }

    // MARK: random input

    /// SplitMix64, seeded, so that a failure replays.
    struct Random {
        var state: UInt64
        mutating func next() -> UInt64 {
            state &+= 0x9e37_79b9_7f4a_7c15
            var z = state
            z = (z ^ (z >> 30)) &* 0xbf58_476d_1ce4_e5b9
            z = (z ^ (z >> 27)) &* 0x94d0_49bb_1331_11eb
            return z ^ (z >> 31)
        }
        mutating func below(_ bound: Int) -> Int { Int(next() % UInt64(bound)) }
        mutating func pick<T>(_ items: [T]) -> T { items[below(items.count)] }
    }

    static func isToken(_ text: String) -> Bool {
        !text.isEmpty
            && text.utf8.allSatisfy { byte in
                (byte >= 0x30 && byte <= 0x39) || (byte >= 0x61 && byte <= 0x7A) || (byte >= 0x41 && byte <= 0x5A)
                    || "!#$%&'*+-.^_`|~".utf8.contains(byte)
            }
    }

    /// Structure that holds for any input: lower-case token schemes and names, no control characters in values.
    static func checkStructure(_ challenges: [Challenge], input: String) {
        for challenge in challenges {
            #expect(
                isToken(challenge.scheme) && challenge.scheme == challenge.scheme.lowercased(),
                "\(input.debugDescription)")
            if challenge.token68 != nil { #expect(challenge.parameters.isEmpty) }
            for (name, value) in challenge.parameters {
                #expect(isToken(name) && name == name.lowercased(), "\(input.debugDescription)")
                #expect(value.utf8.allSatisfy { $0 == 0x09 || ($0 >= 0x20 && $0 != 0x7F) }, "\(input.debugDescription)")
            }
        }
    }

    @Test func randomBytesDoNotCrash() {
        var random = Random(state: 0x5eed_0001)
        for _ in 0..<20_000 {
            let bytes = (0..<random.below(64)).map { _ in UInt8(truncatingIfNeeded: random.next()) }
            let input = String(decoding: bytes, as: UTF8.self)
            Self.checkStructure(ChallengeParser.parse(input), input: input)
        }
    }

    @Test func randomGrammarFragmentsDoNotCrash() {
        let fragments = [
            "Bearer", "DPoP", "Basic", "Negotiate", " ", "  ", "\t", ",", ", ", "=", " = ", "\"", "\\", "\\\"", "realm",
            "error", "=\"x\"", "abc", "YII=", "==", "\u{7F}", "\u{0}", "\r", "\n", "é", "\u{212A}", "\u{301}", "/", "~",
        ]
        var random = Random(state: 0x5eed_0002)
        for _ in 0..<20_000 {
            let input = (0..<random.below(16)).map { _ in random.pick(fragments) }.joined()
            Self.checkStructure(ChallengeParser.parse(input), input: input)
            Self.checkStructure(ChallengeParser.parse(input.split(separator: "\n").map(String.init)), input: input)
        }
    }

    /// Random well-formed challenges, written with random case, whitespace, empty list elements, quoting and
    /// line breaks, parse back to themselves.
    @Test func randomWellFormedChallengesRoundTrip() {
        let schemes = ["bearer", "dpop", "basic", "negotiate", "x-custom!", "newauth"]
        let names = ["realm", "error", "error_description", "scope", "algs", "max_age", "a", "x.y"]
        let values = ["", "api", "invalid_token", "a b", "a, b", #"say "hi""#, #"back\slash"#, "tab\there", "é", "1"]
        let tokens68 = ["abc", "YII=", "a-b.c_d~e+f/g==", "Zz9"]
        var random = Random(state: 0x5eed_0003)
        for _ in 0..<5_000 {
            var challenges: [Challenge] = []
            for _ in 0..<(1 + random.below(4)) {
                switch random.below(3) {
                case 0: challenges.append(Challenge(scheme: random.pick(schemes)))
                case 1: challenges.append(Challenge(scheme: random.pick(schemes), token68: random.pick(tokens68)))
                default:
                    let parameters = (0..<(1 + random.below(3))).map { _ in (random.pick(names), random.pick(values)) }
                    challenges.append(Challenge(scheme: random.pick(schemes), parameters: parameters))
                }
            }
            let lines = Self.write(challenges, &random)
            #expect(ChallengeParser.parse(lines) == challenges, "\(lines)")
        }
    }

    static func write(_ challenges: [Challenge], _ random: inout Random) -> [String] {
        func ows() -> String { random.pick(["", "", " ", "  ", "\t"]) }
        func mixedCase(_ text: String) -> String {
            String(
                decoding: text.utf8.map { $0 >= 0x61 && $0 <= 0x7A && random.below(2) == 0 ? $0 - 0x20 : $0 },
                as: UTF8.self)
        }
        func separator() -> String { ows() + "," + (random.below(4) == 0 ? ows() + "," : "") + ows() }
        var lines: [String] = []
        var line = ""
        for (index, challenge) in challenges.enumerated() {
            if index > 0 {
                if random.below(3) == 0 {
                    lines.append(line)
                    line = random.below(4) == 0 ? separator() : ""
                } else {
                    line += separator()
                }
            }
            line += mixedCase(challenge.scheme)
            if let token68 = challenge.token68 {
                line += " " + token68
            } else if !challenge.parameters.isEmpty {
                line += random.pick([" ", "  "])
                line += challenge.parameters.map { name, value in
                    let isToken = Self.isToken(value)
                    let written =
                        isToken && random.below(2) == 0
                        ? value
                        : "\"" + value.map { $0 == "\\" || $0 == "\"" ? "\\\($0)" : "\($0)" }.joined() + "\""
                    return mixedCase(name) + ows() + "=" + ows() + written
                }.joined(separator: separator())
            }
        }
        lines.append(line)
        return lines
    }
}
