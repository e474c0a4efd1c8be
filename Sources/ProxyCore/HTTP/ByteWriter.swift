/// Writes a message head into an array made at its exact size: the size is summed first, then the bytes are
/// copied in place (or, `bytes(atMost:)`, a line into an array sized for its longest: an audit line). Appending piece by piece to a growing array cost 100-300 instructions per piece (capacity
/// and uniqueness checks, the generic copy of a `String.UTF8View`), a dozen pieces per head, and a reallocation
/// when the first guess at the size was short (callgrind, bench row 6).
struct ByteWriter {
    private let base: UnsafeMutablePointer<UInt8>
    private let capacity: Int
    /// Bytes written so far.
    private(set) var count = 0

    /// A head of exactly `count` bytes, written by `write`.
    static func bytes(count: Int, _ write: (inout ByteWriter) -> Void) -> [UInt8] {
        [UInt8](unsafeUninitializedCapacity: count) { buffer, initialized in
            guard let base = buffer.baseAddress else { return }
            var writer = ByteWriter(base: base, capacity: count)
            write(&writer)
            precondition(writer.count == count, "a head's size was summed wrong: \(writer.count) written of \(count)")
            initialized = writer.count
        }
    }

    /// Bytes `write` writes, at most `bound` of them (a line whose strings may need escaping: sized for the
    /// longest).
    static func bytes(atMost bound: Int, _ write: (inout ByteWriter) -> Void) -> [UInt8] {
        [UInt8](unsafeUninitializedCapacity: bound) { buffer, initialized in
            guard let base = buffer.baseAddress else { return }
            var writer = ByteWriter(base: base, capacity: bound)
            write(&writer)
            initialized = writer.count
        }
    }

    /// Writes at `base`, which has room for `capacity` bytes (the end of a buffer of lines: `AuditLines`), and
    /// returns how many `write` wrote.
    static func write(
        at base: UnsafeMutablePointer<UInt8>, capacity: Int, _ write: (inout ByteWriter) -> Void
    ) -> Int {
        var writer = ByteWriter(base: base, capacity: capacity)
        write(&writer)
        return writer.count
    }

    private init(base: UnsafeMutablePointer<UInt8>, capacity: Int) {
        self.base = base
        self.capacity = capacity
    }

    mutating func write(_ byte: UInt8) {
        precondition(count < capacity, "a head outgrew its size")
        base[count] = byte
        count += 1
    }

    mutating func write(_ bytes: UnsafeBufferPointer<UInt8>) {
        guard let source = bytes.baseAddress, !bytes.isEmpty else { return }
        precondition(count + bytes.count <= capacity, "a head outgrew its size")
        (base + count).initialize(from: source, count: bytes.count)
        count += bytes.count
    }

    mutating func write(_ bytes: [UInt8]) {
        bytes.withUnsafeBufferPointer { write($0) }
    }

    /// A string's UTF-8 bytes. Named apart from `write(_: StaticString)` so that a literal is never taken for a
    /// `String`, the overload Swift prefers: each literal then cost about 80 instructions where its bytes take 15
    /// (callgrind, an audit line's twenty names).
    mutating func write(string text: String) {
        var text = text
        text.withUTF8 { write($0) }
    }

    /// A literal's bytes.
    mutating func write(_ text: StaticString) {
        write(UnsafeBufferPointer(start: text.utf8Start, count: text.utf8CodeUnitCount))
    }

    /// The decimal digits of `value` (and a minus sign), at least `width` of them (zeros first). The digits are
    /// counted by comparison and written from the last, dividing by the constant 10 (a multiplication), not by a
    /// running power of ten (a hardware division per digit).
    mutating func write(decimal value: some BinaryInteger, width: Int = 1) {
        if value < 0 { write(UInt8(ascii: "-")) }
        var magnitude = UInt64(value.magnitude)
        var digits = 1
        var next: UInt64 = 10
        while digits < 20 && magnitude >= next {
            digits += 1
            if digits < 20 { next *= 10 }
        }
        for _ in digits..<max(width, digits) { write(UInt8(ascii: "0")) }
        precondition(count + digits <= capacity, "a head outgrew its size")
        var position = count + digits
        repeat {
            position -= 1
            base[position] = UInt8(ascii: "0") + UInt8(truncatingIfNeeded: magnitude % 10)
            magnitude /= 10
        } while magnitude > 0
        count += digits
    }

    /// `name: value` and CRLF.
    mutating func writeField(_ name: String, _ value: [UInt8]) {
        write(string: name)
        write(ASCII.colon)
        write(ASCII.space)
        write(value)
        write(ASCII.cr)
        write(ASCII.lf)
    }

    /// The size of a field line `writeField` writes.
    static func fieldSize(_ name: String, _ value: [UInt8]) -> Int { name.utf8.count + value.count + 4 }
}

extension Array {
    /// A scratch array kept in `store` between events, taken out for one event (emptied, its storage kept;
    /// `minimumCapacity` reserved the first time): an event handled inside that one finds `store` empty and
    /// makes its own, so nothing is shared. `returnScratch` puts it back.
    public static func takeScratch(from store: inout [Element], minimumCapacity: Int) -> [Element] {
        var scratch: [Element] = []
        swap(&scratch, &store)
        if scratch.capacity == 0 { scratch.reserveCapacity(minimumCapacity) }
        return scratch
    }

    /// Empties this scratch array (keeping its storage) and puts it back in `store` for the next event.
    public mutating func returnScratch(to store: inout [Element]) {
        emptyKeepingStorage()
        swap(&self, &store)
    }

    /// Empties the array and keeps its storage, element by element from the end: `removeAll(keepingCapacity:
    /// true)` goes through the generic `replaceSubrange`, about 500 instructions for an event's few actions
    /// (callgrind, bench row 6: four times per request for the connection's actions, more for the exchanges').
    @inlinable
    public mutating func emptyKeepingStorage() {
        while !isEmpty { removeLast() }
    }
}

extension Array where Element == UInt8 {
    /// `string`'s UTF-8 bytes, copied from its storage at once: `append(contentsOf: string.utf8)` goes through
    /// the generic sequence path, about 170 instructions for a short string (callgrind, bench row 6).
    @inlinable
    public mutating func append(utf8 string: String) {
        var string = string
        string.withUTF8 { append(contentsOf: $0) }
    }
}
