// swift-tools-version:6.0
import PackageDescription

/// Cross-module optimisation for release builds (docs/benchmarks.md has the before/after).
let crossModule: [SwiftSetting] = [.unsafeFlags(["-cross-module-optimization"], .when(configuration: .release))]

/// Exclusive access to class properties and globals is proven by the compiler where it can be and, for the
/// rest, checked at run time in debug builds (every unit test, the fuzz targets) but not in release builds of
/// the hot path: the run-time check (`swift_beginAccess`, an access set per thread) was 4,000 instructions of
/// every intercepted HTTP/1.1 request and 13,000 of every HTTP/2 stream (`scripts/instructions`,
/// docs/performance.md).
let uncheckedExclusivity: [SwiftSetting] = [
    .unsafeFlags(["-enforce-exclusivity=unchecked"], .when(configuration: .release))
]

/// The release binary as it ships (docs/packaging.md): linked by lld with packed relative relocations (DT_RELR,
/// glibc 2.36, Debian 12: the static Swift runtime's 39,000 relocations took 925 KB of the binary, all read at
/// every start), and every symbol bound at start (`-z now`, so that the read-only relocations cover the GOT).
/// The functions every request runs go first and together (`--symbol-ordering-file`, written by
/// scripts/hot-functions from callgrind profiles of the busy paths): a request's code took 227 pages of 4 KiB
/// spread over the text, 181 laid out so (docs/performance.md, row 6b); names no longer in the binary are
/// skipped. ELF only: other systems link as their toolchain does (docs/porting.md).
let releaseLinking: [LinkerSetting] = [
    .unsafeFlags(
        [
            "-use-ld=lld", "-Xlinker", "-z", "-Xlinker", "pack-relative-relocs", "-Xlinker", "-z", "-Xlinker", "now",
            "-Xlinker", "--symbol-ordering-file=\(Context.packageDirectory)/Sources/proxyctl/hot-functions.txt",
            "-Xlinker", "--no-warn-symbol-ordering",
        ],
        .when(platforms: [.linux], configuration: .release))
]

let package = Package(
    name: "proxyctl",
    products: [
        .executable(name: "proxyctl", targets: ["proxyctl"]),
        // For the fuzz package under Tests/Fuzz only: the parsers it drives.
        .library(name: "ProxyCore", targets: ["ProxyCore"]),
        .library(name: "ProxyOAuth", targets: ["ProxyOAuth"]),
        .library(name: "ProxyTLS", targets: ["ProxyTLS"]),
    ],
    targets: [
        // System libraries: a modulemap and a shim header each, nothing else.
        .systemLibrary(
            name: "CLibevent",
            pkgConfig: "libevent_openssl",
            providers: [.apt(["libevent-dev"]), .brew(["libevent"])]
        ),
        // libcurl's header and, in loader.c, libcurl itself loaded at the first request to a provider (dlopen), so
        // that a serve that needs no provider maps none of it (docs/packaging.md).
        .target(name: "CCurl"),
        .systemLibrary(
            name: "CNghttp2",
            pkgConfig: "libnghttp2",
            providers: [.apt(["libnghttp2-dev"]), .brew(["libnghttp2"])]
        ),
        .systemLibrary(
            name: "COpenSSL",
            pkgConfig: "openssl",
            providers: [.apt(["libssl-dev"]), .brew(["openssl@3"])]
        ),

        // Pure logic: Foundation only; no sockets, no C.
        // Release builds inline and specialise ProxyCore's generic machines (`some ByteView`) into ProxyIO's
        // callers: without it every event of the hot path ran unspecialised through witness tables.
        .target(name: "ProxyCore", swiftSettings: crossModule + uncheckedExclusivity),
        // OpenSSL: CA, leaf certificates, ES256, hashing, randomness.
        .target(name: "ProxyTLS", dependencies: ["ProxyCore", "COpenSSL"]),
        // Sign-in and tokens: discovery, PKCE, login flows, ID tokens, the token store, refresh. Decides; the
        // HTTP requests it needs go through a transport that ProxyIO provides.
        .target(name: "ProxyOAuth", dependencies: ["ProxyCore", "ProxyTLS"]),
        // The only module that touches sockets.
        .target(
            name: "ProxyIO",
            dependencies: ["ProxyCore", "ProxyTLS", "ProxyOAuth", "CLibevent", "CCurl", "CNghttp2", "COpenSSL"],
            swiftSettings: uncheckedExclusivity),
        // argv -> command, help text, exit codes; the commit it is built from (the BuildInfo plugin).
        .target(
            name: "ProxyCLI", dependencies: ["ProxyCore", "ProxyTLS", "ProxyOAuth", "ProxyIO"],
            plugins: [.plugin(name: "BuildInfo")]),
        .executableTarget(
            name: "proxyctl", dependencies: ["ProxyCLI"],
            // The release link's layout (releaseLinking), not a source or a resource.
            exclude: ["hot-functions.txt"], linkerSettings: releaseLinking),
        // Writes BuildInfo.swift (the commit) before each build: scripts/build-info.
        .plugin(name: "BuildInfo", capability: .buildTool()),

        // Known answers made by implementations this project did not write (PyJWT), shared by the test targets.
        .target(name: "TestFixtures", path: "Tests/TestFixtures"),
        .testTarget(name: "ProxyCoreTests", dependencies: ["ProxyCore"]),
        .testTarget(name: "ProxyTLSTests", dependencies: ["ProxyTLS", "ProxyCore", "TestFixtures"]),
        .testTarget(name: "ProxyOAuthTests", dependencies: ["ProxyOAuth", "ProxyTLS", "ProxyCore", "TestFixtures"]),
        .testTarget(
            name: "ProxyIOTests",
            dependencies: [
                "ProxyIO", "ProxyOAuth", "ProxyCore", "ProxyTLS", "COpenSSL", "CLibevent", "CCurl", "TestFixtures",
            ]),
    ],
    swiftLanguageModes: [.v6]
)
