// swift-tools-version:6.0
// Micro-benchmarks of proxyctl's own code, for scripts/bench. Build with `swift build -c release` in this
// directory (scripts/bench does, with its own scratch path); nothing here is part of the test suite.
import Foundation
import PackageDescription

// A path dependency is identified by its directory's name, which is whatever the clone is called.
let rootIdentity = URL(fileURLWithPath: Context.packageDirectory)
    .deletingLastPathComponent().deletingLastPathComponent().lastPathComponent.lowercased()

let package = Package(
    name: "ProxyctlBench",
    products: [.executable(name: "DPoPBench", targets: ["DPoPBench"])],
    dependencies: [
        .package(path: "../..")
    ],
    targets: [
        .executableTarget(
            name: "DPoPBench",
            dependencies: [
                .product(name: "ProxyOAuth", package: rootIdentity),
                .product(name: "ProxyTLS", package: rootIdentity),
            ]
        )
    ],
    swiftLanguageModes: [.v6]
)
