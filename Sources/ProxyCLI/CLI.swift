import ProxyIO
