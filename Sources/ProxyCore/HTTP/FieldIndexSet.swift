/// Indices of a head's field lines (those not to forward): a bit per index below 64, a sorted list above. Every
/// request and response has one; as a `Set<Int>` it cost an allocation and a hash per field.
public struct FieldIndexSet: Sendable, Equatable, Sequence, ExpressibleByArrayLiteral {
    private var low: UInt64 = 0
    /// Indices of 64 and above, ascending.
    private var high: [Int] = []

    public init() {}

    public init(arrayLiteral elements: Int...) {
        for element in elements { insert(element) }
    }

    public var isEmpty: Bool { low == 0 && high.isEmpty }

    public var count: Int { low.nonzeroBitCount + high.count }

    public func contains(_ index: Int) -> Bool {
        if index < 0 { return false }
        if index < 64 { return low & (1 << UInt64(index)) != 0 }
        return high.contains(index)
    }

    public mutating func insert(_ index: Int) {
        precondition(index >= 0, "a field index is never negative")
        if index < 64 {
            low |= 1 << UInt64(index)
        } else if !high.contains(index) {
            high.insert(index, at: high.firstIndex { $0 > index } ?? high.endIndex)
        }
    }

    public func union(_ other: some Sequence<Int>) -> FieldIndexSet {
        var result = self
        for index in other { result.insert(index) }
        return result
    }

    public func filter(_ isIncluded: (Int) throws -> Bool) rethrows -> FieldIndexSet {
        var result = FieldIndexSet()
        for index in self where try isIncluded(index) { result.insert(index) }
        return result
    }

    /// The indices in ascending order.
    public struct Iterator: IteratorProtocol {
        fileprivate var low: UInt64
        fileprivate var high: IndexingIterator<[Int]>

        public mutating func next() -> Int? {
            if low != 0 {
                let index = low.trailingZeroBitCount
                low &= low - 1
                return index
            }
            return high.next()
        }
    }

    public func makeIterator() -> Iterator {
        Iterator(low: low, high: high.makeIterator())
    }
}
