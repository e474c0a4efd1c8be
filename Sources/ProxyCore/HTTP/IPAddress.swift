/// IP address text parsing without the C library, for the pure layer (authority checks, CIDR lists).
public enum IPAddress: Sendable, Hashable {
    case v4(UInt32)
    case v6(UInt64, UInt64)

    /// Parses dotted-quad IPv4 or IPv6 text (no brackets, no zone).
    public static func parse(_ text: some StringProtocol) -> IPAddress? {
        let bytes = Array(text.utf8)
        if let v4 = parseIPv4(bytes[...]) { return .v4(v4) }
        if let v6 = parseIPv6(bytes[...]) { return .v6(v6.0, v6.1) }
        return nil
    }

    /// Four decimal octets, no leading zeros beyond a single "0" (leading zeros mean octal to some parsers).
    static func parseIPv4(_ bytes: ArraySlice<UInt8>) -> UInt32? {
        var value: UInt32 = 0
        var octets = 0
        var current: UInt32 = 0
        var digits = 0
        var leadingZero = false
        for byte in bytes {
            if byte == UInt8(ascii: ".") {
                guard digits > 0, octets < 3 else { return nil }
                value = value << 8 | current
                octets += 1
                current = 0
                digits = 0
                leadingZero = false
            } else if ASCII.isDigit(byte) {
                if digits > 0 && leadingZero { return nil }
                if digits == 0 && byte == UInt8(ascii: "0") { leadingZero = true }
                current = current * 10 + UInt32(byte - 0x30)
                digits += 1
                guard digits <= 3, current <= 255 else { return nil }
            } else {
                return nil
            }
        }
        guard octets == 3, digits > 0 else { return nil }
        return value << 8 | current
    }

    /// RFC 4291 §2.2 text forms, including "::" compression and a trailing dotted IPv4.
    static func parseIPv6(_ bytes: ArraySlice<UInt8>) -> (UInt64, UInt64)? {
        guard bytes.count >= 2, bytes.count <= 45 else { return nil }
        var groups: [UInt16] = []
        var compressAt: Int? = nil
        var index = bytes.startIndex
        if bytes.starts(with: "::".utf8) {
            compressAt = 0
            index += 2
            if index == bytes.endIndex { return (0, 0) }
        }
        while index < bytes.endIndex {
            // A trailing IPv4 part takes two groups. It is the last part, so it has no colon after it; a group
            // before it ("::ffff:1.2.3.4") is read as hex first.
            let rest = bytes[index...]
            if rest.contains(UInt8(ascii: ".")) && !rest.contains(ASCII.colon) {
                guard let v4 = parseIPv4(rest) else { return nil }
                groups.append(UInt16(v4 >> 16))
                groups.append(UInt16(v4 & 0xFFFF))
                index = bytes.endIndex
                break
            }
            var value: UInt16 = 0
            var digits = 0
            while index < bytes.endIndex, let hex = ASCII.hexValue(bytes[index]) {
                value = value << 4 | UInt16(hex)
                digits += 1
                index += 1
                if digits > 4 { return nil }
            }
            guard digits > 0 else { return nil }
            groups.append(value)
            if index == bytes.endIndex { break }
            guard bytes[index] == ASCII.colon else { return nil }
            index += 1
            if index < bytes.endIndex && bytes[index] == ASCII.colon {
                guard compressAt == nil else { return nil }
                compressAt = groups.count
                index += 1
                if index == bytes.endIndex { break }
            } else if index == bytes.endIndex {
                return nil
            }
        }
        if let compressAt {
            guard groups.count < 8 else { return nil }
            groups.insert(contentsOf: [UInt16](repeating: 0, count: 8 - groups.count), at: compressAt)
        }
        guard groups.count == 8 else { return nil }
        var high: UInt64 = 0
        var low: UInt64 = 0
        for group in groups[0..<4] { high = high << 16 | UInt64(group) }
        for group in groups[4..<8] { low = low << 16 | UInt64(group) }
        return (high, low)
    }

    /// An IPv4-mapped IPv6 address (`::ffff:127.0.0.1`) as the IPv4 address it is; others unchanged.
    public var unmapped: IPAddress {
        if case .v6(0, let low) = self, low >> 32 == 0xFFFF { return .v4(UInt32(low & 0xFFFF_FFFF)) }
        return self
    }

    /// Whether this is a loopback address (127.0.0.0/8, ::1, or IPv4-mapped loopback).
    public var isLoopback: Bool {
        switch self {
        case .v4(let value): value >> 24 == 127
        case .v6(let high, let low):
            (high == 0 && low == 1) || (high == 0 && low >> 32 == 0xFFFF && (low >> 24) & 0xFF == 127)
        }
    }
}

/// An address range such as `10.0.0.0/8` or `fd00::/8`.
public struct CIDR: Sendable, Hashable {
    public let address: IPAddress
    public let prefix: Int

    public static func parse(_ text: some StringProtocol) -> CIDR? {
        let parts = text.split(separator: "/", maxSplits: 1, omittingEmptySubsequences: false)
        guard let address = IPAddress.parse(parts[0]) else { return nil }
        let maxPrefix: Int
        switch address {
        case .v4: maxPrefix = 32
        case .v6: maxPrefix = 128
        }
        var prefix = maxPrefix
        if parts.count == 2 {
            guard let parsed = ConfigValue.digits(parts[1]), (0...maxPrefix).contains(parsed) else { return nil }
            prefix = parsed
        }
        return CIDR(address: address, prefix: prefix)
    }

    public func contains(_ other: IPAddress) -> Bool {
        switch (address, other) {
        case (.v4(let net), .v4(let ip)):
            if prefix == 0 { return true }
            let mask = UInt32.max << (32 - UInt32(prefix))
            return net & mask == ip & mask
        case (.v6(let netHigh, let netLow), .v6(let high, let low)):
            if prefix <= 64 {
                let mask: UInt64 = prefix == 0 ? 0 : UInt64.max << (64 - UInt64(prefix))
                return netHigh & mask == high & mask
            }
            let mask: UInt64 = UInt64.max << (128 - UInt64(prefix))
            return netHigh == high && netLow & mask == low & mask
        default:
            return false
        }
    }
}
