import Foundation
import ProxyCLI

exit(ProxyctlCommand.main(Array(CommandLine.arguments.dropFirst())))
