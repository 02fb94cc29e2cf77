/* k3serve's bind() for processes that run a Mooncake Transfer Engine (transfer/mooncake/listeners.py).
 *
 * The engine binds its handshake socket to 0.0.0.0 and its TCP transport to the v6 wildcard whatever host it is
 * given. Preloaded (LD_PRELOAD), this bind() moves a wildcard bind to the IPv4 address in k3serve_bind_host while
 * that holds one (listeners.py writes it around the engine's start): 0.0.0.0 -> the host, :: -> ::ffff:host (the
 * dual-stack socket then takes IPv4 peers of that address only). Binds to a named address, and every bind while
 * k3serve_bind_host is empty, are left alone. A global, not the environment: setenv races other threads. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <netinet/in.h>
#include <string.h>
#include <sys/socket.h>

typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);

char k3serve_bind_host[INET_ADDRSTRLEN]; /* "" or an IPv4 address; written by listeners.py */

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
    static bind_fn real;
    if (!real) real = (bind_fn)dlsym(RTLD_NEXT, "bind");
    char host[INET_ADDRSTRLEN];
    memcpy(host, k3serve_bind_host, sizeof host);
    host[sizeof host - 1] = 0;
    struct in_addr v4;
    if (!host[0] || !addr || inet_pton(AF_INET, host, &v4) != 1) return real(fd, addr, len);
    if (addr->sa_family == AF_INET && len >= (socklen_t)sizeof(struct sockaddr_in)) {
        struct sockaddr_in a;
        memcpy(&a, addr, sizeof a);
        if (a.sin_addr.s_addr != htonl(INADDR_ANY)) return real(fd, addr, len);
        a.sin_addr = v4;
        return real(fd, (const struct sockaddr *)&a, sizeof a);
    }
    if (addr->sa_family == AF_INET6 && len >= (socklen_t)sizeof(struct sockaddr_in6)) {
        struct sockaddr_in6 a;
        memcpy(&a, addr, sizeof a);
        if (!IN6_IS_ADDR_UNSPECIFIED(&a.sin6_addr)) return real(fd, addr, len);
        memset(&a.sin6_addr, 0, sizeof a.sin6_addr);
        a.sin6_addr.s6_addr[10] = 0xff; /* ::ffff:a.b.c.d, the v4-mapped form */
        a.sin6_addr.s6_addr[11] = 0xff;
        memcpy(&a.sin6_addr.s6_addr[12], &v4, 4);
        return real(fd, (const struct sockaddr *)&a, sizeof a);
    }
    return real(fd, addr, len);
}
