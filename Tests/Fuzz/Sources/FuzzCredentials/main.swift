import FuzzSupport

@_cdecl("LLVMFuzzerTestOneInput")
public func fuzz(_ data: UnsafePointer<UInt8>?, _ size: Int) -> Int32 {
    fuzzCredentials(UnsafeBufferPointer(start: data, count: size))
    return 0
}
