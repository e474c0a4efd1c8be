import Foundation

#if canImport(Glibc)
    import Glibc
#elseif canImport(Darwin)
    import Darwin
#endif

/// A private directory (0700) under the system's temporary directory, made for one test and removed with
/// everything in it when released: a suite that holds one in a stored property (Swift Testing makes an instance
/// per test) leaves nothing behind in /tmp.
public final class TemporaryDirectory: Sendable {
    public struct Failed: Error, CustomStringConvertible {
        public let description: String
    }

    public let path: String

    public init() throws {
        var template = Array("\(NSTemporaryDirectory())/proxyctl-tests.XXXXXX".utf8CString)
        let created = template.withUnsafeMutableBufferPointer { mkdtemp($0.baseAddress!) }
        guard created != nil else {
            throw Failed(description: "mkdtemp in \(NSTemporaryDirectory()): \(String(cString: strerror(errno)))")
        }
        path = String(decoding: template.prefix { $0 != 0 }.map { UInt8(bitPattern: $0) }, as: UTF8.self)
    }

    deinit {
        try? FileManager.default.removeItem(atPath: path)
    }
}
