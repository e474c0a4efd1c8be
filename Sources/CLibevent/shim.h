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
#include <sys/syscall.h>

#include <event2/event.h>
#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/bufferevent_ssl.h>
#include <event2/listener.h>
#include <event2/thread.h>
#include <event2/util.h>

#include <openssl/ssl.h>

// evsignal_new is a function-like macro.
static inline struct event *proxyctl_evsignal_new(struct event_base *base, int signum,
                                                  event_callback_fn cb, void *arg) {
    return event_new(base, signum, EV_SIGNAL | EV_PERSIST, cb, arg);
}

// setsockopt takes a void pointer; a typed wrapper keeps the call sites short.
static inline int proxyctl_set_nodelay(int fd) {
    int one = 1;
    return setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
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
// the socket headers (see the top of this file): call them through syscall(2).
// Moves up to `length` bytes between a socket and a pipe without copying them through user space.
static inline long proxyctl_splice(int from, int to, size_t length) {
    return syscall(SYS_splice, from, NULL, to, NULL, length, 1u /* SPLICE_F_MOVE */ | 2u /* SPLICE_F_NONBLOCK */);
}
static inline int proxyctl_pipe(int fds[2]) { return (int)syscall(SYS_pipe2, fds, O_NONBLOCK | O_CLOEXEC); }
static inline int proxyctl_set_pipe_size(int fd, int size) { return fcntl(fd, 1031 /* F_SETPIPE_SZ */, size); }

// MSG_NOSIGNAL is an enumerator shadowed by a macro of the same name; Swift does not always import it.
static inline int proxyctl_msg_nosignal(void) { return MSG_NOSIGNAL; }

// SO_LINGER with a zero timeout: close(2) then sends a reset (RST) instead of a FIN, so the peer cannot take
// a response cut short for a complete one.
static inline int proxyctl_set_linger_reset(int fd) {
    struct linger option = {1, 0};
    return setsockopt(fd, SOL_SOCKET, SO_LINGER, &option, sizeof(option));
}

// glibc defines EAI_NODATA (a name with no addresses) only under _GNU_SOURCE, which must not be set
// before the socket headers above (see the top of this file).
static inline int proxyctl_eai_nodata(void) { return -5; }

#endif
