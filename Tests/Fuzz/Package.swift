// swift-tools-version:6.0
// libFuzzer targets for the parsers in ProxyCore. Build and run them with scripts/fuzz; each product must be
// built on its own (`--product NAME`): a whole-package fuzzer build breaks the root package's executables.
import Foundation
import PackageDescription

// A path dependency is identified by its directory's name, which is whatever the clone is called.
let rootIdentity = URL(fileURLWithPath: Context.packageDirectory)
    .deletingLastPathComponent().deletingLastPathComponent().lastPathComponent.lowercased()

let fuzzTargets = [
    "FuzzHTTPRequestHead", "FuzzHTTPResponseHead", "FuzzChunked", "FuzzConfig", "FuzzAuthority", "FuzzJSON",
    "FuzzChallenge", "FuzzDiscovery", "FuzzCredentials",
    "FuzzInterceptSemantics", "FuzzConnection", "FuzzH2Session", "FuzzResponseReader",
]

let package = Package(
    name: "ProxyCoreFuzz",
    products: fuzzTargets.map { .executable(name: $0, targets: [$0]) },
    dependencies: [
        .package(path: "../..")
    ],
    targets: [
        // The harnesses: invariants and the deterministic input splitting they share.
        .target(
            name: "FuzzSupport",
            dependencies: [.product(name: "ProxyCore", package: rootIdentity)]
        )
    ] + fuzzTargets.map { .executableTarget(name: $0, dependencies: ["FuzzSupport"]) },
    swiftLanguageModes: [.v6]
)
