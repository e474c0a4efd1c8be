import Foundation
import PackagePlugin

/// Writes `BuildInfo.swift` (the commit the binary is built from) before every build, so that `proxyctl --version`
/// names it in every build, `swift build` by hand included. The script rewrites the file only when the commit
/// changed, so an unchanged tree compiles nothing again.
@main
struct BuildInfo: BuildToolPlugin {
    func createBuildCommands(context: PluginContext, target: Target) async throws -> [Command] {
        let output = context.pluginWorkDirectoryURL.appending(path: "generated")
        return [
            .prebuildCommand(
                displayName: "proxyctl build info",
                executable: URL(fileURLWithPath: "/bin/sh"),
                arguments: [
                    context.package.directoryURL.appending(path: "scripts/build-info").path,
                    context.package.directoryURL.path, output.appending(path: "BuildInfo.swift").path,
                ],
                outputFilesDirectory: output)
        ]
    }
}
