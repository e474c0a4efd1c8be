import CLibevent
import ProxyCore

/// The per-stream state the I/O needs: the body store, the transfer, the response bytes waiting for the
/// client's flow-control window.
final class H2StreamIO {
    let id: Int32
    var fields: [H2Field] = []
    var fieldBytes = 0
    /// Why the header block being received is over the limits (its further fields are not kept).
    var overLimit: String?
    /// The stream's exchange with the origin (its body, tokens and transfer): from its request head on.
    var exchange: ExchangeIO?
    /// Bytes of the request body received but not yet acknowledged to the client (flow control).
    var unacknowledged = 0
    /// Response bytes waiting for the client's window: a chain of blocks, so what the client took is freed
    /// as it goes (an array with a start offset grew by every byte taken while bytes were left in it).
    let pending = evbuffer_new()!
    var responseEnded = false
    var trailers: [H2Field] = []
    /// The data provider returned NGHTTP2_ERR_DEFERRED: resume it when bytes come.
    var deferred = false
    /// nghttp2 closed the stream.
    var closed = false
    /// An exchange runs for the stream (from its first action to `exchangeFinished`).
    var inExchange = false
    /// A WebSocket stream: our end of the pair whose other end an HTTP/1.1 `ClientDriver` reads.
    var tunnel: TunnelEnd?
    /// The machine wants no more of the request body (`dropRequestBody`).
    var bodyUnwanted = false

    init(id: Int32) { self.id = id }

    deinit { evbuffer_free(pending) }

    var pendingCount: Int { evbuffer_get_length(pending) }
}

/// An `H2Driver`'s streams by id, remembering the last one looked up: nghttp2's callbacks and the session's
/// actions come in runs for one stream (a callback per field of a header block, several actions per event),
/// and a dictionary lookup hashes the id (SipHash) every time: about 45 lookups per request, 5,000
/// instructions (`scripts/instructions --h2`).
struct StreamTable {
    private var table: [Int32: H2StreamIO] = [:]
    private var last: H2StreamIO?

    subscript(id: Int32) -> H2StreamIO? {
        mutating get {
            if let last, last.id == id { return last }
            let found = table[id]
            if found != nil { last = found }
            return found
        }
        set {
            table[id] = newValue
            last = newValue
        }
    }

    mutating func removeValue(forKey id: Int32) {
        table.removeValue(forKey: id)
        if last?.id == id { last = nil }
    }

    mutating func removeAll() {
        table.removeAll()
        last = nil
    }

    var values: Dictionary<Int32, H2StreamIO>.Values { table.values }
}
