import ProxyCore
import Testing

/// RFC 9110 §5.6.7's three forms of one instant, and what is not an HTTP-date.
@Suite struct HTTPDateTests {
    /// Sun, 06 Nov 1994 08:49:37 GMT (RFC 9110 §5.6.7's example).
    let example: Int64 = 784_111_777

    @Test func theThreeFormsOfTheRFCExample() {
        #expect(HTTPDate.parse("Sun, 06 Nov 1994 08:49:37 GMT", now: example) == example)
        #expect(HTTPDate.parse("Sunday, 06-Nov-94 08:49:37 GMT", now: example) == example)
        #expect(HTTPDate.parse("Sun Nov  6 08:49:37 1994", now: example) == example)
    }

    @Test func rfc850YearsMoreThanFiftyYearsAheadAreTheCenturyBefore() {
        let in2026: Int64 = 1_780_000_000  // 2026-05-28
        #expect(HTTPDate.parse("Saturday, 01-Jan-77 00:00:00 GMT", now: in2026) == 220_924_800)  // 1977
        #expect(HTTPDate.parse("Wednesday, 01-Jan-76 00:00:00 GMT", now: in2026) == 3_345_062_400)  // 2076
        #expect(HTTPDate.parse("Saturday, 01-Jan-50 00:00:00 GMT", now: in2026) == 2_524_608_000)
    }

    @Test func datesAroundLeapDaysAndTheEpoch() {
        #expect(HTTPDate.parse("Thu, 01 Jan 1970 00:00:00 GMT", now: 0) == 0)
        #expect(HTTPDate.parse("Tue, 29 Feb 2000 12:00:00 GMT", now: 0) == 951_825_600)
        #expect(HTTPDate.parse("Wed, 31 Dec 1969 23:59:59 GMT", now: 0) == -1)
        #expect(HTTPDate.parse("Thu, 29 Feb 2001 12:00:00 GMT", now: 0) == nil)
    }

    @Test(arguments: [
        "", "soon", "06 Nov 1994", "Sun, 06 Nov 1994 08:49:37 CET", "Sun, 6 Nov 1994 08:49:37 GMT",
        "Sun, 06 Foo 1994 08:49:37 GMT", "Sun, 06 Nov 1994 24:00:00 GMT", "Sun, 06 Nov 1994 08:49 GMT",
        "Sun, 06-Nov-94 08:49:37 GMT", "Sunday, 06 Nov 1994 08:49:37 GMT", "Sun Nov  6 08:49:37 94",
    ])
    func notAnHTTPDate(text: String) {
        #expect(HTTPDate.parse(text, now: example) == nil)
    }

    @Test func utcText() {
        #expect(HTTPDate.utcText(example) == "1994-11-06 08:49:37")
        #expect(HTTPDate.utcText(0) == "1970-01-01 00:00:00")
        #expect(HTTPDate.utcText(951_825_600) == "2000-02-29 12:00:00")
    }
}
