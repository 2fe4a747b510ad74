/* The front door of a party in plain TCP, in C: the same checks as front.py, for less CPU.

   front.py is the front. For a node config without TLS, without outbound relaying and without
   shaping (every party on loopback), and when this program is built, front.py binds the
   public port, announces, and then executes this program in its place, passing the bound
   socket and the spec. Everything else (TLS, outbound sides, shaping, IP-less hosts) stays in
   front.py. Why: on a 2-core machine where three parties already use nearly both cores, the
   Python front's CPU per relayed frame (about twice that of a relay in C, most of it the
   interpreter) is wall time of every decode step.

   The rules, the messages and the events are front.py's (its module docstring; parse_frame,
   read_fields, check_push, parse_hello), and tests/test_distributed.py runs every plain-TCP
   fault case and a differential fuzz of forged frames against both. Plain TCP has no outbound
   side, so there is no unread window here (max_unread_messages is 0 in front.py as well).
   Nothing a peer sends becomes anything but integers and byte ranges, each bounds-checked.

   One thread per connection reads the peer's frames into its buffer, checks each whole frame
   and writes the checked frames to brpc (store and forward: at most one frame of
   max_frame_bytes is held); a second thread copies brpc's replies back. A frame that breaks a
   rule is not relayed: the frames before it are, then both connections are closed and the
   event is printed and appended to the events file naming the peer.

   Where it differs: it serves at most MAX_CONNECTIONS connections at once (front.py has no
   bound; a thread each here) and refuses more with an event, and a connection that has not
   shown its first bytes (and a hello's rest) within FIRST_BYTES_S is closed, so that idle
   connections cannot hold every slot.

   Usage (by front.py only; --check in place of LISTEN_FD: see check_mode): fast_front
       LISTEN_FD BACKEND_PORT PARTY RANK LINK_ID HELLO_KEY_HEX
       MAX_FRAME MAX_MESSAGE MAX_BUFFERED EVENTS_PATH [PEER_NODE PEER_RANK]...
   stdin: "cap N" and "stats" lines as front.py reads them.
   Build: front.build_fast_front (cc -O2 -pthread ... -lcrypto), run by scripts/setup.sh. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define HEADER_BYTES 12
#define MAX_META_BYTES 4096
#define MAX_KEY_BYTES 512
#define MAX_UNFINISHED_MESSAGES 64
#define READ_BYTES (64 << 10)
#define HELLO_BYTES 41          /* "MPCH " + 32 hex digits + "\r\n\r\n" */
#define MAX_PEERS 64
#define MAX_CONNECTIONS 256     /* two descriptors each, within the usual limit of 1024 */
#define WHY_BYTES 1024
#define FIRST_BYTES_S 10

static const char PUSH_SERVICE[] = "org.interconnection.link.ReceiverService";
static const char PUSH_METHOD[] = "Push";
static unsigned char push_meta_prefix[64];
static size_t push_meta_prefix_len;

typedef struct {
    unsigned char key[MAX_KEY_BYTES];
    size_t key_len;
    uint64_t length, got;
} Unfinished;

typedef struct {
    char node[72];
    uint64_t rank;
    Unfinished unfinished[MAX_UNFINISHED_MESSAGES];
    int n_unfinished;
} Peer;

static struct {
    const char *party, *events_path;
    uint64_t rank;
    const unsigned char *link_id;
    size_t link_len;
    unsigned char hello_key[32];
    uint64_t max_frame, max_buffered;
    struct sockaddr_in backend;
    Peer peers[MAX_PEERS];
    int n_peers;
} cfg;

/* Guards the peers' ledgers, the stats, max_message and the events file. */
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static uint64_t max_message, stat_frames, stat_bytes, stat_max_message;
static int open_connections;

/* ----- text as front.py writes it --------------------------------------------------------- */

typedef struct {
    char text[WHY_BYTES];
    size_t len;
} Text;

static void put(Text *t, const char *format, ...) {
    if (t->len >= sizeof t->text - 1) return;
    va_list args;
    va_start(args, format);
    int n = vsnprintf(t->text + t->len, sizeof t->text - t->len, format, args);
    va_end(args);
    if (n > 0) t->len += (size_t)n;
    if (t->len > sizeof t->text - 1) t->len = sizeof t->text - 1;
}

/* Python's f"{n:,}". */
static void put_count(Text *t, uint64_t n) {
    char digits[32], grouped[48];
    int len = snprintf(digits, sizeof digits, "%" PRIu64, n), k = 0;
    for (int i = 0; i < len; i++) {
        if (i && (len - i) % 3 == 0) grouped[k++] = ',';
        grouped[k++] = digits[i];
    }
    grouped[k] = 0;
    put(t, "%s", grouped);
}

/* Python's repr() of bytes. */
static void put_repr(Text *t, const unsigned char *b, size_t n) {
    int single = memchr(b, '\'', n) != NULL, dbl = memchr(b, '"', n) != NULL;
    char quote = single && !dbl ? '"' : '\'';
    put(t, "b%c", quote);
    for (size_t i = 0; i < n; i++) {
        unsigned char c = b[i];
        if (c == (unsigned char)quote || c == '\\') put(t, "\\%c", c);
        else if (c == '\t') put(t, "\\t");
        else if (c == '\n') put(t, "\\n");
        else if (c == '\r') put(t, "\\r");
        else if (c < 0x20 || c >= 0x7f) put(t, "\\x%02x", c);
        else put(t, "%c", c);
    }
    put(t, "%c", quote);
}

static void put_json_string(FILE *f, const char *s) {
    fputc('"', f);
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') fprintf(f, "\\%c", c);
        else if (c < 0x20) fprintf(f, "\\u%04x", c);
        else fputc(c, f);
    }
    fputc('"', f);
}

/* The event front.Front.event writes: one stderr line, one JSON line in the events file. */
static void event(const char *kind, const char *address, const char *node, const char *why) {
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    pthread_mutex_lock(&lock);
    if (node) fprintf(stderr, "[party %s] front: %s from %s (%s): %s\n", cfg.party, kind, node,
                      address, why);
    else fprintf(stderr, "[party %s] front: %s from %s: %s\n", cfg.party, kind, address, why);
    fflush(stderr);
    FILE *f = fopen(cfg.events_path, "a");
    if (f) {
        fprintf(f, "{\"t\": %.6f, \"kind\": ", now.tv_sec + now.tv_nsec * 1e-9);
        put_json_string(f, kind);
        fputs(", \"address\": ", f);
        put_json_string(f, address);
        fputs(", \"node\": ", f);
        if (node) put_json_string(f, node);
        else fputs("null", f);
        fputs(", \"why\": ", f);
        put_json_string(f, why);
        fputs("}\n", f);
        fclose(f);
    }
    pthread_mutex_unlock(&lock);
}

/* ----- protobuf reading (front.read_varint, front.read_fields) ---------------------------- */

typedef struct {
    int present, wire;
    uint64_t value;         /* varint or fixed */
    size_t at, len;         /* length-delimited: where in the buffer */
} Field;

typedef struct {
    Field f[16];            /* field numbers below 16; others are only noted */
    int has_other;
    uint64_t min_other;     /* the smallest number of 16 or more */
} Fields;

/* -1 and `why` on an error. */
static int read_varint(const unsigned char *b, size_t *i, size_t end, uint64_t *value, Text *why) {
    uint64_t v = 0;
    for (int k = 0; k < 10; k++) {
        if (*i >= end) { put(why, "a protobuf varint runs past its field"); return -1; }
        unsigned char byte = b[(*i)++];
        uint64_t bits = (uint64_t)(byte & 0x7F);
        if (k == 9 && bits > 1) { /* would be bit 64 or above */
            if (!(byte & 0x80)) { put(why, "a protobuf varint over 64 bits"); return -1; }
        }
        if (k < 9 || bits <= 1) v |= bits << (7 * k);
        if (!(byte & 0x80)) { *value = v; return 0; }
    }
    put(why, "a protobuf varint is longer than 10 bytes");
    return -1;
}

static int read_fields(const unsigned char *b, size_t i, size_t end, Fields *out, Text *why) {
    memset(out, 0, sizeof *out);
    while (i < end) {
        uint64_t key, value = 0;
        size_t at = 0, len = 0;
        if (read_varint(b, &i, end, &key, why)) return -1;
        uint64_t number = key >> 3;
        int wire = (int)(key & 7);
        if (wire == 0) {
            if (read_varint(b, &i, end, &value, why)) return -1;
        } else if (wire == 2) {
            uint64_t n;
            if (read_varint(b, &i, end, &n, why)) return -1;
            if (n > end - i) {
                put(why, "protobuf field %" PRIu64 " declares %" PRIu64 " bytes, %zu remain",
                    number, n, end - i);
                return -1;
            }
            at = i;
            len = (size_t)n;
            i += len;
        } else if (wire == 1 || wire == 5) {
            size_t n = wire == 1 ? 8 : 4;
            if (n > end - i) {
                put(why, "protobuf field %" PRIu64 " is cut short", number);
                return -1;
            }
            for (size_t k = 0; k < n; k++) value |= (uint64_t)b[i + k] << (8 * k);
            i += n;
        } else {
            put(why, "protobuf field %" PRIu64 " has wire type %d", number, wire);
            return -1;
        }
        if (number < 16) {
            Field *f = &out->f[number];
            if (f->present) {
                put(why, "protobuf field %" PRIu64 " appears twice in one message", number);
                return -1;
            }
            *f = (Field){1, wire, value, at, len};
        } else if (!out->has_other || number < out->min_other) {
            out->has_other = 1;
            out->min_other = number;
        }
    }
    return 0;
}

static int is_int(const Field *f) { return f->present && f->wire != 2; }
static int is_bytes(const Field *f) { return f->present && f->wire == 2; }
/* Python's `fields.get(n, 0) != 0`: absent is 0; bytes are never 0. */
static int nonzero(const Field *f) { return f->present && (f->wire == 2 || f->value != 0); }

static int bytes_equal(const unsigned char *b, const Field *f, const char *s) {
    return f->len == strlen(s) && memcmp(b + f->at, s, f->len) == 0;
}

/* ----- one frame (front.parse_frame, front.check_push) ------------------------------------ */

typedef struct {
    size_t frame_bytes;
    uint64_t rank, chunk_bytes, length, offset;
    int chunked, has_seq;
    const unsigned char *key;
    size_t key_len;
} Push;

/* The frame at b[0:have] -> 1 and `p`, 0 if more bytes are needed, -1 and `why`. */
static int parse_frame(const unsigned char *b, size_t have, Push *p, Text *why) {
    size_t head = have < 4 ? have : 4;      /* the magic as far as it has arrived */
    if (memcmp(b, "PRPC", head)) {
        put(why, "bytes that are not a brpc frame (starts ");
        put_repr(why, b, head);
        put(why, ")");
        return -1;
    }
    if (have < HEADER_BYTES) return 0;
    uint64_t body = ((uint64_t)b[4] << 24) | ((uint64_t)b[5] << 16) | ((uint64_t)b[6] << 8) | b[7];
    uint64_t meta = ((uint64_t)b[8] << 24) | ((uint64_t)b[9] << 16) | ((uint64_t)b[10] << 8) | b[11];
    if (body > cfg.max_frame) {
        put(why, "a frame of ");
        put_count(why, body);
        put(why, " bytes (the link sends at most ");
        put_count(why, cfg.max_frame);
        put(why, ")");
        return -1;
    }
    if (meta > (body < MAX_META_BYTES ? body : MAX_META_BYTES)) {
        put(why, "a frame whose meta of ");
        put_count(why, meta);
        put(why, " bytes does not fit (body ");
        put_count(why, body);
        put(why, ", at most %d)", MAX_META_BYTES);
        return -1;
    }
    if (have < HEADER_BYTES + body) return 0;
    size_t start = HEADER_BYTES, meta_end = HEADER_BYTES + meta, end = HEADER_BYTES + body;
    Fields rpc, req, push, chunk;
    if (meta >= push_meta_prefix_len && !memcmp(b + start, push_meta_prefix, push_meta_prefix_len)) {
        if (read_fields(b, start + push_meta_prefix_len, meta_end, &rpc, why)) return -1;
        if (rpc.f[1].present) {
            put(why, "protobuf field 1 appears twice in one message (a brpc meta with a second "
                     "request)");
            return -1;
        }
        rpc.f[1].present = 1;      /* the prefix's request, for the field list below */
        rpc.f[1].wire = 2;
    } else {
        if (read_fields(b, start, meta_end, &rpc, why)) return -1;
        if (!is_bytes(&rpc.f[1])) { put(why, "a brpc frame that is not a request"); return -1; }
        if (read_fields(b, rpc.f[1].at, rpc.f[1].at + rpc.f[1].len, &req, why)) return -1;
        if (!is_bytes(&req.f[1]) || !bytes_equal(b, &req.f[1], PUSH_SERVICE)
            || !is_bytes(&req.f[2]) || !bytes_equal(b, &req.f[2], PUSH_METHOD)) {
            put(why, "a brpc request for another service than ReceiverService.Push");
            return -1;
        }
    }
    if (nonzero(&rpc.f[3]) || nonzero(&rpc.f[5])) {
        put(why, "a compressed brpc frame or one with an attachment");
        return -1;
    }
    for (int n = 0; n < 16 || rpc.has_other; n++) {
        uint64_t number = n < 16 ? (uint64_t)n : rpc.min_other;
        int allowed = number == 1 || number == 3 || number == 4 || number == 5;
        if ((n >= 16 || rpc.f[n].present) && !allowed) {
            put(why, "a brpc meta with field %" PRIu64 ", which a plain Push request does not "
                     "have (a response, chunk, authentication, stream or user fields)", number);
            return -1;
        }
        if (n >= 16) break;
    }
    if (read_fields(b, meta_end, end, &push, why)) return -1;
    if ((push.f[1].present && push.f[1].wire == 2) || !is_bytes(&push.f[2])
        || push.f[2].len > MAX_KEY_BYTES) {
        put(why, "a Push without a sender rank or with a key over %d bytes", MAX_KEY_BYTES);
        return -1;
    }
    memset(p, 0, sizeof *p);
    p->frame_bytes = end;
    p->rank = push.f[1].present ? push.f[1].value : 0;
    const unsigned char *key = b + push.f[2].at;
    size_t key_len = push.f[2].len, seq_at = key_len;
    for (size_t i = 0; i + 1 < key_len; i++)
        if (key[i] == 1 && key[i + 1] == 2) { seq_at = i; break; }
    p->key = key;
    p->key_len = seq_at;
    if (seq_at < key_len) {       /* front.sequence_number(...) != 0 */
        const unsigned char *s = key + seq_at + 2;
        size_t n = key_len - seq_at - 2;
        int digits = n > 0 && n <= 20, any = 0;
        for (size_t i = 0; i < n && digits; i++) {
            if (s[i] < '0' || s[i] > '9') digits = 0;
            else if (s[i] != '0') any = 1;
        }
        p->has_seq = digits && any;
    }
    p->chunk_bytes = is_bytes(&push.f[3]) ? push.f[3].len : 0;
    if (is_int(&push.f[4]) && push.f[4].value == 1) {
        if (!is_bytes(&push.f[5])) { put(why, "a chunked Push without chunk info"); return -1; }
        if (read_fields(b, push.f[5].at, push.f[5].at + push.f[5].len, &chunk, why)) return -1;
        if ((chunk.f[1].present && chunk.f[1].wire == 2)
            || (chunk.f[2].present && chunk.f[2].wire == 2)) {
            put(why, "a chunked Push whose chunk info is not two integers");
            return -1;
        }
        p->chunked = 1;
        p->length = chunk.f[1].present ? chunk.f[1].value : 0;
        p->offset = chunk.f[2].present ? chunk.f[2].value : 0;
    }
    return 1;
}

static int all_digits(const unsigned char *s, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (s[i] < '0' || s[i] > '9') return 0;
    return 1;
}

static uint64_t decimal(const unsigned char *s, size_t n) {
    uint64_t v = 0;
    for (size_t i = 0; i < n; i++) v = v * 10 + (uint64_t)(s[i] - '0');
    return v;
}

static void put_key(Text *t, const Push *p) {
    put_repr(t, p->key, p->key_len < 80 ? p->key_len : 80);
}

/* "<what> <size> bytes, over the cap of <cap> (...)": a message or a chunked one's length. */
static void put_over_cap(Text *t, const char *what, uint64_t size, uint64_t cap) {
    put(t, "%s", what);
    put_count(t, size);
    put(t, " bytes, over the cap of ");
    put_count(t, cap);
    put(t, " (the largest the job's programs receive)");
}

/* front.check_push for a frame from `peer` (max_unread = 0); takes `lock` for the ledger. */
static int check_push(const Push *p, Peer *peer, Text *why) {
    uint64_t bound = peer->rank, mine = cfg.rank, src, dst;
    if (p->rank != bound) {
        put(why, "a Push claiming sender rank %" PRIu64 " on a connection of rank %" PRIu64,
            p->rank, bound);
        return -1;
    }
    const unsigned char *k = p->key;
    size_t n = p->key_len;
    if (n > 8 && n <= 12 && !memcmp(k, "connect_", 8) && all_digits(k + 8, n - 8)) {
        src = decimal(k + 8, n - 8);
        dst = mine;
    } else if ((n == 3 && !memcmp(k, "ACK", 3)) || (n == 3 && !memcmp(k, "FIN", 3))) {
        src = bound;
        dst = mine;
    } else {
        if (!(n > cfg.link_len && !memcmp(k, cfg.link_id, cfg.link_len)
              && (k[cfg.link_len] == ':' || k[cfg.link_len] == '-'))) {
            put(why, "a Push under the key ");
            put_key(why, p);
            put(why, ", not a key of this run's link '%s'", (const char *)cfg.link_id);
            return -1;
        }
        if (!p->has_seq) {
            put(why, "a Push under the key ");
            put_key(why, p);
            put(why, " without a sequence number");
            return -1;
        }
        size_t last = 0;           /* after the last ':' */
        for (size_t i = 0; i < n; i++)
            if (k[i] == ':') last = i + 1;
        const unsigned char *tail = k + last;
        size_t tail_len = n - last, arrow = tail_len;
        for (size_t i = 0; i + 1 < tail_len; i++)
            if (tail[i] == '-' && tail[i + 1] == '>') { arrow = i; break; }
        size_t dst_len = arrow < tail_len ? tail_len - arrow - 2 : 0;
        if (arrow < tail_len && arrow > 0 && arrow <= 4 && dst_len > 0 && dst_len <= 4
            && all_digits(tail, arrow) && all_digits(tail + arrow + 2, dst_len)) {
            src = decimal(tail, arrow);
            dst = decimal(tail + arrow + 2, dst_len);
        } else {
            src = bound;
            dst = mine;
        }
    }
    if (src != bound || dst != mine) {
        put(why, "a Push under the key ");
        put_key(why, p);
        put(why, " (%" PRIu64 "->%" PRIu64 ") on a connection from rank %" PRIu64
                 " to this party (rank %" PRIu64 ")", src, dst, bound, mine);
        return -1;
    }
    pthread_mutex_lock(&lock);
    uint64_t cap = max_message;
    int failed = -1;
    if (!p->chunked) {
        if (p->chunk_bytes > cap) put_over_cap(why, "a message of ", p->chunk_bytes, cap);
        else failed = 0;
        goto done;
    }
    if (p->length > cap) {
        put_over_cap(why, "a chunked message declaring ", p->length, cap);
        goto done;
    }
    if (p->offset > p->length || p->chunk_bytes > p->length - p->offset) {
        put(why, "a chunk at offset ");
        put_count(why, p->offset);
        put(why, " of ");
        put_count(why, p->chunk_bytes);
        put(why, " bytes that does not fit its message of ");
        put_count(why, p->length);
        put(why, " bytes");
        goto done;
    }
    Unfinished *entry = NULL;
    int at = -1;
    for (int i = 0; i < peer->n_unfinished; i++) {
        Unfinished *u = &peer->unfinished[i];
        if (u->key_len == p->key_len && !memcmp(u->key, p->key, p->key_len)) { entry = u; at = i; break; }
    }
    if (!entry) {
        if (peer->n_unfinished >= MAX_UNFINISHED_MESSAGES) {
            put(why, "%d unfinished chunked messages in flight, over the per-peer cap of %d",
                peer->n_unfinished + 1, MAX_UNFINISHED_MESSAGES);
            goto done;
        }
        uint64_t buffered = 0;
        for (int i = 0; i < peer->n_unfinished; i++) buffered += peer->unfinished[i].length;
        if (buffered + p->length > cfg.max_buffered) {
            put(why, "unfinished messages of ");
            put_count(why, buffered + p->length);
            put(why, " bytes in flight, over the per-peer cap of ");
            put_count(why, cfg.max_buffered);
            goto done;
        }
        at = peer->n_unfinished++;
        entry = &peer->unfinished[at];
        memcpy(entry->key, p->key, p->key_len);
        entry->key_len = p->key_len;
        entry->length = p->length;
        entry->got = 0;
    } else if (entry->length != p->length) {
        put(why, "a chunk restating its message's length as ");
        put_count(why, p->length);
        put(why, " (first ");
        put_count(why, entry->length);
        put(why, ")");
        goto done;
    }
    entry->got += p->chunk_bytes;
    if (entry->got > p->length) {
        put(why, "chunks adding up to ");
        put_count(why, entry->got);
        put(why, " bytes, over their message's declared ");
        put_count(why, p->length);
        goto done;
    }
    if (entry->got == p->length)      /* whole: forget it (keep the others in order) */
        memmove(entry, entry + 1, (size_t)(peer->n_unfinished-- - at - 1) * sizeof *entry);
    failed = 0;
done:
    pthread_mutex_unlock(&lock);
    return failed;
}

/* ----- connections ------------------------------------------------------------------------ */

static int write_all(int fd, const unsigned char *b, size_t n) {
    while (n) {
        ssize_t w = write(fd, b, n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return -1;
        b += w;
        n -= (size_t)w;
    }
    return 0;
}

typedef struct {
    int peer_fd, backend_fd;
    char address[96];
} Connection;

/* brpc's replies back to the peer, until either side closes. */
static void *replies(void *arg) {
    Connection *c = arg;
    unsigned char *buf = malloc(READ_BYTES);
    ssize_t n;
    while (buf && (n = read(c->backend_fd, buf, READ_BYTES)) != 0) {
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 || write_all(c->peer_fd, buf, (size_t)n)) break;
    }
    free(buf);
    shutdown(c->peer_fd, SHUT_RDWR);     /* wakes the reading thread */
    return NULL;
}

static Peer *peer_of_rank(uint64_t rank) {
    for (int i = 0; i < cfg.n_peers; i++)
        if (cfg.peers[i].rank == rank) return &cfg.peers[i];
    return NULL;
}

static void answer_hello(Connection *c, const unsigned char *request) {
    unsigned char message[14 + 16 + 72], answer[4 + EVP_MAX_MD_SIZE], nonce[16];
    Text why = {0};
    if (memcmp(request, "MPCH ", 5) || memcmp(request + 37, "\r\n\r\n", 4)) goto bad;
    for (int i = 0; i < 16; i++) {
        unsigned v = 0;
        for (int h = 0; h < 2; h++) {
            unsigned char ch = request[5 + 2 * i + h];
            int d = ch >= '0' && ch <= '9' ? ch - '0' : ch >= 'a' && ch <= 'f' ? ch - 'a' + 10
                    : ch >= 'A' && ch <= 'F' ? ch - 'A' + 10 : -1;
            if (d < 0) goto bad;
            v = v * 16 + (unsigned)d;
        }
        nonce[i] = (unsigned char)v;
    }
    size_t party_len = strlen(cfg.party);
    memcpy(message, "mpcache hello\0", 14);
    memcpy(message + 14, nonce, 16);
    memcpy(message + 30, cfg.party, party_len);
    unsigned int digest = 0;
    memcpy(answer, "MPCH", 4);
    HMAC(EVP_sha256(), cfg.hello_key, sizeof cfg.hello_key, message, 30 + party_len,
         answer + 4, &digest);
    write_all(c->peer_fd, answer, 4 + digest);
    return;
bad:
    put(&why, "a malformed hello");
    event("refused a connection", c->address, NULL, why.text);
}

static void refuse_first_bytes(Connection *c, const unsigned char *head, size_t n) {
    Text why = {0};
    put(&why, "its first bytes are neither brpc nor the hello (");
    put_repr(&why, head, n);
    put(&why, ")");
    event("refused a connection", c->address, NULL, why.text);
}

/* The whole frames at buf[0:filled] of a connection bound to *peer (NULL: not yet; the first
   frame binds it) -> the bytes of those that pass (*at), and -1 with `why` at the first that
   does not (front.Front.check_frames). */
static int check_frames(const unsigned char *buf, size_t filled, Peer **peer, size_t *at,
                        Text *why) {
    *at = 0;
    for (;;) {
        Push p;
        int got = parse_frame(buf + *at, filled - *at, &p, why);
        if (got == 0) return 0;
        if (got > 0 && !*peer) {
            *peer = peer_of_rank(p.rank);
            if (!*peer) {
                put(why, "a Push claiming sender rank %" PRIu64 ", which is not a peer of "
                         "this party (rank %" PRIu64 "; peers [", p.rank, cfg.rank);
                for (int i = 0; i < cfg.n_peers; i++)   /* sorted at start-up */
                    put(why, "%s%" PRIu64, i ? ", " : "", cfg.peers[i].rank);
                put(why, "])");
                got = -1;
            }
        }
        if (got > 0 && check_push(&p, *peer, why)) got = -1;
        if (got < 0) return -1;
        *at += p.frame_bytes;
        uint64_t size_of_message = p.chunked ? p.length : p.chunk_bytes;
        pthread_mutex_lock(&lock);
        stat_frames++;
        if (size_of_message > stat_max_message) stat_max_message = size_of_message;
        pthread_mutex_unlock(&lock);
    }
}

/* The peer's frames: checked, then relayed; returns when either side closes or a rule breaks. */
static void relay_frames(Connection *c, unsigned char *buf, size_t size, size_t filled) {
    size_t max_size = HEADER_BYTES + cfg.max_frame + READ_BYTES;
    Peer *peer = NULL;
    pthread_t reply_thread;
    c->backend_fd = socket(AF_INET, SOCK_STREAM, 0);
    if (c->backend_fd < 0 || connect(c->backend_fd, (struct sockaddr *)&cfg.backend,
                                     sizeof cfg.backend)) {
        free(buf);
        return;                      /* brpc not up yet: the peer retries */
    }
    int one = 1;
    setsockopt(c->backend_fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    struct timeval forever = {0, 0};        /* brpc connections idle between steps */
    setsockopt(c->peer_fd, SOL_SOCKET, SO_RCVTIMEO, &forever, sizeof forever);
    if (pthread_create(&reply_thread, NULL, replies, c)) {
        free(buf);
        return;
    }
    for (;;) {
        size_t at;
        Text why = {0};
        int bad = check_frames(buf, filled, &peer, &at, &why) < 0;
        if (at) {
            pthread_mutex_lock(&lock);
            stat_bytes += at;
            pthread_mutex_unlock(&lock);
            if (write_all(c->backend_fd, buf, at)) break;
        }
        if (bad) {
            event("dropped a frame and closed the connection", c->address,
                  peer ? peer->node : NULL, why.text);
            struct linger now = {1, 0};     /* like asyncio's abort(): no lingering */
            setsockopt(c->peer_fd, SOL_SOCKET, SO_LINGER, &now, sizeof now);
            break;
        }
        memmove(buf, buf + at, filled - at);
        filled -= at;
        if (size - filled < READ_BYTES / 2 && size < max_size) {
            size_t grown = size * 2 < max_size ? size * 2 : max_size;
            unsigned char *bigger = realloc(buf, grown);
            if (!bigger) break;
            buf = bigger;
            size = grown;
        }
        ssize_t n = read(c->peer_fd, buf + filled, size - filled);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) break;
        filled += (size_t)n;
    }
    free(buf);
    shutdown(c->backend_fd, SHUT_RDWR);     /* brpc still gets what was relayed, then the end */
    shutdown(c->peer_fd, SHUT_RDWR);
    pthread_join(reply_thread, NULL);
}

static void *serve(void *arg) {
    Connection *c = arg;
    size_t size = READ_BYTES, filled = 0;
    unsigned char *buf = malloc(size);
    int hello = 0;
    while (buf) {
        ssize_t n = read(c->peer_fd, buf + filled, size - filled);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) break;
        filled += (size_t)n;
        if (!hello) {
            size_t head = filled < 4 ? filled : 4;
            int brpc = !memcmp(buf, "PRPC", head), mpch = !memcmp(buf, "MPCH", head);
            if (!brpc && !mpch) { refuse_first_bytes(c, buf, head); break; }
            if (head < 4) continue;
            if (brpc) {
                relay_frames(c, buf, size, filled);
                buf = NULL;
                break;
            }
            hello = 1;
        }
        if (filled >= HELLO_BYTES) { answer_hello(c, buf); break; }
    }
    free(buf);
    close(c->peer_fd);
    if (c->backend_fd >= 0) close(c->backend_fd);
    free(c);
    pthread_mutex_lock(&lock);
    open_connections--;
    pthread_mutex_unlock(&lock);
    return NULL;
}

/* ----- start-up and control --------------------------------------------------------------- */

static void *control(void *arg) {
    (void)arg;
    char line[256];
    while (fgets(line, sizeof line, stdin)) {
        char first[16], second[64], third[2];
        int n = sscanf(line, "%15s %63s %1s", first, second, third);
        if (n == 2 && !strcmp(first, "cap") && all_digits((unsigned char *)second, strlen(second))) {
            uint64_t cap = strlen(second) > 19 ? UINT64_MAX : decimal((unsigned char *)second,
                                                                      strlen(second));
            pthread_mutex_lock(&lock);
            max_message = cap;
            pthread_mutex_unlock(&lock);
        } else if (n == 1 && !strcmp(first, "stats")) {
            struct timespec t;
            clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
            pthread_mutex_lock(&lock);
            printf("{\"frames\": %" PRIu64 ", \"bytes\": %" PRIu64 ", \"max_message\": %" PRIu64
                   ", \"most_unread\": 0, \"cpu_s\": %.4f}\n", stat_frames, stat_bytes,
                   stat_max_message, t.tv_sec + t.tv_nsec * 1e-9);
            fflush(stdout);
            pthread_mutex_unlock(&lock);
        }
    }
    return NULL;
}

/* For front.py's tests only (--check instead of LISTEN_FD): cases on stdin, each a u32 BE
   length and the bytes one new connection sends; per case one line on stdout, "<bytes that
   pass> waits" or "<bytes that pass> error: <why>". The peers' ledgers persist across cases,
   as across a peer's connections. */
static int check_mode(void) {
    unsigned char size[4];
    while (fread(size, 1, 4, stdin) == 4) {
        size_t n = ((size_t)size[0] << 24) | ((size_t)size[1] << 16) | ((size_t)size[2] << 8)
                   | size[3];
        unsigned char *buf = malloc(n ? n : 1);
        if (!buf || fread(buf, 1, n, stdin) != n) { free(buf); return 2; }
        Peer *peer = NULL;
        size_t at;
        Text why = {0};
        if (check_frames(buf, n, &peer, &at, &why) < 0) printf("%zu error: %s\n", at, why.text);
        else printf("%zu waits\n", at);
        fflush(stdout);
        free(buf);
    }
    return 0;
}

static int usage(const char *why) {
    fprintf(stderr, "fast_front: %s (it is started by front.py only)\n", why);
    return 2;
}

static int parse_count(const char *s, uint64_t *out) {
    if (!*s || !all_digits((const unsigned char *)s, strlen(s)) || strlen(s) > 19) return -1;
    *out = decimal((const unsigned char *)s, strlen(s));
    return 0;
}

int main(int argc, char **argv) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);       /* never outlive the party's worker */
    signal(SIGPIPE, SIG_IGN);
    uint64_t listen_fd = 0, backend_port, max_msg;
    if (argc < 11 || (argc - 11) % 2 || (argc - 11) / 2 > MAX_PEERS)
        return usage("wrong number of arguments");
    int checking = !strcmp(argv[1], "--check");
    if ((!checking && parse_count(argv[1], &listen_fd)) || parse_count(argv[2], &backend_port)
        || backend_port > 65535 || parse_count(argv[4], &cfg.rank)
        || parse_count(argv[7], &cfg.max_frame) || parse_count(argv[8], &max_msg)
        || parse_count(argv[9], &cfg.max_buffered))
        return usage("a number argument is not a number");
    cfg.party = argv[3];
    cfg.link_id = (const unsigned char *)argv[5];
    cfg.link_len = strlen(argv[5]);
    cfg.events_path = argv[10];
    max_message = max_msg;
    if (strlen(argv[6]) != 64) return usage("the hello key is not 64 hex digits");
    for (int i = 0; i < 32; i++) {
        unsigned v;
        if (sscanf(argv[6] + 2 * i, "%2x", &v) != 1) return usage("the hello key is not hex");
        cfg.hello_key[i] = (unsigned char)v;
    }
    if (strlen(cfg.party) > 64) return usage("the party id is too long");
    for (int i = 11; i < argc; i += 2) {
        Peer *p = &cfg.peers[cfg.n_peers++];
        if (strlen(argv[i]) >= sizeof p->node || parse_count(argv[i + 1], &p->rank))
            return usage("a peer is not NODE RANK");
        strcpy(p->node, argv[i]);
    }
    for (int i = 1; i < cfg.n_peers; i++)          /* ascending ranks, as front.py lists them */
        for (int j = i; j > 0 && cfg.peers[j - 1].rank > cfg.peers[j].rank; j--) {
            Peer t = cfg.peers[j];
            cfg.peers[j] = cfg.peers[j - 1];
            cfg.peers[j - 1] = t;
        }
    /* RpcMeta field 1 = {1: service, 2: method}, as brpc encodes yacl's Push. */
    size_t s = strlen(PUSH_SERVICE), m = strlen(PUSH_METHOD), k = 0;
    push_meta_prefix[k++] = 0x0a;
    push_meta_prefix[k++] = (unsigned char)(s + m + 4);
    push_meta_prefix[k++] = 0x0a;
    push_meta_prefix[k++] = (unsigned char)s;
    memcpy(push_meta_prefix + k, PUSH_SERVICE, s);
    k += s;
    push_meta_prefix[k++] = 0x12;
    push_meta_prefix[k++] = (unsigned char)m;
    memcpy(push_meta_prefix + k, PUSH_METHOD, m);
    push_meta_prefix_len = k + m;
    cfg.backend.sin_family = AF_INET;
    cfg.backend.sin_port = htons((uint16_t)backend_port);
    cfg.backend.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (checking) return check_mode();

    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 256 << 10);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_t thread;
    if (pthread_create(&thread, &attr, control, NULL)) return usage("cannot start a thread");
    for (;;) {
        struct sockaddr_storage from;
        socklen_t from_len = sizeof from;
        int fd = accept((int)listen_fd, (struct sockaddr *)&from, &from_len);
        if (fd < 0) {
            if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM)
                usleep(20000);          /* out of descriptors: wait for some to close */
            if (errno == EINTR || errno == ECONNABORTED || errno == EMFILE || errno == ENFILE
                || errno == ENOBUFS || errno == ENOMEM)
                continue;
            perror("fast_front: accept");
            return 3;
        }
        Connection *c = calloc(1, sizeof *c);
        if (!c) { close(fd); continue; }
        c->peer_fd = fd;
        c->backend_fd = -1;
        char host[INET6_ADDRSTRLEN] = "?";
        int port = 0;
        if (from.ss_family == AF_INET) {
            struct sockaddr_in *a = (struct sockaddr_in *)&from;
            inet_ntop(AF_INET, &a->sin_addr, host, sizeof host);
            port = ntohs(a->sin_port);
        } else if (from.ss_family == AF_INET6) {
            struct sockaddr_in6 *a = (struct sockaddr_in6 *)&from;
            inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof host);
            port = ntohs(a->sin6_port);
        }
        snprintf(c->address, sizeof c->address, "%s:%d", host, port);
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        struct timeval first_bytes = {FIRST_BYTES_S, 0};
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &first_bytes, sizeof first_bytes);
        pthread_mutex_lock(&lock);
        int too_many = open_connections >= MAX_CONNECTIONS;
        if (!too_many) open_connections++;
        pthread_mutex_unlock(&lock);
        if (too_many) {
            event("refused a connection", c->address, NULL,
                  "more open connections than the front serves at once");
            close(fd);
            free(c);
            continue;
        }
        if (pthread_create(&thread, &attr, serve, c)) {
            close(fd);
            free(c);
            pthread_mutex_lock(&lock);
            open_connections--;
            pthread_mutex_unlock(&lock);
        }
    }
}
