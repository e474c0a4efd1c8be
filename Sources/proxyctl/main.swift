import ProxyCLI

#if canImport(Glibc)
    import Glibc
#elseif canImport(Darwin)
    import Darwin
#endif

exit(ProxyctlCommand.main(Array(CommandLine.arguments.dropFirst())))
