/// A value kept behind one pointer, with value semantics (copy on write, as `Array` does).
///
/// The data of the connection machines' states moves in and out of their `State` enums on every event
/// (`guard case .intercepting(var x) = state` ... `state = .intercepting(x)`). A kilobyte-sized payload (a
/// `ProtectedExchange` carries the request, the origin, the settings and a head parser) made that a memmove
/// and a retain per reference field each way, several times per response header line: the intercept path's
/// largest cost after libcurl (perf, `scripts/bench` rows 6 and 6b). Boxed, it moves as a pointer; a change
/// happens in place while the box is not shared (`ConnectionMachine.changeIntercepting` moves the payload
/// out of the state first so that it is not) and copies the value once when it is.
@propertyWrapper
public struct Boxed<Value: Sendable>: Sendable {
    /// Changed only through `wrappedValue`'s `_modify` while uniquely referenced, never while shared.
    private final class Box: @unchecked Sendable {
        var value: Value
        init(_ value: Value) { self.value = value }
    }

    private var box: Box

    public init(wrappedValue: Value) { box = Box(wrappedValue) }

    public var wrappedValue: Value {
        // Borrowed, not copied: reading one field of a boxed struct copies that field alone.
        _read { yield box.value }
        set {
            if isKnownUniquelyReferenced(&box) {
                box.value = newValue
            } else {
                box = Box(newValue)
            }
        }
        _modify {
            if !isKnownUniquelyReferenced(&box) { box = Box(box.value) }
            yield &box.value
        }
    }
}
