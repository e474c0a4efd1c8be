#ifndef PROXYCTL_CLIBEVENT_SHIM_H
#define PROXYCTL_CLIBEVENT_SHIM_H

// libevent's event-config.h defines _GNU_SOURCE; including the socket headers first keeps fd_set
// identical to the definition CCurl sees (otherwise: "'__fds_bits' ... is not present in definition").
#include <sys/types.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/select.h>
#include <sys/resource.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <arpa/inet.h>
#include <netdb.h>
#include <signal.h>
#include <unistd.h>
#include <fcntl.h>
#include <errno.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <malloc.h>
#endif

#include <event2/event.h>
#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/bufferevent_ssl.h>
#include <event2/listener.h>
#include <event2/thread.h>
#include <event2/util.h>

#include <openssl/ssl.h>

#if defined(__linux__)
#include <linux/netlink.h>
#include <linux/sock_diag.h>
#include <linux/inet_diag.h>
#endif
#include <string.h>

// Every call below that Linux alone has is reached through ProxyIO's Platform (docs/porting.md), which says when
// it is used; elsewhere each compiles to a stub that fails (or does nothing), and Platform takes the fallback.

// evsignal_new is a function-like macro.
static inline struct event *proxyctl_evsignal_new(struct event_base *base, int signum,
                                                  event_callback_fn cb, void *arg) {
    return event_new(base, signum, EV_SIGNAL | EV_PERSIST, cb, arg);
}

// setsockopt takes a void pointer; a typed wrapper keeps the call sites short.
// glibc's allocator for a process that streams: blocks up to 4 MiB come from the heap (the default threshold
// starts at 128 KiB, so the 128 KiB chains a 64 KiB read reserves were mmap'ed, or, once it adapted, the heap's
// top was trimmed and grown again on every pass), and up to 8 MiB free at the top of the heap stays there.
// Measured: a bulk download through the own upstream client spent half its CPU time in the kernel on it.
// Elsewhere the system's allocator is left as it is.
static inline void proxyctl_tune_allocator(void) {
#if defined(__GLIBC__)
    mallopt(M_MMAP_THRESHOLD, 4 << 20);
    mallopt(M_TRIM_THRESHOLD, 8 << 20);
#endif
}

static inline int proxyctl_set_nodelay(int fd) {
    int one = 1;
    return setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

// A close-on-exec socket of `family`, a stream (TCP) or a datagram one, non-blocking when asked (SOCK_STREAM named in
// Swift in a second file of a module made the compiler lose it in the first). `atomic`: the flags given to
// socket(2) itself (Linux and the BSDs: no moment in which a fork on another thread could inherit it), else set
// with fcntl(2) after it, as macOS needs.
static inline int proxyctl_socket(int family, int datagram, int nonblocking, int atomic) {
    int type = datagram ? SOCK_DGRAM : SOCK_STREAM;
#if defined(SOCK_NONBLOCK) && defined(SOCK_CLOEXEC)
    if (atomic) return socket(family, type | SOCK_CLOEXEC | (nonblocking ? SOCK_NONBLOCK : 0), 0);
#else
    (void)atomic;
#endif
    int fd = socket(family, type, 0);
    if (fd < 0) return fd;
    if (fcntl(fd, F_SETFD, FD_CLOEXEC) != 0 ||
        (nonblocking && fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK) != 0)) {
        close(fd);
        return -1;
    }
    return fd;
}

// errno is a macro over a thread-local; Swift's Glibc import covers it, but a function keeps the I/O
// layer free of Glibc-specific spelling.
static inline int proxyctl_errno(void) { return errno; }

// EVUTIL_SOCKET_ERROR is a macro.
static inline int proxyctl_socket_error(int fd) {
    int err = 0;
    socklen_t len = sizeof(err);
    if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) return errno;
    return err;
}

// splice(2), pipe2(2) and F_SETPIPE_SZ are declared only under _GNU_SOURCE, which must not be set before
// the socket headers (see the top of this file): call them through syscall(2). Linux only: elsewhere they fail
// with ENOSYS and tunnels copy (Platform.splices).
// Moves up to `length` bytes between a socket and a pipe without copying them through user space.
static inline long proxyctl_splice(int from, int to, size_t length) {
#if defined(__linux__)
    return syscall(SYS_splice, from, NULL, to, NULL, length, 1u /* SPLICE_F_MOVE */ | 2u /* SPLICE_F_NONBLOCK */);
#else
    (void)from, (void)to, (void)length;
    errno = ENOSYS;
    return -1;
#endif
}
static inline int proxyctl_pipe(int fds[2]) {
#if defined(__linux__)
    return (int)syscall(SYS_pipe2, fds, O_NONBLOCK | O_CLOEXEC);
#else
    (void)fds;
    errno = ENOSYS;
    return -1;
#endif
}
static inline int proxyctl_set_pipe_size(int fd, int size) {
#if defined(__linux__)
    return fcntl(fd, 1031 /* F_SETPIPE_SZ */, size);
#else
    (void)fd, (void)size;
    errno = ENOSYS;
    return -1;
#endif
}

// The calling thread's name as ps(1) and gdb show it (at most 15 bytes on Linux). pthread_setname_np is declared
// only under _GNU_SOURCE (see the top of this file), and its arguments differ on Darwin.
#if defined(__linux__)
#include <sys/prctl.h>
static inline void proxyctl_name_thread(const char *name) { (void)prctl(PR_SET_NAME, name, 0, 0, 0); }
#else
#include <pthread.h>
static inline void proxyctl_name_thread(const char *name) { (void)pthread_setname_np(name); }
#endif

// MSG_NOSIGNAL is an enumerator shadowed by a macro of the same name; Swift does not always import it. 0 where
// there is none (macOS): SIGPIPE is ignored for the whole process (EventLoop.initializeLibraries).
static inline int proxyctl_msg_nosignal(void) {
#if defined(MSG_NOSIGNAL)
    return MSG_NOSIGNAL;
#else
    return 0;
#endif
}

// SO_LINGER with a zero timeout: close(2) then sends a reset (RST) instead of a FIN, so the peer cannot take
// a response cut short for a complete one.
static inline int proxyctl_set_linger_reset(int fd) {
    struct linger option = {1, 0};
    return setsockopt(fd, SOL_SOCKET, SO_LINGER, &option, sizeof(option));
}

// The uid owning the other end of the accepted TCP connection `fd` when both ends are on this machine (a
// loopback client, or one connecting to one of this machine's addresses): a NETLINK_SOCK_DIAG query for
// the client socket's exact 4-tuple, as ss(8) makes. -1 when it is not known (a remote peer, no netlink).
// No privilege is needed. IPv4-mapped IPv6 peers are looked up as the IPv4 sockets they are.
// `link` is a NETLINK_SOCK_DIAG socket kept by the caller (-1: this call opens one and stores it there), so a
// connection costs a send and a receive, not a socket's creation; `sequence` numbers the queries. An answer is
// taken only when it carries this query's number and the ports of the socket asked about; anything else
// (a late answer to an earlier query) is read past, and a socket in doubt is closed and set to -1.
// `inode` receives the client socket's inode (idiag_inode, 0 when the kernel gave none), by which the audit log
// finds the process holding it in /proc/PID/fd (Platform.socketHolders).
// Linux only: elsewhere -1 (Platform.namesSocketOwner is false there).
static inline long proxyctl_tcp_peer_socket(int fd, int *link, unsigned *sequence, unsigned long long *inode) {
    *inode = 0;
#if !defined(__linux__)
    (void)fd, (void)link, (void)sequence;
    return -1;
#else
    struct sockaddr_storage local, peer;
    socklen_t local_length = sizeof local, peer_length = sizeof peer;
    if (getsockname(fd, (struct sockaddr *)&local, &local_length) != 0) return -1;
    if (getpeername(fd, (struct sockaddr *)&peer, &peer_length) != 0) return -1;
    struct { struct nlmsghdr header; struct inet_diag_req_v2 request; } message;
    memset(&message, 0, sizeof message);
    message.header.nlmsg_len = sizeof message;
    message.header.nlmsg_type = SOCK_DIAG_BY_FAMILY;
    message.header.nlmsg_flags = NLM_F_REQUEST;
    message.header.nlmsg_seq = ++*sequence;
    message.request.sdiag_protocol = IPPROTO_TCP;
    message.request.idiag_states = ~0U;
    message.request.id.idiag_cookie[0] = INET_DIAG_NOCOOKIE;
    message.request.id.idiag_cookie[1] = INET_DIAG_NOCOOKIE;
    // The client's socket: its source is our peer, its destination our local address.
    if (local.ss_family == AF_INET) {
        struct sockaddr_in *l = (struct sockaddr_in *)&local, *p = (struct sockaddr_in *)&peer;
        message.request.sdiag_family = AF_INET;
        message.request.id.idiag_sport = p->sin_port;
        message.request.id.idiag_dport = l->sin_port;
        memcpy(message.request.id.idiag_src, &p->sin_addr, 4);
        memcpy(message.request.id.idiag_dst, &l->sin_addr, 4);
    } else if (local.ss_family == AF_INET6) {
        struct sockaddr_in6 *l = (struct sockaddr_in6 *)&local, *p = (struct sockaddr_in6 *)&peer;
        message.request.id.idiag_sport = p->sin6_port;
        message.request.id.idiag_dport = l->sin6_port;
        if (IN6_IS_ADDR_V4MAPPED(&p->sin6_addr) && IN6_IS_ADDR_V4MAPPED(&l->sin6_addr)) {
            message.request.sdiag_family = AF_INET;
            memcpy(message.request.id.idiag_src, &p->sin6_addr.s6_addr[12], 4);
            memcpy(message.request.id.idiag_dst, &l->sin6_addr.s6_addr[12], 4);
        } else {
            message.request.sdiag_family = AF_INET6;
            memcpy(message.request.id.idiag_src, &p->sin6_addr, 16);
            memcpy(message.request.id.idiag_dst, &l->sin6_addr, 16);
        }
    } else {
        return -1;
    }
    if (*link < 0) {
        *link = socket(AF_NETLINK, SOCK_DGRAM | SOCK_CLOEXEC, NETLINK_SOCK_DIAG);
        if (*link < 0) return -1;
    }
    if (send(*link, &message, sizeof message, 0) != (ssize_t)sizeof message) {
        close(*link);
        *link = -1;
        return -1;
    }
    // The kernel answers a sock_diag query before send returns: an answer is waiting, and one for an earlier
    // query that was never read (an interrupted receive) would come first.
    for (int attempt = 0; attempt < 4; attempt++) {
        char answer[1024];
        ssize_t length = recv(*link, answer, sizeof answer, MSG_DONTWAIT);
        if (length <= 0) break;
        struct nlmsghdr *reply = (struct nlmsghdr *)answer;
        if (!NLMSG_OK(reply, (unsigned)length) || reply->nlmsg_seq != message.header.nlmsg_seq) continue;
        if (reply->nlmsg_type != SOCK_DIAG_BY_FAMILY) return -1;  // NLMSG_ERROR: no such socket
        if (reply->nlmsg_len < NLMSG_LENGTH(sizeof(struct inet_diag_msg))) return -1;
        struct inet_diag_msg *found = (struct inet_diag_msg *)NLMSG_DATA(reply);
        // The ports (the addresses of a dual-stack socket come back in their IPv6 form).
        if (found->id.idiag_sport != message.request.id.idiag_sport ||
            found->id.idiag_dport != message.request.id.idiag_dport)
            return -1;
        *inode = found->idiag_inode;
        return found->idiag_uid;
    }
    close(*link);
    *link = -1;
    return -1;
#endif
}

// glibc defines EAI_NODATA (a name with no addresses) only under _GNU_SOURCE, which must not be set
// before the socket headers above (see the top of this file).
// Elsewhere the system's own value, where it has one (macOS: 7, obsolete; its getaddrinfo answers EAI_NONAME).
static inline int proxyctl_eai_nodata(void) {
#if defined(__GLIBC__)
    return -5;
#elif defined(EAI_NODATA)
    return EAI_NODATA;
#else
    return EAI_NONAME;
#endif
}

#endif
