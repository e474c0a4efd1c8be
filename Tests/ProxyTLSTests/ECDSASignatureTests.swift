import ProxyCore
import Testing

@testable import ProxyTLS

@Suite struct ECDSASignatureTests {
    @Test func rawAndDERRoundTrip() throws {
        // r with a leading zero byte and s with its top bit set: both DER edge cases (a dropped zero byte
        // and a padding zero byte).
        let r = [UInt8](repeating: 0, count: 1) + [UInt8](repeating: 0x11, count: 31)
        let s = [UInt8](repeating: 0x80, count: 32)
        let raw = r + s
        let der = try #require(ECDSASignature.rawToDER(raw, coordinateSize: 32))
        #expect(der[0] == 0x30)
        let back = try #require(ECDSASignature.derToRaw(der, coordinateSize: 32))
        #expect(back == raw)
    }

    @Test func rejectsWrongLengthsAndGarbage() {
        #expect(ECDSASignature.rawToDER([UInt8](repeating: 1, count: 63), coordinateSize: 32) == nil)
        #expect(ECDSASignature.derToRaw([0x30, 0x02, 0x01], coordinateSize: 32) == nil)
    }
}
