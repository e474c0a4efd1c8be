import ProxyCore

/// Reports a violated invariant: libFuzzer records the input as a crash.
@inline(never)
func invariant(
    _ condition: @autoclosure () -> Bool, _ message: @autoclosure () -> String,
    file: StaticString = #fileID, line: UInt = #line
) {
    if !condition() { fatalError("invariant violated: \(message())", file: file, line: line) }
}

/// Pseudo-random numbers seeded from the input itself, so that a reproducer replays exactly the same way.
struct InputRandom {
    private var state: UInt64

    init(_ bytes: [UInt8], salt: UInt64 = 0) {
        var hash: UInt64 = 0xcbf2_9ce4_8422_2325 ^ salt  // FNV-1a
        for byte in bytes { hash = (hash ^ UInt64(byte)) &* 0x0000_0100_0000_01b3 }
        state = hash
    }

    /// SplitMix64.
    mutating func next() -> UInt64 {
        state &+= 0x9e37_79b9_7f4a_7c15
        var z = state
        z = (z ^ (z >> 30)) &* 0xbf58_476d_1ce4_e5b9
        z = (z ^ (z >> 27)) &* 0x94d0_49bb_1331_11eb
        return z ^ (z >> 31)
    }

    /// A number in `range`.
    mutating func next(in range: ClosedRange<Int>) -> Int {
        range.lowerBound + Int(next() % UInt64(range.count))
    }

    mutating func nextBool() -> Bool { next() & 1 == 1 }
}

/// How to cut an input into the pieces a socket might deliver.
enum Split {
    /// Everything at once.
    case whole
    /// Mostly short pieces, sometimes long ones; sizes derived from the input.
    case mixed(salt: UInt64)
    /// One to three bytes at a time; sizes derived from the input.
    case tiny(salt: UInt64)

    func pieces(of bytes: [UInt8]) -> [Range<Int>] {
        var random: InputRandom
        var sizes: (inout InputRandom) -> Int
        switch self {
        case .whole:
            return bytes.isEmpty ? [] : [0..<bytes.count]
        case .mixed(let salt):
            random = InputRandom(bytes, salt: salt)
            sizes = { random in
                switch random.next(in: 0...9) {
                case 0...4: random.next(in: 1...4)
                case 5...7: random.next(in: 5...32)
                default: random.next(in: 33...512)
                }
            }
        case .tiny(let salt):
            random = InputRandom(bytes, salt: salt)
            sizes = { random in random.next(in: 1...3) }
        }
        var ranges: [Range<Int>] = []
        var start = 0
        while start < bytes.count {
            let end = min(bytes.count, start + sizes(&random))
            ranges.append(start..<end)
            start = end
        }
        return ranges
    }
}

extension Array where Element == UInt8 {
    /// Calls `body` with the bytes of `range` as a raw buffer, the way a socket read hands them over.
    func withRawBytes<R>(_ range: Range<Int>, _ body: (UnsafeRawBufferPointer) -> R) -> R {
        withUnsafeBytes { all in body(UnsafeRawBufferPointer(rebasing: all[range])) }
    }

    func starts(at offset: Int, with other: some Collection<UInt8>) -> Bool {
        offset + other.count <= count && self[offset..<offset + other.count].elementsEqual(other)
    }
}

/// The input as text, the way a configuration file or a header value would be decoded.
func text(_ bytes: [UInt8]) -> String { String(decoding: bytes, as: UTF8.self) }

/// ASCII lower case of raw bytes, for comparing with what the parsers decided.
func asciiLowercased(_ bytes: some Sequence<UInt8>) -> [UInt8] {
    bytes.map { $0 >= 0x41 && $0 <= 0x5A ? $0 | 0x20 : $0 }
}

/// Limits for re-parsing heads that the proxy itself built: those may legitimately be a little larger than
/// what it accepted.
let generousLimits = HTTPHeadLimits(maxStartLine: 1 << 20, maxHeadBytes: 1 << 24, maxFields: 1 << 20)
