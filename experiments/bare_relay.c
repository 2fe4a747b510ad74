/* The floor of a front: a relay that forwards a party's link traffic with no checks at all.

   Benchmarks only (`python -m experiments.front_cost OUT --floor`): it stands in for
   runtime/distributed/front.py (run_loopback's front_program), so that the cost of the relay
   hop itself (one more process, its socket calls and wake-ups) is measured apart from what the
   project's front does per frame. It must never serve a real run: it reads no frame header
   and enforces nothing.

   What it shares with the front: the command line (one argument, the FrontSpec JSON of
   front_state.py, of which it reads listen_host, listen_port, party, hello_key and private_dir),
   brpc's Unix socket in the party's private directory (private_dir/brpc.sock), the start-up
   line ({"ready": true, "backend": PATH, "outbound": {}}), the answer to the fronts' hello
   (HMAC-SHA256 keyed by hello_key, so that the parties' liveness probes pass), and the
   "stats" line on stdin (answered with this process's CPU seconds). Plain TCP only.

   Build: cc -O2 -o bare_relay bare_relay.c -lcrypto */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#define CHUNK (1 << 20)
#define HELLO_BYTES 41 /* "MPCH " + 32 hex digits + "\r\n\r\n" (frames.hello_request) */

typedef struct Side {
    int fd;
    int hello;           /* an inbound connection whose first bytes are not seen yet */
    struct Side *peer;   /* the other end of the relay */
    char *pending;       /* bytes read from `peer` not yet written to this fd */
    size_t len, off;
} Side;

static unsigned char hello_key[32];
static struct sockaddr_un backend = {.sun_family = AF_UNIX};
static int ep;
static char party[128];
static long reads;

static int fail(const char *why) {
    printf("{\"error\": \"%s\", \"kind\": \"front\"}\n", why);
    fflush(stdout);
    return 2;
}

/* The string value of "name" in json.dumps output (no escapes in the fields read here). */
static int json_string(const char *json, const char *name, char *out, size_t cap) {
    char pattern[64];
    snprintf(pattern, sizeof pattern, "\"%s\": \"", name);
    const char *at = strstr(json, pattern);
    if (!at) return -1;
    at += strlen(pattern);
    size_t n = 0;
    while (at[n] && at[n] != '"' && at[n] != '\\') n++;
    if (at[n] != '"' || n + 1 > cap) return -1;
    memcpy(out, at, n);
    out[n] = 0;
    return 0;
}

static void set_options(int fd) {
    int one = 1;
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

static void close_pair(Side *s) {
    if (s->fd >= 0) { close(s->fd); s->fd = -1; }
    if (s->peer && s->peer->fd >= 0) { close(s->peer->fd); s->peer->fd = -1; }
}

static int hex_byte(const char *p) {
    unsigned v;
    return sscanf(p, "%2x", &v) == 1 ? (int)v : -1;
}

/* Answer a hello on `s` (frames.hello_answer) and close; 0 if more bytes are needed. */
static int answer_hello(Side *s) {
    char request[HELLO_BYTES];
    ssize_t n = recv(s->fd, request, sizeof request, MSG_PEEK);
    if (n < HELLO_BYTES) return n == 0 ? (close_pair(s), 1) : 0;
    n = read(s->fd, request, sizeof request);
    unsigned char message[14 + 16 + sizeof party], answer[4 + EVP_MAX_MD_SIZE];
    memcpy(message, "mpcache hello\0", 14);
    for (int i = 0; i < 16; i++) {
        int b = hex_byte(request + 5 + 2 * i);
        if (b < 0) { close_pair(s); return 1; }
        message[14 + i] = (unsigned char)b;
    }
    size_t m = 30 + strlen(party);
    memcpy(message + 30, party, strlen(party));
    unsigned int digest = 0;
    memcpy(answer, "MPCH", 4);
    HMAC(EVP_sha256(), hello_key, sizeof hello_key, message, m, answer + 4, &digest);
    if (write(s->fd, answer, 4 + digest) < 0) { /* the prober left: nothing to do */ }
    close_pair(s);
    return 1;
}

static Side *new_side(int fd, int hello);
static void set_options(int fd);

/* brpc's side of an inbound connection, once its first bytes are not a hello; -1 if brpc
   does not listen yet (the peer retries). */
static int open_backend(Side *in) {
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    if (connect(fd, (struct sockaddr *)&backend, sizeof backend)) {
        close(fd);
        return -1;
    }
    set_options(fd);
    Side *out = new_side(fd, 0);
    in->peer = out;
    out->peer = in;
    struct epoll_event e = {.events = EPOLLIN | EPOLLOUT | EPOLLET, .data.ptr = out};
    epoll_ctl(ep, EPOLL_CTL_ADD, fd, &e);
    return 0;
}

/* Move what `src` has to its peer until either side would block. */
static void pump(Side *src) {
    if (src->fd < 0) return;
    if (src->hello) {
        char head[4];
        ssize_t n = recv(src->fd, head, 4, MSG_PEEK);
        if (n == 0) { close_pair(src); return; }
        if (n < 4) return;
        if (memcmp(head, "MPCH", 4) == 0) {
            answer_hello(src);     /* answered and closed, or waiting for the rest */
            return;
        }
        src->hello = 0;
        if (open_backend(src)) { close_pair(src); return; }
    }
    Side *dst = src->peer;
    if (!dst || dst->fd < 0) return;
    for (;;) {
        while (dst->off < dst->len) {
            ssize_t n = write(dst->fd, dst->pending + dst->off, dst->len - dst->off);
            if (n < 0) {
                if (errno != EAGAIN) close_pair(dst);
                return;
            }
            dst->off += (size_t)n;
        }
        ssize_t n = read(src->fd, dst->pending, CHUNK);
        if (n == 0 || (n < 0 && errno != EAGAIN)) { close_pair(src); return; }
        if (n < 0) return;
        reads++;
        dst->len = (size_t)n;
        dst->off = 0;
    }
}

static Side *new_side(int fd, int hello) {
    Side *s = calloc(1, sizeof *s);
    s->fd = fd;
    s->hello = hello;
    s->pending = malloc(CHUNK);
    return s;
}

int main(int argc, char **argv) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);     /* never outlive the party that started it */
    char host[256], key_hex[65], private_dir[96];
    const char *port_at = argc == 2 ? strstr(argv[1], "\"listen_port\": ") : NULL;
    if (!port_at || json_string(argv[1], "listen_host", host, sizeof host)
        || json_string(argv[1], "party", party, sizeof party)
        || json_string(argv[1], "hello_key", key_hex, sizeof key_hex) || strlen(key_hex) != 64
        || json_string(argv[1], "private_dir", private_dir, sizeof private_dir))
        return fail("usage: bare_relay FRONT_SPEC_JSON (listen_host, listen_port, party, "
                    "hello_key, private_dir)");
    for (int i = 0; i < 32; i++) {
        int b = hex_byte(key_hex + 2 * i);
        if (b < 0) return fail("hello_key is not hex");
        hello_key[i] = (unsigned char)b;
    }
    char port[16];
    snprintf(port, sizeof port, "%ld", strtol(port_at + 15, NULL, 10));
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *ai;
    if (getaddrinfo(host, port, &hints, &ai)) return fail("cannot resolve listen_host");
    int listener = socket(ai->ai_family, SOCK_STREAM, 0), one = 1;
    setsockopt(listener, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(listener, ai->ai_addr, ai->ai_addrlen) || listen(listener, 128)) {
        printf("{\"error\": \"%s:%s: %s\", \"kind\": \"%s\"}\n", host, port, strerror(errno),
               errno == EADDRINUSE ? "address in use" : "cannot listen");
        return 2;
    }
    freeaddrinfo(ai);
    set_options(listener);
    /* brpc's socket in the party's private directory (front_state.FrontSpec.backend_path). */
    snprintf(backend.sun_path, sizeof backend.sun_path, "%s/brpc.sock", private_dir);
    printf("{\"ready\": true, \"backend\": \"%s\", \"outbound\": {}}\n", backend.sun_path);
    fflush(stdout);

    ep = epoll_create1(0);
    Side listening = {.fd = listener}, control = {.fd = 0};
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = &listening}, events[64];
    epoll_ctl(ep, EPOLL_CTL_ADD, listener, &ev);
    ev.data.ptr = &control;
    epoll_ctl(ep, EPOLL_CTL_ADD, 0, &ev);
    for (;;) {
        int n = epoll_wait(ep, events, 64, -1);
        for (int i = 0; i < n; i++) {
            Side *s = events[i].data.ptr;
            if (s == &listening) {
                int fd = accept(listener, NULL, NULL);
                if (fd < 0) continue;
                set_options(fd);
                struct epoll_event e = {.events = EPOLLIN | EPOLLOUT | EPOLLET,
                                        .data.ptr = new_side(fd, 1)};
                epoll_ctl(ep, EPOLL_CTL_ADD, fd, &e);
            } else if (s == &control) {
                char line[256];
                ssize_t got = read(0, line, sizeof line - 1);
                if (got <= 0) { epoll_ctl(ep, EPOLL_CTL_DEL, 0, NULL); continue; }
                line[got] = 0;
                if (strstr(line, "stats")) {
                    struct timespec t;
                    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
                    printf("{\"frames\": %ld, \"bytes\": 0, \"max_message\": 0, "
                           "\"most_unread\": 0, \"cpu_s\": %.4f}\n",
                           reads, t.tv_sec + t.tv_nsec * 1e-9);
                    fflush(stdout);
                }
            } else {
                /* Closed pairs keep their memory: a benchmark run opens a handful. */
                if (events[i].events & EPOLLIN) pump(s);
                if ((events[i].events & EPOLLOUT) && s->peer) pump(s->peer);
            }
        }
    }
}
