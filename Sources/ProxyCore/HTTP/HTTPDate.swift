/// HTTP-date (RFC 9110 §5.6.7) read without a date formatter: FoundationEssentials, what the release links, has
/// no `DateFormatter`, and three fixed layouts need none.
public enum HTTPDate {
    private static let months = ["jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"]
    private static let days = ["mon", "tue", "wed", "thu", "fri", "sat", "sun"]
    private static let longDays = ["monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"]

    /// Seconds since 1970 of an IMF-fixdate (`Sun, 06 Nov 1994 08:49:37 GMT`), or of the obsolete forms a
    /// recipient must accept too: RFC 850 (`Sunday, 06-Nov-94 08:49:37 GMT`) and asctime
    /// (`Sun Nov  6 08:49:37 1994`). nil for anything else (another zone than GMT included). `now` (seconds since
    /// 1970) places RFC 850's two-digit year: one more than 50 years ahead is the century before.
    public static func parse(_ text: String, now: Int64) -> Int64? {
        let words = text.split(separator: " ", omittingEmptySubsequences: true).map { $0.lowercased() }
        let year: Int
        let month: Int
        let day: Int
        let time: Substring
        switch words.count {
        case 6 where words[5] == "gmt" && words[0].hasSuffix(","):
            // IMF-fixdate: day-name "," SP day SP month SP year SP time SP "GMT"
            guard isDayName(words[0].dropLast(), long: false), words[1].count == 2, words[3].count == 4,
                let parsedDay = number(words[1]), let parsedMonth = monthNumber(words[2]),
                let parsedYear = number(words[3])
            else { return nil }
            (year, month, day, time) = (parsedYear, parsedMonth, parsedDay, Substring(words[4]))
        case 4 where words[3] == "gmt" && words[0].hasSuffix(","):
            // rfc850-date: day-name-l "," SP day "-" month "-" 2DIGIT SP time SP "GMT"
            let parts = words[1].split(separator: "-", omittingEmptySubsequences: false)
            guard isDayName(words[0].dropLast(), long: true), parts.count == 3, parts[0].count == 2,
                parts[2].count == 2, let parsedDay = number(parts[0]), let parsedMonth = monthNumber(parts[1]),
                let twoDigits = number(parts[2])
            else { return nil }
            let thisYear = civil(fromDays: Int(now.quotient(86400))).year
            var candidate = thisYear - thisYear % 100 + twoDigits
            if candidate > thisYear + 50 { candidate -= 100 }
            (year, month, day, time) = (candidate, parsedMonth, parsedDay, Substring(words[2]))
        case 5:
            // asctime-date: day-name SP month SP ( 2DIGIT / ( SP DIGIT )) SP time SP year
            guard isDayName(words[0], long: false), (1...2).contains(words[2].count), words[4].count == 4,
                let parsedMonth = monthNumber(words[1]), let parsedDay = number(words[2]),
                let parsedYear = number(words[4])
            else { return nil }
            (year, month, day, time) = (parsedYear, parsedMonth, parsedDay, Substring(words[3]))
        default:
            return nil
        }
        let clock = time.split(separator: ":", omittingEmptySubsequences: false)
        guard clock.count == 3, clock.allSatisfy({ $0.count == 2 }), let hour = number(clock[0]),
            let minute = number(clock[1]), let second = number(clock[2]), hour < 24, minute < 60, second < 61,
            (1...31).contains(day), day <= daysIn(month: month, year: year)
        else { return nil }
        return Int64(days(fromCivil: year, month, day)) * 86400 + Int64(hour * 3600 + minute * 60 + second)
    }

    /// `2026-11-30 10:00:00` in UTC, for seconds since 1970.
    public static func utcText(_ epoch: Int64) -> String {
        let days = epoch.quotient(86400)
        let date = civil(fromDays: Int(days))
        let time = Int(epoch - days * 86400)
        func two(_ value: Int) -> String { value < 10 ? "0\(value)" : "\(value)" }
        let clock = "\(two(time / 3600)):\(two(time / 60 % 60)):\(two(time % 60))"
        return "\(date.year)-\(two(date.month))-\(two(date.day)) \(clock)"
    }

    private static func isDayName(_ word: some StringProtocol, long: Bool) -> Bool {
        (long ? longDays : days).contains(String(word))
    }

    private static func monthNumber(_ word: some StringProtocol) -> Int? {
        months.firstIndex(of: String(word)).map { $0 + 1 }
    }

    private static func number(_ digits: some StringProtocol) -> Int? {
        guard !digits.isEmpty, digits.utf8.allSatisfy({ $0 >= 0x30 && $0 <= 0x39 }) else { return nil }
        return Int(digits)
    }

    private static func daysIn(month: Int, year: Int) -> Int {
        switch month {
        case 2: (year % 4 == 0 && year % 100 != 0) || year % 400 == 0 ? 29 : 28
        case 4, 6, 9, 11: 30
        default: 31
        }
    }

    /// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's `days_from_civil`).
    static func days(fromCivil year: Int, _ month: Int, _ day: Int) -> Int {
        let y = month <= 2 ? year - 1 : year
        let era = (y >= 0 ? y : y - 399) / 400
        let yearOfEra = y - era * 400
        let dayOfYear = (153 * (month > 2 ? month - 3 : month + 9) + 2) / 5 + day - 1
        let dayOfEra = yearOfEra * 365 + yearOfEra / 4 - yearOfEra / 100 + dayOfYear
        return era * 146097 + dayOfEra - 719468
    }

    /// The date of a day since 1970-01-01 (`civil_from_days`).
    static func civil(fromDays days: Int) -> (year: Int, month: Int, day: Int) {
        let z = days + 719468
        let era = (z >= 0 ? z : z - 146096) / 146097
        let dayOfEra = z - era * 146097
        let yearOfEra = (dayOfEra - dayOfEra / 1460 + dayOfEra / 36524 - dayOfEra / 146096) / 365
        let dayOfYear = dayOfEra - (365 * yearOfEra + yearOfEra / 4 - yearOfEra / 100)
        let shifted = (5 * dayOfYear + 2) / 153
        let day = dayOfYear - (153 * shifted + 2) / 5 + 1
        let month = shifted < 10 ? shifted + 3 : shifted - 9
        return (yearOfEra + era * 400 + (month <= 2 ? 1 : 0), month, day)
    }
}

extension Int64 {
    /// Division rounding toward minus infinity (days before 1970 included).
    fileprivate func quotient(_ divisor: Int64) -> Int64 {
        let q = self / divisor
        return (self % divisor != 0 && (self < 0) != (divisor < 0)) ? q - 1 : q
    }
}
