import CLibevent
import ProxyCore

/// Small helpers over libevent buffers, so the connection code reads as the protocol, not as C.
enum Buffers {
    /// Bytes waiting in `buffer`.
    @inline(__always)
    static func length(_ buffer: OpaquePointer?) -> Int {
        evbuffer_get_length(buffer)
    }

    /// Moves `count` bytes from `source` to `destination`: whole chains move without copying, only a
    /// partial last chain is copied.
    @inline(__always)
    static func move(_ count: Int, from source: OpaquePointer?, to destination: OpaquePointer?) {
        if count >= evbuffer_get_length(source) {
            evbuffer_add_buffer(destination, source)
        } else {
            evbuffer_remove_buffer(source, destination, count)
        }
    }

    @inline(__always)
    static func append(_ bytes: [UInt8], to buffer: OpaquePointer?) {
        bytes.withUnsafeBytes { raw in _ = evbuffer_add(buffer, raw.baseAddress, raw.count) }
    }

    /// Calls `body` with each contiguous segment of `buffer`, in order, until it returns false.
    static func forEachSegment(_ buffer: OpaquePointer?, _ body: (UnsafeRawBufferPointer) -> Bool) {
        withUnsafeTemporaryAllocation(of: iovec.self, capacity: 16) { vectors in
            var position = evbuffer_ptr()
            var first = true
            while true {
                let count =
                    first
                    ? evbuffer_peek(buffer, -1, nil, vectors.baseAddress, 16)
                    : evbuffer_peek(buffer, -1, &position, vectors.baseAddress, 16)
                if count <= 0 { return }
                let filled = min(Int(count), 16)
                var seen = 0
                for index in 0..<filled {
                    let vector = vectors[index]
                    seen += vector.iov_len
                    if !body(UnsafeRawBufferPointer(start: vector.iov_base, count: vector.iov_len)) { return }
                }
                if Int(count) <= 16 { return }
                // More segments than fit: continue after the ones seen.
                let offset = first ? seen : Int(position.pos) + seen
                first = false
                if evbuffer_ptr_set(buffer, &position, offset, EVBUFFER_PTR_SET) != 0 { return }
            }
        }
    }
}

/// The bytes of a libevent buffer as a `ByteView`: the machines read them in place.
struct EvbufferView: ByteView {
    let buffer: OpaquePointer?

    init(_ buffer: OpaquePointer?) { self.buffer = buffer }

    var count: Int { buffer.map { evbuffer_get_length($0) } ?? 0 }

    func forEachSegment(from offset: Int, _ body: (UnsafeRawBufferPointer) -> Bool) {
        guard let buffer, offset < evbuffer_get_length(buffer) else { return }
        withUnsafeTemporaryAllocation(of: iovec.self, capacity: 16) { vectors in
            var position = evbuffer_ptr()
            var start = offset
            while true {
                if evbuffer_ptr_set(buffer, &position, start, EVBUFFER_PTR_SET) != 0 { return }
                let count = evbuffer_peek(buffer, -1, &position, vectors.baseAddress, 16)
                if count <= 0 { return }
                let filled = min(Int(count), 16)
                for index in 0..<filled {
                    let vector = vectors[index]
                    if !body(UnsafeRawBufferPointer(start: vector.iov_base, count: vector.iov_len)) { return }
                    start += vector.iov_len
                }
                if Int(count) <= 16 { return }
            }
        }
    }
}
