import CLibevent
import Dispatch
import ProxyCore

#if canImport(FoundationEssentials)
    import FoundationEssentials
#else
    import Foundation
#endif

/// A socket address (IPv4 or IPv6) as the kernel wants it.
public struct SocketAddress: Sendable, CustomStringConvertible {
    var storage = sockaddr_storage()
    var length: socklen_t = 0

    init(storage: sockaddr_storage, length: socklen_t) {
        self.storage = storage
        self.length = length
    }

    /// From an address the system gave (accept, getaddrinfo).
    init(_ pointer: UnsafePointer<sockaddr>, length: socklen_t) {
        withUnsafeMutableBytes(of: &storage) { target in
            target.copyMemory(from: UnsafeRawBufferPointer(start: pointer, count: Int(length)))
        }
        self.length = length
    }

    /// From an IP literal and a port; nil when `host` is not a literal.
    public init?(ip host: String, port: Int) {
        var v4 = sockaddr_in()
        if inet_pton(AF_INET, host, &v4.sin_addr) == 1 {
            v4.sin_family = sa_family_t(AF_INET)
            v4.sin_port = in_port_t(UInt16(port).bigEndian)
            withUnsafeMutableBytes(of: &storage) { target in
                withUnsafeBytes(of: v4) { target.copyMemory(from: $0) }
            }
            length = socklen_t(MemoryLayout<sockaddr_in>.size)
            return
        }
        var v6 = sockaddr_in6()
        if inet_pton(AF_INET6, host, &v6.sin6_addr) == 1 {
            v6.sin6_family = sa_family_t(AF_INET6)
            v6.sin6_port = in_port_t(UInt16(port).bigEndian)
            withUnsafeMutableBytes(of: &storage) { target in
                withUnsafeBytes(of: v6) { target.copyMemory(from: $0) }
            }
            length = socklen_t(MemoryLayout<sockaddr_in6>.size)
            return
        }
        return nil
    }

    public var family: Int32 { Int32(storage.ss_family) }

    public var port: Int {
        withUnsafeBytes(of: storage) { raw in
            if family == AF_INET6 {
                return Int(UInt16(bigEndian: raw.load(as: sockaddr_in6.self).sin6_port))
            }
            return Int(UInt16(bigEndian: raw.load(as: sockaddr_in.self).sin_port))
        }
    }

    /// The IP address as text, without the port.
    public var ipString: String {
        var buffer = [CChar](repeating: 0, count: Int(INET6_ADDRSTRLEN))
        withUnsafeBytes(of: storage) { raw in
            if family == AF_INET6 {
                var address = raw.load(as: sockaddr_in6.self).sin6_addr
                inet_ntop(AF_INET6, &address, &buffer, socklen_t(buffer.count))
            } else {
                var address = raw.load(as: sockaddr_in.self).sin_addr
                inet_ntop(AF_INET, &address, &buffer, socklen_t(buffer.count))
            }
        }
        return String(decoding: buffer.prefix { $0 != 0 }.map { UInt8(bitPattern: $0) }, as: UTF8.self)
    }

    /// `1.2.3.4:80` or `[::1]:80`.
    public var description: String {
        family == AF_INET6 ? "[\(ipString)]:\(port)" : "\(ipString):\(port)"
    }

    public func withSockaddrPublic<T>(_ body: (UnsafePointer<sockaddr>, socklen_t) -> T) -> T {
        withSockaddr(body)
    }

    func withSockaddr<T>(_ body: (UnsafePointer<sockaddr>, socklen_t) -> T) -> T {
        withUnsafeBytes(of: storage) { raw in
            body(raw.baseAddress!.assumingMemoryBound(to: sockaddr.self), length)
        }
    }
}

/// Why a name did not resolve.
public enum ResolveError: Error, Sendable, Equatable {
    /// The name does not exist (NXDOMAIN) or has no addresses.
    case notFound
    /// The resolver failed for now (no server answered).
    case temporary(String)
}

/// Name resolution off the loop thread.
///
/// `getaddrinfo` on a worker thread honours `/etc/hosts`, `nsswitch.conf` and the system's resolver exactly as
/// every other program on the machine does, which an in-loop DNS client would not. IP literals skip the
/// thread entirely. The answer comes back on the loop through `EventLoop.post`.
public final class Resolver: Sendable {
    private let queue = DispatchQueue(label: "proxyctl.resolver", attributes: .concurrent)
    /// Names answered without DNS (`resolve` in proxy.conf).
    private let overrides: [String: String]

    public init(overrides: [String: String] = [:]) {
        self.overrides = overrides
    }

    /// Resolves `host` for TCP to `port`. `completion` runs on `loop`.
    public func resolve(
        _ host: HostPort, loop: EventLoop,
        completion: @escaping @Sendable (Result<[SocketAddress], ResolveError>) -> Void
    ) {
        if host.kind == .name, let fixed = overrides[host.host], let address = SocketAddress(ip: fixed, port: host.port)
        {
            completion(.success([address]))
            return
        }
        if host.kind != .name, let address = SocketAddress(ip: host.host, port: host.port) {
            completion(.success([address]))
            return
        }
        let name = host.host
        let port = host.port
        queue.async {
            let result = Self.lookup(name, port: port)
            loop.post { completion(result) }
        }
    }

    static func lookup(_ name: String, port: Int) -> Result<[SocketAddress], ResolveError> {
        var hints = addrinfo()
        hints.ai_socktype = Platform.streamSocketType
        hints.ai_protocol = Int32(IPPROTO_TCP)
        hints.ai_flags = AI_ADDRCONFIG
        var list: UnsafeMutablePointer<addrinfo>? = nil
        let status = getaddrinfo(name, String(port), &hints, &list)
        defer { if let list { freeaddrinfo(list) } }
        switch status {
        case 0:
            break
        case EAI_NONAME, proxyctl_eai_nodata(), EAI_FAIL:
            return .failure(.notFound)
        default:
            return .failure(.temporary(String(cString: gai_strerror(status))))
        }
        var addresses: [SocketAddress] = []
        var cursor = list
        while let entry = cursor {
            if let address = entry.pointee.ai_addr,
                entry.pointee.ai_family == AF_INET || entry.pointee.ai_family == AF_INET6
            {
                addresses.append(SocketAddress(address, length: entry.pointee.ai_addrlen))
            }
            cursor = entry.pointee.ai_next
        }
        return addresses.isEmpty ? .failure(.notFound) : .success(addresses)
    }
}
