/// The message for a key a section does not have: the key meant when one is close enough to be a typo
/// (`clientid`, `client-id`, `cilent_id` for `client_id`), else the list of the section's keys.
public enum KeySuggestion {
    /// The known key `key` is most likely a typo of, or nil: a key equal once case, `_` and `-` are ignored,
    /// else the one nearest by edit distance (insertions, deletions, substitutions and swaps of two
    /// neighbours), when it is at most 2 and less than half the key's length, and no other key is as near.
    public static func closest(to key: String, among keys: [String]) -> String? {
        func folded(_ text: String) -> [UInt8] {
            Array(text.lowercased().utf8.filter { $0 != UInt8(ascii: "_") && $0 != UInt8(ascii: "-") })
        }
        let typed = folded(key)
        if let same = keys.first(where: { folded($0) == typed }) { return same }
        let lowered = Array(key.lowercased().utf8)
        var best: (key: String, distance: Int)? = nil
        var tie = false
        for candidate in keys {
            let distance = editDistance(lowered, Array(candidate.utf8))
            if let current = best, distance >= current.distance {
                if distance == current.distance { tie = true }
                continue
            }
            best = (candidate, distance)
            tie = false
        }
        guard let best, !tie, best.distance <= 2, best.distance * 2 < lowered.count else { return nil }
        return best.key
    }

    /// "unknown key; did you mean client_id?", or every key when none is near.
    public static func message(for key: String, among keys: [String]) -> String {
        if let near = closest(to: key, among: keys) { return "unknown key; did you mean \(near)?" }
        return "unknown key; expected one of \(keys.joined(separator: ", "))"
    }

    /// The optimal string alignment distance: Levenshtein's, with a swap of two neighbouring bytes as one edit.
    static func editDistance(_ a: [UInt8], _ b: [UInt8]) -> Int {
        if a.isEmpty { return b.count }
        if b.isEmpty { return a.count }
        var before = [Int](repeating: 0, count: b.count + 1)
        var previous = Array(0...b.count)
        var current = [Int](repeating: 0, count: b.count + 1)
        for i in 1...a.count {
            current[0] = i
            for j in 1...b.count {
                let cost = a[i - 1] == b[j - 1] ? 0 : 1
                var value = min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + cost)
                if i > 1, j > 1, a[i - 1] == b[j - 2], a[i - 2] == b[j - 1] {
                    value = min(value, before[j - 2] + 1)
                }
                current[j] = value
            }
            (before, previous, current) = (previous, current, before)
        }
        return previous[b.count]
    }
}
