// DPoP proofs per second on one core, made by `DPoPKey.proof(...)` exactly as the proxy makes one for every
// request to a DPoP-bound protected origin (fresh jti, htm, htu, iat, ath; ES256). Also times the ES256
// signature alone (`PrivateKey.signES256` over a signing input of the same length), so the cost of the
// proof around the signature can be told apart.
//
//   DPoPBench [--proofs N] [--key PKCS8.pem] [--token-bytes N] [--evict-kib N]
//
// --evict-kib N: also time proofs with N KiB of memory written between two proofs (what TLS and libcurl do
// to the caches between two requests in the proxy), less the time of the writes alone: how much a proof
// costs when it starts with cold caches.
//
// Prints one JSON object: counts, CPU seconds (CLOCK_PROCESS_CPUTIME_ID: user + system of this one-thread process) and wall seconds
// for each loop, and the rates per CPU second.
import Foundation
import ProxyOAuth
import ProxyTLS

#if canImport(Glibc)
    import Glibc
#endif

func cpuSeconds() -> Double {
    var now = timespec()
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &now)
    return Double(now.tv_sec) + Double(now.tv_nsec) / 1e9
}

func wallSeconds() -> Double {
    var now = timespec()
    clock_gettime(CLOCK_MONOTONIC, &now)
    return Double(now.tv_sec) + Double(now.tv_nsec) / 1e9
}

func fail(_ message: String) -> Never {
    FileHandle.standardError.write(Data("DPoPBench: \(message)\n".utf8))
    exit(1)
}

var proofs = 20000
var keyFile: String? = nil
var tokenBytes = 800
var evictKiB = 0
var arguments = CommandLine.arguments.dropFirst()
while let argument = arguments.popFirst() {
    switch argument {
    case "--proofs": proofs = arguments.popFirst().flatMap { Int($0) } ?? 0
    case "--key": keyFile = arguments.popFirst()
    case "--token-bytes": tokenBytes = arguments.popFirst().flatMap { Int($0) } ?? -1
    case "--evict-kib": evictKiB = arguments.popFirst().flatMap { Int($0) } ?? -1
    default: fail("usage: DPoPBench [--proofs N] [--key PKCS8.pem] [--token-bytes N] [--evict-kib N]")
    }
}
guard proofs > 0, tokenBytes >= 0, evictKiB >= 0 else {
    fail("--proofs, --token-bytes and --evict-kib take positive numbers")
}

let key: DPoPKey
do {
    if let keyFile {
        guard let pem = FileManager.default.contents(atPath: keyFile) else { fail("cannot read \(keyFile)") }
        key = try DPoPKey(try PrivateKey.fromPEM(Array(pem)))
    } else {
        key = try DPoPKey(try PrivateKey.generateP256())
    }
} catch {
    fail("cannot load or make the key: \(error)")
}

// An access token of a typical JWT's length (what `ath` hashes); the URL of the intercept benchmark.
let token = String(repeating: "a", count: tokenBytes)
let url = "https://bench.test/small.txt"
let now = Int64(time(nil))

func makeProof() -> String {
    do {
        return try key.proof(method: "GET", url: url, accessToken: token, nonce: nil, now: now)
    } catch {
        fail("proof failed: \(error)")
    }
}

// Warm up (lazy OpenSSL initialisation, allocator), and check the shape once.
var sample = ""
for _ in 0..<max(200, proofs / 20) { sample = makeProof() }
let parts = sample.split(separator: ".", omittingEmptySubsequences: false)
guard parts.count == 3, parts.allSatisfy({ !$0.isEmpty }) else { fail("a proof is not a compact JWS: \(sample)") }
let signingInput = Array(parts[0..<2].joined(separator: ".").utf8)

var totalLength = 0
let proofCPU0 = cpuSeconds()
let proofWall0 = wallSeconds()
for _ in 0..<proofs { totalLength &+= makeProof().utf8.count }
let proofWall = wallSeconds() - proofWall0
let proofCPU = cpuSeconds() - proofCPU0

// The signature alone, over a signing input of the same length.
var signatureLength = 0
let signCPU0 = cpuSeconds()
let signWall0 = wallSeconds()
do {
    for _ in 0..<proofs { signatureLength &+= try key.key.signES256(signingInput).count }
} catch {
    fail("signing failed: \(error)")
}
let signWall = wallSeconds() - signWall0
let signCPU = cpuSeconds() - signCPU0

// Cold caches: N KiB written (one byte per cache line) before every proof, less the writes alone.
var evicted = ""
if evictKiB > 0 {
    var buffer = [UInt8](repeating: 0, count: evictKiB * 1024)
    func evict(_ round: Int) {
        buffer.withUnsafeMutableBufferPointer { memory in
            var offset = 0
            while offset < memory.count {
                memory[offset] &+= UInt8(truncatingIfNeeded: round)
                offset += 64
            }
        }
    }
    let rounds = max(1, proofs / 4)
    let writesCPU0 = cpuSeconds()
    for round in 0..<rounds { evict(round) }
    let writesCPU = cpuSeconds() - writesCPU0
    let coldCPU0 = cpuSeconds()
    for round in 0..<rounds {
        evict(round)
        totalLength &+= makeProof().utf8.count
    }
    let coldCPU = cpuSeconds() - coldCPU0
    let perProof = (coldCPU - writesCPU) / Double(rounds)
    evicted =
        #", "evict_kib": \#(evictKiB), "cold_proof_cpu_us": \#(String(format: "%.1f", perProof * 1e6))"#
        + #", "evict_writes_cpu_us": \#(String(format: "%.1f", writesCPU / Double(rounds) * 1e6))"#
}

func number(_ value: Double) -> String { String(format: "%.6f", value) }

print(
    """
    {"proofs": \(proofs), "proof_bytes": \(totalLength / proofs), "proof_cpu_s": \(number(proofCPU)), \
    "proof_wall_s": \(number(proofWall)), "proofs_per_cpu_s": \(number(Double(proofs) / proofCPU)), \
    "proofs_per_wall_s": \(number(Double(proofs) / proofWall)), \
    "signatures": \(proofs), "signature_bytes": \(signatureLength / proofs), \
    "signature_cpu_s": \(number(signCPU)), "signature_wall_s": \(number(signWall)), \
    "signatures_per_cpu_s": \(number(Double(proofs) / signCPU)), "token_bytes": \(tokenBytes), \
    "thumbprint": "\(key.thumbprint)"\(evicted)}
    """)
