/* The front door of a party in plain TCP, in C: the same checks as front.py, for less CPU.

   front.py is the front. For a node config without TLS, without outbound relaying and without
   shaping (every party on loopback), and when this program is built, front.py binds the
   public port, announces, and then executes this program in its place, passing the bound
   socket and the spec. Everything else (TLS, outbound sides, shaping, IP-less hosts) stays in
   front.py. Why: on a 2-core machine where three parties already use nearly both cores, the
   Python front's CPU per relayed frame (about twice that of a relay in C, most of it the
   interpreter) is wall time of every decode step.

   The rules, the messages and the events are the Python front's (rules.py's docstring;
   frames.parse_frame, read_fields, parse_hello; rules.check_push; front_state.Front), and
   tests/test_distributed.py runs every plain-TCP
   fault case and a differential fuzz of forged frames against both. Plain TCP has no outbound
   side, so there is no unread window here (max_unread_messages is 0 in front_state.Front as
   well).
   Nothing a peer sends becomes anything but integers and byte ranges, each bounds-checked.

   One thread per connection reads the peer's frames into its buffer, checks each whole frame
   and writes the checked frames to brpc's Unix socket in the party's private directory
   (opened with the first frame that passes; store and forward: at most one frame of
   max_frame_bytes is held); a second thread copies brpc's replies back. A frame that breaks a
   rule is not relayed: the frames before it are, then both connections are closed and the
   event is printed and appended to the events file naming the peer (or, when the fault is
   another connection's, no node).

   Connections as front.py counts them (Front.admit): at most MAX_CONNECTIONS in all and
   MAX_PER_SOURCE from one source address, a new one over a cap closing the oldest connection
   of that scope without a hello (else refused); a connection's hello within the deadline of
   its start, every later frame within the deadline of its first byte (the socket's receive
   timeout never reaches past it); the unfinished messages in one book
   (rules.UnfinishedBook: each connection's own budget, cleared when it closes; a total); a
   message number that comes back under another key is a forged message (rules.FORGED).

   Usage (by front.py only; --check in place of LISTEN_FD: see check_mode): fast_front
       LISTEN_FD BACKEND_SOCKET PARTY RANK LINK_ID HELLO_KEY_HEX MAX_FRAME MAX_MESSAGE
       MAX_BUFFERED EVENTS_PATH DEADLINE_MS MAX_CONNECTIONS MAX_PER_SOURCE
       [PEER_NODE PEER_RANK]...
   (fast_front.fast_front_args). stdin: "cap N" and "stats" lines as front.py reads them.
   Build: scripts/build_fast_front.py (cc -O2 -pthread ... -lcrypto), run by scripts/setup.sh. */
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
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#define HEADER_BYTES 12
#define FORGED 2                /* *anonymous: a forged message (rules.FORGED events) */
#define MAX_META_BYTES 4096
#define MAX_KEY_BYTES 512
#define MAX_UNFINISHED_MESSAGES 64
#define READ_BYTES (64 << 10)
#define HELLO_BYTES 41          /* "MPCH " + 32 hex digits + "\r\n\r\n" */
#define MAX_PEERS 64
#define WHY_BYTES 1024
#define SEEN_SLOTS 4096
#define FLOOD_EVENTS_PER_S 20
#define FLOOD_SOURCES 4096

static const char PUSH_SERVICE[] = "org.interconnection.link.ReceiverService";
static const char PUSH_METHOD[] = "Push";
static unsigned char push_meta_prefix[64];
static size_t push_meta_prefix_len;

/* A message a peer rank delivered (front_state.Front.seen): its sequence number, key, where. */
typedef struct {
    unsigned __int128 seq;          /* 0: empty; up to 20 digits */
    unsigned char key[MAX_KEY_BYTES];
    size_t key_len;
    char label[180];
} Seen;

typedef struct {
    char node[72];
    uint64_t rank;
    Seen *seen;                     /* SEEN_SLOTS, by seq mod SEEN_SLOTS */
} Peer;

/* One connection to the public port (front._Inbound). Its fields after `address` are read
   and written under `lock`. */
typedef struct Connection {
    int peer_fd, backend_fd;
    char address[96];               /* "host:port" */
    char source[INET6_ADDRSTRLEN];  /* host */
    uint64_t serial;                /* order of arrival */
    struct timespec started;        /* accepted */
    Peer *peer;                     /* the node it is bound to (its first frame) */
    int introduced;                 /* its hello (a whole first frame) has arrived */
    int evicted;                    /* closed for a newer connection (no longer counted) */
    uint64_t count, bytes;          /* the unfinished messages it is charged for */
} Connection;

/* rules.Unfinished: a chunked message the worker holds a buffer for, by (rank, key). */
typedef struct {
    uint64_t rank;
    unsigned char key[MAX_KEY_BYTES];
    size_t key_len;
    uint64_t length, got;
    Connection *owner;              /* NULL: left by a connection that closed */
    char left_by[180];
} Unfinished;

static struct {
    const char *party, *events_path;
    uint64_t rank;
    const unsigned char *link_id;
    size_t link_len;
    unsigned char hello_key[32];
    uint64_t max_frame, max_buffered, deadline_ms, max_connections, max_per_source;
    struct sockaddr_un backend;
    Peer peers[MAX_PEERS];
    int n_peers;
} cfg;

/* rules.UnfinishedBook: every connection's unfinished messages, in order of arrival. */
static Unfinished *book;
static int book_n, book_max;
static uint64_t book_bytes;

/* The open connections (front_state.Front.open), evicted ones until their thread has left. */
static Connection **table;
static size_t table_size;
static uint64_t n_open, n_serial;

/* Guards the book, the table, the connections' shared fields, the stats, max_message and the
   events file. */
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static uint64_t max_message, stat_frames, stat_bytes, stat_max_message;

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

/* The event front_state.Front.event writes: one stderr line, one JSON line in the events file
   (with "source" and "connections": n when given). Takes `lock`. */
static void event_count(const char *kind, const char *address, const char *node,
                        const char *why, const char *source, uint64_t connections) {
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
        if (source) {
            fputs(", \"source\": ", f);
            put_json_string(f, source);
        }
        if (connections) fprintf(f, ", \"connections\": %" PRIu64, connections);
        fputs("}\n", f);
        fclose(f);
    }
    pthread_mutex_unlock(&lock);
}

static void event(const char *kind, const char *address, const char *node, const char *why) {
    event_count(kind, address, node, why, NULL, 0);
}

/* ----- protobuf reading (frames.read_varint, frames.read_fields) -------------------------- */

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

/* ----- one frame (frames.parse_frame, rules.check_push) ---------------------------------- */

typedef struct {
    size_t frame_bytes;
    uint64_t rank, chunk_bytes, length, offset;
    int chunked, has_seq;
    unsigned __int128 seq;          /* frames.sequence_number: up to 20 digits */
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
    if (seq_at < key_len) {       /* frames.sequence_number(...) != 0 */
        const unsigned char *s = key + seq_at + 2;
        size_t n = key_len - seq_at - 2;
        int digits = n > 0 && n <= 20, any = 0;
        for (size_t i = 0; i < n && digits; i++) {
            if (s[i] < '0' || s[i] > '9') digits = 0;
            else if (s[i] != '0') any = 1;
        }
        p->has_seq = digits && any;
        for (size_t i = 0; i < n && p->has_seq; i++) p->seq = p->seq * 10 + (s[i] - '0');
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

/* ConnLedger.label(): "host:port (node)", or "host:port" before the connection is bound. */
static void put_label(Text *t, const Connection *c) {
    if (c->peer) put(t, "%s (%s)", c->address, c->peer->node);
    else put(t, "%s", c->address);
}

/* UnfinishedBook._charge: the connection's own caps; -1 and `why`. Under `lock`. */
static int charge(const Connection *c, uint64_t length, Text *why) {
    if (c->count >= MAX_UNFINISHED_MESSAGES) {
        put(why, "%" PRIu64 " unfinished chunked messages in flight on this connection, over "
                 "the per-connection cap of %d", c->count + 1, MAX_UNFINISHED_MESSAGES);
        return -1;
    }
    if (c->bytes + length > cfg.max_buffered) {
        put(why, "unfinished messages of ");
        put_count(why, c->bytes + length);
        put(why, " bytes in flight on this connection, over the per-connection cap of ");
        put_count(why, cfg.max_buffered);
        return -1;
    }
    return 0;
}

/* UnfinishedBook._holder: the label holding the most declared bytes (the first of a tie),
   its bytes and messages, and whether it is `c`. Under `lock`. */
static void put_holder(Text *why, const Connection *c, int *is_c) {
    Text best = {0};
    uint64_t best_bytes = 0, best_count = 0;
    int best_is_c = 0, found = 0;
    for (int i = 0; i < book_n; i++) {
        Text label = {0};
        if (book[i].owner) put_label(&label, book[i].owner);
        else put(&label, "%s, closed", book[i].left_by);
        int seen = 0;           /* counted with an earlier entry of the same label */
        for (int j = 0; j < i && !seen; j++) {
            Text other = {0};
            if (book[j].owner) put_label(&other, book[j].owner);
            else put(&other, "%s, closed", book[j].left_by);
            seen = !strcmp(other.text, label.text);
        }
        if (seen) continue;
        uint64_t nbytes = 0, count = 0;
        Connection *owner = book[i].owner;
        for (int j = i; j < book_n; j++) {
            Text other = {0};
            if (book[j].owner) put_label(&other, book[j].owner);
            else put(&other, "%s, closed", book[j].left_by);
            if (!strcmp(other.text, label.text)) { nbytes += book[j].length; count++; }
        }
        if (!found || nbytes > best_bytes) {
            found = 1;
            best = label;
            best_bytes = nbytes;
            best_count = count;
            best_is_c = owner == c;
        }
    }
    put(why, "the most, ");
    put_count(why, best_bytes);
    put(why, " bytes in %" PRIu64 ", from %s", best_count, best.text);
    *is_c = best_is_c;
}

/* UnfinishedBook.chunk: -1 and `why` (*anonymous: the connection is not the one holding the
   most); 0. Under `lock`. */
static int book_chunk(Connection *c, uint64_t rank, const Push *p, Text *why, int *anonymous) {
    Unfinished *entry = NULL;
    int at = -1;
    for (int i = 0; i < book_n; i++) {
        Unfinished *u = &book[i];
        if (u->rank == rank && u->key_len == p->key_len && !memcmp(u->key, p->key, p->key_len)) {
            entry = u;
            at = i;
            break;
        }
    }
    if (!entry) {
        if (charge(c, p->length, why)) return -1;
        uint64_t max_bytes = cfg.max_buffered * (uint64_t)(cfg.n_peers + 1);
        if (book_n >= book_max || book_bytes + p->length > max_bytes) {
            put(why, "%d unfinished chunked messages (", book_n + 1);
            put_count(why, book_bytes + p->length);
            put(why, " bytes) at this party, over its total of %d messages / ", book_max);
            put_count(why, max_bytes);
            put(why, " bytes for all connections together; ");
            int is_c = 0;
            put_holder(why, c, &is_c);
            *anonymous = !is_c;
            return -1;
        }
        at = book_n++;
        entry = &book[at];
        entry->rank = rank;
        memcpy(entry->key, p->key, p->key_len);
        entry->key_len = p->key_len;
        entry->length = p->length;
        entry->got = 0;
        entry->owner = c;
        entry->left_by[0] = 0;
        c->count++;
        c->bytes += p->length;
        book_bytes += p->length;
    } else if (entry->length != p->length) {
        put(why, "a chunk restating its message's length as ");
        put_count(why, p->length);
        put(why, " (first ");
        put_count(why, entry->length);
        put(why, ")");
        return -1;
    } else if (!entry->owner) {          /* a message a closed connection left: resumed */
        if (charge(c, p->length, why)) return -1;
        entry->owner = c;
        c->count++;
        c->bytes += p->length;
    }
    entry->got += p->chunk_bytes;
    if (entry->got > p->length) {
        put(why, "chunks adding up to ");
        put_count(why, entry->got);
        put(why, " bytes, over their message's declared ");
        put_count(why, p->length);
        return -1;
    }
    if (entry->got < p->length) return 0;
    book_bytes -= entry->length;
    if (entry->owner) {
        entry->owner->count--;
        entry->owner->bytes -= entry->length;
    }
    memmove(entry, entry + 1, (size_t)(book_n-- - at - 1) * sizeof *entry);
    return 0;
}

/* UnfinishedBook.close: `c` closed; its messages stay unfinished, charged to no connection.
   Under `lock`. */
static void book_close(Connection *c) {
    Text label = {0};
    put_label(&label, c);
    for (int i = 0; i < book_n; i++)
        if (book[i].owner == c) {
            book[i].owner = NULL;
            snprintf(book[i].left_by, sizeof book[i].left_by, "%.179s", label.text);
        }
    c->count = c->bytes = 0;
}

/* Python's str() of a sequence number of up to 20 digits. */
static void put_seq(Text *t, unsigned __int128 v) {
    char digits[48];
    int n = 0;
    do {
        digits[n++] = (char)('0' + (int)(v % 10));
        v /= 10;
    } while (v);
    while (n) put(t, "%c", digits[--n]);
}

/* A key of this run's link (not yacl's connection test, ACK or FIN). */
static int link_key(const Push *p) {
    const unsigned char *k = p->key;
    size_t n = p->key_len;
    if (n > 8 && n <= 12 && !memcmp(k, "connect_", 8) && all_digits(k + 8, n - 8)) return 0;
    return !(n == 3 && (!memcmp(k, "ACK", 3) || !memcmp(k, "FIN", 3)));
}

/* front_state.Front.note_seq: -1 and `why` when the message's number came under another key. */
static int note_seq(Connection *c, Peer *peer, const Push *p, Text *why) {
    pthread_mutex_lock(&lock);
    Seen *before = &peer->seen[(size_t)(p->seq % SEEN_SLOTS)];
    int failed = 0;
    if (before->seq == p->seq
        && (before->key_len != p->key_len || memcmp(before->key, p->key, p->key_len))) {
        put(why, "message ");
        put_seq(why, p->seq);
        put(why, " of rank %" PRIu64 " under the key ", peer->rank);
        put_key(why, p);
        put(why, " on ");
        put_label(why, c);
        put(why, ", after it came under the key ");
        put_repr(why, before->key, before->key_len < 80 ? before->key_len : 80);
        put(why, " on %s: two connections claim rank %" PRIu64 ", and yacl keeps the first",
            before->label, peer->rank);
        failed = -1;
    } else if (before->seq != p->seq) {
        Text label = {0};
        put_label(&label, c);
        before->seq = p->seq;
        memcpy(before->key, p->key, p->key_len);
        before->key_len = p->key_len;
        snprintf(before->label, sizeof before->label, "%.179s", label.text);
    }
    pthread_mutex_unlock(&lock);
    return failed;
}

/* rules.check_push for a frame from `peer` on `c` (max_unread = 0); takes `lock`. */
static int check_push(const Push *p, Peer *peer, Connection *c, Text *why, int *anonymous) {
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
    failed = book_chunk(c, bound, p, why, anonymous);
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

/* The whole frames at buf[0:filled] of connection `c` (c->peer: the node it is bound to,
   NULL until its first frame binds it) -> the bytes of those that pass (*at), and -1 with
   `why` at the first that does not, *anonymous when the event is to name no node (FORGED:
   of that kind) (front_state.Front.check_frames). */
static int check_frames(const unsigned char *buf, size_t filled, Connection *c, size_t *at,
                        Text *why, int *anonymous) {
    *at = 0;
    for (;;) {
        Push p;
        int got = parse_frame(buf + *at, filled - *at, &p, why);
        if (got == 0) return 0;
        if (got > 0 && !c->peer) {
            Peer *peer = peer_of_rank(p.rank);
            if (!peer) {
                put(why, "a Push claiming sender rank %" PRIu64 ", which is not a peer of "
                         "this party (rank %" PRIu64 "; peers [", p.rank, cfg.rank);
                for (int i = 0; i < cfg.n_peers; i++)   /* sorted at start-up */
                    put(why, "%s%" PRIu64, i ? ", " : "", cfg.peers[i].rank);
                put(why, "])");
                got = -1;
            } else {
                pthread_mutex_lock(&lock);
                c->peer = peer;
                pthread_mutex_unlock(&lock);
            }
        }
        if (got > 0 && check_push(&p, c->peer, c, why, anonymous)) got = -1;
        if (got > 0 && p.has_seq && link_key(&p) && note_seq(c, c->peer, &p, why)) {
            *anonymous = FORGED;
            got = -1;
        }
        if (got < 0) return -1;
        *at += p.frame_bytes;
        uint64_t size_of_message = p.chunked ? p.length : p.chunk_bytes;
        pthread_mutex_lock(&lock);
        stat_frames++;
        if (size_of_message > stat_max_message) stat_max_message = size_of_message;
        pthread_mutex_unlock(&lock);
    }
}

/* ----- the open connections (front_state.Front.admit, forget, close_without_hello) -------- */

static double seconds_since(const struct timespec *since) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)(now.tv_sec - since->tv_sec) + (now.tv_nsec - since->tv_nsec) * 1e-9;
}

/* Events about connections closed without a hello, at most FLOOD_EVENTS_PER_S lines per source
   address and second; the others are counted in one line at the end of that second (the
   `flusher` thread). */
static struct {
    char source[INET6_ADDRSTRLEN];
    struct timespec window;
    uint64_t lines, suppressed;
} floods[FLOOD_SOURCES];
static int n_floods;

static void note_without_hello(const char *source, const char *address, const char *node,
                               const char *why) {
    pthread_mutex_lock(&lock);
    int at = -1;
    for (int i = 0; i < n_floods && at < 0; i++)
        if (!strcmp(floods[i].source, source)) at = i;
    if (at < 0) {
        if (n_floods >= FLOOD_SOURCES) n_floods = 0;
        at = n_floods++;
        snprintf(floods[at].source, sizeof floods[at].source, "%s", source);
        clock_gettime(CLOCK_MONOTONIC, &floods[at].window);
        floods[at].lines = floods[at].suppressed = 0;
    }
    if (seconds_since(&floods[at].window) >= 1.0) {
        clock_gettime(CLOCK_MONOTONIC, &floods[at].window);
        floods[at].lines = 0;
    }
    int log = floods[at].lines < FLOOD_EVENTS_PER_S;
    if (log) floods[at].lines++;
    else floods[at].suppressed++;
    pthread_mutex_unlock(&lock);
    if (log) event_count("closed a connection without a hello", address, node, why, source, 1);
}

/* front_state.Front.flush_flood, for every source whose second is over. */
static void *flusher(void *arg) {
    (void)arg;
    for (;;) {
        struct timespec pause = {0, 100 * 1000 * 1000};
        nanosleep(&pause, NULL);
        for (int i = 0;; i++) {
            char source[INET6_ADDRSTRLEN];
            uint64_t n = 0;
            pthread_mutex_lock(&lock);
            if (i >= n_floods) {
                pthread_mutex_unlock(&lock);
                break;
            }
            if (floods[i].suppressed && seconds_since(&floods[i].window) >= 1.0) {
                n = floods[i].suppressed;
                floods[i].suppressed = 0;
                memcpy(source, floods[i].source, sizeof source);
            }
            pthread_mutex_unlock(&lock);
            if (n) {
                Text why = {0};
                put(&why, "%" PRIu64 " more connections from %s closed without a hello within a "
                          "second (not logged one by one)", n, source);
                event_count("closed a connection without a hello", source, NULL, why.text,
                            source, n);
            }
        }
    }
    return NULL;
}

/* Under `lock`: the oldest connection without a hello (of `source`, or any with NULL). */
static Connection *oldest_waiting(const char *source) {
    Connection *best = NULL;
    for (size_t i = 0; i < table_size; i++) {
        Connection *c = table[i];
        if (!c || c->evicted || c->introduced || (source && strcmp(c->source, source))) continue;
        if (!best || c->serial < best->serial) best = c;
    }
    return best;
}

static uint64_t open_from(const char *source) {
    uint64_t n = 0;
    for (size_t i = 0; i < table_size; i++)
        if (table[i] && !table[i]->evicted && !strcmp(table[i]->source, source)) n++;
    return n;
}

/* A connection closed for a newer one: what its event needs, copied under `lock`. */
typedef struct {
    char source[INET6_ADDRSTRLEN], address[96], node[72];
    int has_node;
    Text why;
} Evicted;

/* Under `lock`: close `v` for a newer connection; it no longer counts, nor do its unfinished
   messages (its thread leaves the table when its read returns). */
static void evict(Connection *v, Evicted *e) {
    snprintf(e->source, sizeof e->source, "%s", v->source);
    snprintf(e->address, sizeof e->address, "%s", v->address);
    e->has_node = v->peer != NULL;
    if (v->peer) snprintf(e->node, sizeof e->node, "%s", v->peer->node);
    v->evicted = 1;
    n_open--;
    book_close(v);
    shutdown(v->peer_fd, SHUT_RDWR);
}

/* front_state.Front.admit: count `c`, closing the oldest connection without a hello of a full
   scope for it -> 0, or -1 (refused, with an event). */
static int admit(Connection *c) {
    Evicted gone[2];
    int n_gone = 0, ok = 1;
    Text refused = {0};
    pthread_mutex_lock(&lock);
    uint64_t mine = open_from(c->source);
    if (mine >= cfg.max_per_source) {
        Connection *v = oldest_waiting(c->source);
        if (!v) {
            put(&refused, "%s has %" PRIu64 " connections open, each past its hello (at most %"
                PRIu64 " per source address)", c->source, mine, cfg.max_per_source);
            ok = 0;
        } else {
            Evicted *e = &gone[n_gone++];
            memset(&e->why, 0, sizeof e->why);
            put(&e->why, "closed for a newer connection: the oldest without a hello of the %"
                PRIu64 " connections open from %s (at most %" PRIu64 " per source address)",
                mine, c->source, cfg.max_per_source);
            evict(v, e);
        }
    }
    if (ok && n_open >= cfg.max_connections) {
        Connection *v = oldest_waiting(NULL);
        if (!v) {
            put(&refused, "%" PRIu64 " connections are open, each past its hello (at most %"
                PRIu64 " in all)", n_open, cfg.max_connections);
            ok = 0;
        } else {
            Evicted *e = &gone[n_gone++];
            memset(&e->why, 0, sizeof e->why);
            put(&e->why, "closed for a newer connection: the oldest without a hello of the %"
                PRIu64 " connections open (at most %" PRIu64 " in all)", n_open,
                cfg.max_connections);
            evict(v, e);
        }
    }
    if (ok) {
        size_t slot = table_size;
        for (size_t i = 0; i < table_size && slot == table_size; i++)
            if (!table[i]) slot = i;
        if (slot == table_size) {       /* closed ones whose threads have not left yet */
            put(&refused, "%zu connections are still closing", table_size);
            ok = 0;
        } else {
            c->serial = ++n_serial;
            table[slot] = c;
            n_open++;
        }
    }
    pthread_mutex_unlock(&lock);
    for (int i = 0; i < n_gone; i++)
        note_without_hello(gone[i].source, gone[i].address,
                           gone[i].has_node ? gone[i].node : NULL, gone[i].why.text);
    if (!ok) event("refused a connection", c->address, NULL, refused.text);
    return ok ? 0 : -1;
}

/* Under `lock`: `c`'s thread leaves (front_state.Front.forget). */
static void forget(Connection *c) {
    for (size_t i = 0; i < table_size; i++)
        if (table[i] == c) table[i] = NULL;
    if (!c->evicted) n_open--;
    book_close(c);
}

/* ----- one connection --------------------------------------------------------------------- */

/* The socket's receive timeout (0: none); *current: the one set. Rounded down to a quarter of a
   second, so that the reads of one frame (and of frames in a row) seldom need a new one. */
static void receive_timeout(int fd, double seconds, double *current) {
    if (seconds > 0) seconds = seconds < 0.001 ? 0.001 : seconds < 0.25 ? seconds
                                : (double)(long)(seconds * 4) / 4;
    if (seconds == *current) return;
    struct timeval t = {(time_t)seconds, (suseconds_t)((seconds - (double)(time_t)seconds) * 1e6)};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &t, sizeof t);
    *current = seconds;
}

static int open_backend(Connection *c, pthread_t *reply_thread) {
    c->backend_fd = socket(AF_UNIX, SOCK_STREAM, 0);
    if (c->backend_fd < 0 || connect(c->backend_fd, (struct sockaddr *)&cfg.backend,
                                     sizeof cfg.backend))
        return -1;                   /* brpc not up yet: the peer retries */
    return pthread_create(reply_thread, NULL, replies, c) ? -1 : 0;
}

/* One connection: the hello, or checked frames relayed to brpc (opened with the first one),
   each whole within the deadline; returns when either side closes, a rule breaks or a
   deadline passes. */
static void *serve(void *arg) {
    Connection *c = arg;
    size_t size = READ_BYTES, filled = 0, max_size = HEADER_BYTES + cfg.max_frame + READ_BYTES;
    unsigned char *buf = malloc(size);
    int mode = 0, introduced = 0, timed_out = 0, replying = 0;
    double deadline = (double)cfg.deadline_ms / 1000.0, timeout = 0;
    struct timespec since = c->started;         /* the frame (or hello) being read began */
    pthread_t reply_thread;
    while (buf) {
        /* Reading a frame (or the hello): the receive timeout never reaches past its
           deadline. Between frames a timeout left from before may wake the read: the clock,
           not the timeout, decides (below). */
        int in_frame = !introduced || filled > 0;
        if (in_frame) {
            double left = deadline - seconds_since(&since);
            if (left <= 0) { timed_out = 1; break; }
            if (timeout == 0 || timeout > left) receive_timeout(c->peer_fd, left, &timeout);
        }
        if (size - filled < READ_BYTES / 2 && size < max_size) {
            size_t grown = size * 2 < max_size ? size * 2 : max_size;
            unsigned char *bigger = realloc(buf, grown);
            if (!bigger) break;
            buf = bigger;
            size = grown;
        }
        ssize_t n = read(c->peer_fd, buf + filled, size - filled);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            if (!in_frame) receive_timeout(c->peer_fd, 0, &timeout);    /* idle: none */
            else if (seconds_since(&since) < deadline)
                receive_timeout(c->peer_fd, deadline - seconds_since(&since), &timeout);
            continue;           /* the deadline is checked before the next read */
        }
        if (n <= 0) break;
        if (!in_frame) clock_gettime(CLOCK_MONOTONIC, &since);
        filled += (size_t)n;
        if (mode == 0) {
            size_t head = filled < 4 ? filled : 4;
            int brpc = !memcmp(buf, "PRPC", head), mpch = !memcmp(buf, "MPCH", head);
            if (!brpc && !mpch) { refuse_first_bytes(c, buf, head); break; }
            if (head < 4) continue;
            mode = brpc ? 2 : 1;
        }
        if (mode == 1) {
            if (filled < HELLO_BYTES) continue;
            pthread_mutex_lock(&lock);
            c->introduced = 1;
            pthread_mutex_unlock(&lock);
            answer_hello(c, buf);
            break;
        }
        size_t at;
        int anonymous = 0;
        Text why = {0};
        int bad = check_frames(buf, filled, c, &at, &why, &anonymous) < 0;
        if (at) {
            if (!replying) {
                if (open_backend(c, &reply_thread)) break;
                replying = 1;
            }
            pthread_mutex_lock(&lock);
            stat_bytes += at;
            c->introduced = introduced = 1;
            pthread_mutex_unlock(&lock);
            if (write_all(c->backend_fd, buf, at)) break;
        }
        if (bad) {
            event(anonymous == FORGED ? "dropped a forged message and closed the connection"
                                      : "dropped a frame and closed the connection",
                  c->address, c->peer && !anonymous ? c->peer->node : NULL, why.text);
            struct linger now = {1, 0};     /* like asyncio's abort(): no lingering */
            setsockopt(c->peer_fd, SOL_SOCKET, SO_LINGER, &now, sizeof now);
            break;
        }
        memmove(buf, buf + at, filled - at);
        filled -= at;
        if (at && filled) clock_gettime(CLOCK_MONOTONIC, &since);   /* the next frame began */
    }
    if (timed_out) {
        pthread_mutex_lock(&lock);
        int evicted = c->evicted;
        pthread_mutex_unlock(&lock);
        Text why = {0};
        if (evicted) {
            /* closed for a newer connection: said so then */
        } else if (!introduced) {
            put(&why, "no hello within %g s of its start (%zu bytes received)", deadline, filled);
            note_without_hello(c->source, c->address, c->peer ? c->peer->node : NULL, why.text);
        } else {
            put(&why, "a frame not whole within %g s of its first byte (", deadline);
            put_count(&why, filled);
            put(&why, " bytes of it arrived)");
            event("closed a slow connection", c->address, c->peer ? c->peer->node : NULL,
                  why.text);
            struct linger now = {1, 0};
            setsockopt(c->peer_fd, SOL_SOCKET, SO_LINGER, &now, sizeof now);
        }
    }
    free(buf);
    if (c->backend_fd >= 0) shutdown(c->backend_fd, SHUT_RDWR);   /* brpc gets the end */
    shutdown(c->peer_fd, SHUT_RDWR);
    if (replying) pthread_join(reply_thread, NULL);
    pthread_mutex_lock(&lock);
    forget(c);
    pthread_mutex_unlock(&lock);
    close(c->peer_fd);
    if (c->backend_fd >= 0) close(c->backend_fd);
    free(c);
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
   length and the bytes one new connection ("case N", from 0) sends, which then closes; per
   case one line on stdout, "<bytes that pass> waits" or "<bytes that pass> error: <why>"
   ("error: (anonymous) <why>" when the event would name no node, "(forged) " for a forged
   message's). The book of unfinished
   messages persists across cases (a closed connection's stay in it). */
static int check_mode(void) {
    unsigned char size[4];
    for (int serial = 0; fread(size, 1, 4, stdin) == 4; serial++) {
        size_t n = ((size_t)size[0] << 24) | ((size_t)size[1] << 16) | ((size_t)size[2] << 8)
                   | size[3];
        unsigned char *buf = malloc(n ? n : 1);
        if (!buf || fread(buf, 1, n, stdin) != n) { free(buf); return 2; }
        Connection c = {.peer_fd = -1, .backend_fd = -1, .source = "?"};
        snprintf(c.address, sizeof c.address, "case %d", serial);   /* its ConnLedger's */
        size_t at;
        int anonymous = 0;
        Text why = {0};
        if (check_frames(buf, n, &c, &at, &why, &anonymous) < 0)
            printf("%zu error: %s%s\n", at, anonymous == FORGED ? "(forged) " : anonymous
                   ? "(anonymous) " : "", why.text);
        else printf("%zu waits\n", at);
        fflush(stdout);
        pthread_mutex_lock(&lock);
        book_close(&c);
        pthread_mutex_unlock(&lock);
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

#define FIXED_ARGS 14

int main(int argc, char **argv) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);       /* never outlive the party's worker */
    signal(SIGPIPE, SIG_IGN);
    uint64_t listen_fd = 0, max_msg;
    if (argc < FIXED_ARGS || (argc - FIXED_ARGS) % 2 || (argc - FIXED_ARGS) / 2 > MAX_PEERS)
        return usage("wrong number of arguments");
    int checking = !strcmp(argv[1], "--check");
    if ((!checking && parse_count(argv[1], &listen_fd)) || parse_count(argv[4], &cfg.rank)
        || parse_count(argv[7], &cfg.max_frame) || parse_count(argv[8], &max_msg)
        || parse_count(argv[9], &cfg.max_buffered) || parse_count(argv[11], &cfg.deadline_ms)
        || parse_count(argv[12], &cfg.max_connections)
        || parse_count(argv[13], &cfg.max_per_source))
        return usage("a number argument is not a number");
    if (strlen(argv[2]) >= sizeof cfg.backend.sun_path)
        return usage("the backend socket's path is too long");
    if (!cfg.deadline_ms || !cfg.max_connections || !cfg.max_per_source
        || cfg.max_connections > 4096)
        return usage("the deadline and the connection caps must be above 0 (at most 4096 "
                     "connections)");
    cfg.backend.sun_family = AF_UNIX;
    strcpy(cfg.backend.sun_path, argv[2]);
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
    for (int i = FIXED_ARGS; i < argc; i += 2) {
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
    for (int i = 0; i < cfg.n_peers; i++)
        if (!(cfg.peers[i].seen = calloc(SEEN_SLOTS, sizeof(Seen)))) return usage("out of memory");
    book_max = MAX_UNFINISHED_MESSAGES * (cfg.n_peers + 1);
    book = calloc((size_t)book_max, sizeof *book);
    table_size = 2 * cfg.max_connections + 16;
    table = calloc(table_size, sizeof *table);
    if (!book || !table) return usage("out of memory");
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
    if (checking) return check_mode();

    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 256 << 10);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_t thread;
    if (pthread_create(&thread, &attr, control, NULL) || pthread_create(&thread, &attr, flusher, NULL))
        return usage("cannot start a thread");
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
        clock_gettime(CLOCK_MONOTONIC, &c->started);
        int port = 0;
        snprintf(c->source, sizeof c->source, "?");
        if (from.ss_family == AF_INET) {
            struct sockaddr_in *a = (struct sockaddr_in *)&from;
            inet_ntop(AF_INET, &a->sin_addr, c->source, sizeof c->source);
            port = ntohs(a->sin_port);
        } else if (from.ss_family == AF_INET6) {
            struct sockaddr_in6 *a = (struct sockaddr_in6 *)&from;
            inet_ntop(AF_INET6, &a->sin6_addr, c->source, sizeof c->source);
            port = ntohs(a->sin6_port);
        }
        snprintf(c->address, sizeof c->address, "%s:%d", c->source, port);
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        if (admit(c)) {
            close(fd);
            free(c);
            continue;
        }
        if (pthread_create(&thread, &attr, serve, c)) {
            pthread_mutex_lock(&lock);
            forget(c);
            pthread_mutex_unlock(&lock);
            close(fd);
            free(c);
        }
    }
}
