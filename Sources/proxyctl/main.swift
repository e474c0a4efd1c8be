import ProxyCLI
