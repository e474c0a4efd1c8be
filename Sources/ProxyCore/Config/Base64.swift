/// Base64 (RFC 4648 §4) and base64url without padding (§5), without Foundation's Data round trips.
public enum Base64 {
    private static let standard = Array("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/".utf8)
    private static let url = Array("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_".utf8)
    private static let decodeTable: [UInt8] = {
        var table = [UInt8](repeating: 0xFF, count: 256)
        for (index, byte) in standard.enumerated() { table[Int(byte)] = UInt8(index) }
        table[Int(UInt8(ascii: "-"))] = 62
        table[Int(UInt8(ascii: "_"))] = 63
        return table
    }()

    public static func encode(_ bytes: some Collection<UInt8>) -> String {
        encode(bytes, alphabet: standard, pad: true)
    }

    public static func urlEncode(_ bytes: some Collection<UInt8>) -> String {
        encode(bytes, alphabet: url, pad: false)
    }

    private static func encode(_ bytes: some Collection<UInt8>, alphabet: [UInt8], pad: Bool) -> String {
        // Whole groups of three bytes through raw buffers: this encodes every DPoP proof.
        let input = Array(bytes)
        let full = input.count / 3
        let rest = input.count % 3
        let length = full * 4 + (rest == 0 ? 0 : (pad ? 4 : rest + 1))
        return String(unsafeUninitializedCapacity: length) { out in
            input.withUnsafeBufferPointer { source in
                alphabet.withUnsafeBufferPointer { table in
                    var o = 0
                    var i = 0
                    for _ in 0..<full {
                        let b0 = source[i]
                        let b1 = source[i + 1]
                        let b2 = source[i + 2]
                        out[o] = table[Int(b0 >> 2)]
                        out[o + 1] = table[Int((b0 & 0x03) << 4 | b1 >> 4)]
                        out[o + 2] = table[Int((b1 & 0x0F) << 2 | b2 >> 6)]
                        out[o + 3] = table[Int(b2 & 0x3F)]
                        i += 3
                        o += 4
                    }
                    if rest > 0 {
                        let b0 = source[i]
                        let b1: UInt8 = rest == 2 ? source[i + 1] : 0
                        out[o] = table[Int(b0 >> 2)]
                        out[o + 1] = table[Int((b0 & 0x03) << 4 | b1 >> 4)]
                        o += 2
                        if rest == 2 {
                            out[o] = table[Int((b1 & 0x0F) << 2)]
                            o += 1
                        } else if pad {
                            out[o] = UInt8(ascii: "=")
                            o += 1
                        }
                        if pad {
                            out[o] = UInt8(ascii: "=")
                            o += 1
                        }
                    }
                    return o
                }
            }
        }
    }

    /// Decodes standard or URL-safe Base64, padded or not. Returns nil on any invalid character or length.
    public static func decode(_ text: some StringProtocol) -> [UInt8]? {
        var input = Array(text.utf8)
        while input.last == UInt8(ascii: "=") { input.removeLast() }
        guard input.count % 4 != 1 else { return nil }
        var out: [UInt8] = []
        out.reserveCapacity(input.count * 3 / 4)
        var accumulator: UInt32 = 0
        var bits = 0
        for byte in input {
            let value = decodeTable[Int(byte)]
            guard value != 0xFF else { return nil }
            accumulator = accumulator << 6 | UInt32(value)
            bits += 6
            if bits >= 8 {
                bits -= 8
                out.append(UInt8(truncatingIfNeeded: accumulator >> UInt32(bits)))
            }
        }
        // Leftover bits must be zero (canonical encoding).
        guard accumulator & ((1 << UInt32(bits)) - 1) == 0 else { return nil }
        return out
    }
}
