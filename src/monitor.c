/* monitor.c: rank 0's HTTP status endpoint on libmicrohttpd (monitor.h). The daemon runs its own
 * polling thread; every callback gets the monitor as its closure pointer. Requests build their
 * answer from a copy of the state taken under the mutex, so the training thread never waits for
 * more than that copy. */
#define _GNU_SOURCE
#include "monitor.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <microhttpd.h>
#include <netdb.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

enum {
  MEMORY_LIMIT = 16 * 1024, /* request line and headers of one connection (MHD answers 431 or 414 past it) */
  MAX_HEADERS = 64,
  MAX_CONNECTIONS = 32, /* served at once: a newcomer past them closes one (make_room) */
  MHD_CONNECTIONS = 64, /* libmicrohttpd's limit, past which it refuses: room for those being closed */
  IDLE_TIMEOUT_S = 5,
  MAX_HISTORY = 10000,        /* records per /history answer (limit) */
  HISTORY_BODY = 256 * 1024,  /* bytes of records per /history answer (but its first record, whatever its size) */
  HISTORY_SCAN = 1024 * 1024, /* bytes of metrics.jsonl one /history request reads */
  MAX_TOKEN = 4096,
  REPORT_BYTES = 64 * 1024 * 1024, /* bytes of metrics.jsonl that report.html inlines whole */
};

/* The dashboard's files, generated into the build by scripts/embed_dashboard.py from src/dashboard/
 * and Debian's Chart.js: the live page (GET /) and its three files, and report.html's text before
 * and after the run's JSON. Each _len bytes, NUL-terminated. */
extern const unsigned char dt_dash_page[], dt_dash_js[], dt_dash_css[], dt_dash_chart[], dt_dash_report_head[],
    dt_dash_report_tail[];
extern const unsigned long dt_dash_page_len, dt_dash_js_len, dt_dash_css_len, dt_dash_chart_len,
    dt_dash_report_head_len, dt_dash_report_tail_len;

/* Where a connection's request is; make_room closes one in the first stage first. */
enum { IN_HEADERS, WAITING, ANSWERING };

/* A connection, as the daemon's callbacks see it (they all run in its one thread: no lock). */
typedef struct {
  struct MHD_Connection *c; /* NULL: a free slot */
  int fd;
  int stage;     /* WAITING (accepted, or answered) for a request line; IN_HEADERS: the line has come,
                    not all its headers; ANSWERING: they have */
  int closing;   /* shut down for a newcomer; the daemon has yet to close it */
  double since;  /* dt_now() when its stage began */
  char path[16]; /* its request's path as sent, before percent-decoding; "" when longer than any endpoint's */
} conn_slot;

typedef struct {
  off_t offset;         /* of a record in metrics.jsonl */
  long long max_before; /* the largest step of the records before it (-1: none) */
} hist_mark;

struct dt_monitor {
  char listen[300]; /* as configured, for messages */
  char where[320];  /* the bound address with its port, "127.0.0.1:9400" */
  int fd;           /* the listening socket; the daemon's once it started */
  int family, loopback;
  char *token; /* NULL: no token file, POST is refused */
  size_t token_len;
  double stall_s;
  int checkpoints;
  char log_dir[1024];      /* log.dir: report.html goes there; "" none */
  char history_path[1100]; /* "" when log.dir is empty */
  /* /history's index of metrics.jsonl, under hist_mu (index_history) */
  pthread_mutex_t hist_mu;
  hist_mark *marks;
  int n_marks, cap_marks;
  off_t hist_indexed; /* bytes of whole lines indexed */
  long long hist_records, hist_max;
  struct MHD_Daemon *daemon;
  conn_slot conns[MHD_CONNECTIONS]; /* the daemon's thread only */
  /* the run (set before the daemon starts, read-only after) */
  char *config_path;
  char *model_summary, *data_path;
  uint64_t config_hash;
  int world;
  char **hosts, **devices;
  int64_t global_batch, rank_rows, grad_accum, epochs;
  char *auto_batch;
  char *optim_name;
  int zero;
  int64_t optim_state_bytes;
  char *teacher, *teacher_weights, *distill_loss; /* teacher "": no distillation */
  int64_t teacher_params;
  double temperature, alpha;
  pthread_mutex_t mu;
  /* under mu */
  int published;
  double t_publish; /* dt_now() of the last publish */
  dt_monitor_snapshot snap;
  double *rank_compute_ms; /* (world) */
  double *gpu;             /* (world x DT_MON_GPU_FIELDS) */
  int has_gpu;
  int requests; /* DT_MON_* bits */
  int waiting;  /* rank 0 is in a collective that has lasted a while */
  char wait_what[128], wait_missing[512];
  int64_t wait_step;
  double wait_since;
};

/* ---- text building (the HTTP thread; dt_realloc aborts on exhaustion) ---- */

typedef struct {
  char *p;
  size_t len, cap;
} sbuf;

static void sb_printf(sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_printf(sbuf *b, const char *fmt, ...) {
  for (;;) {
    size_t room = b->cap - b->len;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(b->p ? b->p + b->len : NULL, room, fmt, ap);
    va_end(ap);
    DT_ASSERT(n >= 0);
    if ((size_t)n < room) {
      b->len += (size_t)n;
      return;
    }
    b->cap = (b->len + (size_t)n + 1) * 2 > 1024 ? (b->len + (size_t)n + 1) * 2 : 1024;
    b->p = dt_realloc(b->p, b->cap);
  }
}

static void sb_append(sbuf *b, const char *s, size_t n) {
  if (b->len + n + 1 > b->cap) {
    b->cap = (b->len + n + 1) * 2;
    b->p = dt_realloc(b->p, b->cap);
  }
  memcpy(b->p + b->len, s, n);
  b->len += n;
  b->p[b->len] = 0;
}

/* A JSON string literal. */
static void sb_json_str(sbuf *b, const char *s) {
  sb_append(b, "\"", 1);
  for (const unsigned char *c = (const unsigned char *)s; *c; c++) {
    if (*c == '"' || *c == '\\')
      sb_printf(b, "\\%c", *c);
    else if (*c < 0x20)
      sb_printf(b, "\\u%04x", *c);
    else
      sb_append(b, (const char *)c, 1);
  }
  sb_append(b, "\"", 1);
}

/* A Prometheus label value: backslash, quote and newline escaped. */
static void sb_label(sbuf *b, const char *s) {
  for (const char *c = s; *c; c++) {
    if (*c == '"' || *c == '\\')
      sb_printf(b, "\\%c", *c);
    else if (*c == '\n')
      sb_append(b, "\\n", 2);
    else
      sb_append(b, c, 1);
  }
}

/* The shortest of %.15g..%.17g that reads back as v. */
static void fmt_num(char *buf, size_t cap, double v) {
  for (int prec = 15; prec <= 17; prec++) {
    snprintf(buf, cap, "%.*g", prec, v);
    if (strtod(buf, NULL) == v) return;
  }
}

/* A JSON number (null when not finite). */
static void sb_json_num(sbuf *b, double v) {
  char num[40] = "null";
  if (isfinite(v)) fmt_num(num, sizeof num, v);
  sb_printf(b, "%s", num);
}

/* ---- the token and the address (start-up) ---- */

/* "a FIFO", "a directory", ... for a path that is not a regular file. */
static const char *file_kind(mode_t m) {
  return S_ISFIFO(m)   ? "a FIFO"
         : S_ISDIR(m)  ? "a directory"
         : S_ISCHR(m)  ? "a character device"
         : S_ISBLK(m)  ? "a block device"
         : S_ISSOCK(m) ? "a socket"
                       : "not a regular file";
}

/* "its group", "others" or "its group and others": who else has group_bit or other_bit in m; NULL
 * for no one. */
static const char *who(mode_t m, mode_t group_bit, mode_t other_bit) {
  return (m & group_bit) && (m & other_bit) ? "its group and others"
         : m & group_bit                    ? "its group"
         : m & other_bit                    ? "others"
                                            : NULL;
}

/* The checks ssh makes of a private key, on the file as opened: a regular file (opened without
 * blocking, so that a FIFO cannot hang start-up), owned by this user or root, that no one else can
 * read or write. Symbolic links are followed: what is checked is what is read. */
static int check_token_file(const char *path, int fd, dt_status *st) {
  struct stat sb;
  if (fstat(fd, &sb))
    return dt_fail(st, DT_EXIT_INPUT, "monitor.token_file %s: cannot stat: %s", path, strerror(errno));
  if (!S_ISREG(sb.st_mode))
    return dt_fail(st, DT_EXIT_INPUT, "monitor.token_file %s is %s, not a regular file", path, file_kind(sb.st_mode));
  uid_t me = geteuid();
  if (sb.st_uid != me && sb.st_uid != 0)
    return dt_fail(st, DT_EXIT_INPUT,
                   "monitor.token_file %s is owned by uid %u, not by you (uid %u) or root: its owner could change the "
                   "token; use a file of your own",
                   path, (unsigned)sb.st_uid, (unsigned)me);
  const char *readers = who(sb.st_mode, S_IRGRP, S_IROTH), *writers = who(sb.st_mode, S_IWGRP, S_IWOTH);
  if (readers || writers)
    return dt_fail(st, DT_EXIT_INPUT,
                   "monitor.token_file %s is %s%s%s%s%s (mode %04o): the token must be a secret only you can read "
                   "and change; chmod 600 %s",
                   path, readers ? "readable by " : "", readers ? readers : "", readers && writers ? " and " : "",
                   writers ? "writable by " : "", writers ? writers : "", (unsigned)(sb.st_mode & 07777), path);
  return 0;
}

static int read_token(dt_monitor *mon, const char *path, dt_status *st) {
  int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  if (fd < 0) return dt_fail(st, DT_EXIT_INPUT, "monitor.token_file %s: cannot open: %s", path, strerror(errno));
  if (check_token_file(path, fd, st)) {
    close(fd);
    return st->code;
  }
  char *buf = dt_malloc(MAX_TOKEN + 2);
  size_t n = 0;
  for (;;) {
    ssize_t got = read(fd, buf + n, MAX_TOKEN + 1 - n);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) {
      int e = errno;
      close(fd);
      free(buf);
      return dt_fail(st, DT_EXIT_INPUT, "monitor.token_file %s: cannot read: %s", path, strerror(e));
    }
    if (got == 0 || (n += (size_t)got) > MAX_TOKEN) break;
  }
  if (close(fd)) {
    free(buf);
    return dt_fail(st, DT_EXIT_INPUT, "monitor.token_file %s: cannot close: %s", path, strerror(errno));
  }
  while (n && (buf[n - 1] == '\n' || buf[n - 1] == '\r' || buf[n - 1] == ' ' || buf[n - 1] == '\t')) n--;
  buf[n] = 0;
  const char *why = n == 0 ? "it is empty" : n > MAX_TOKEN ? "the token is longer than 4096 bytes" : NULL;
  for (size_t i = 0; i < n && !why; i++)
    if ((unsigned char)buf[i] <= 0x20 || (unsigned char)buf[i] >= 0x7f)
      why = "the token must be one line of printable characters without spaces";
  if (why) {
    free(buf);
    return dt_fail(st, DT_EXIT_INPUT, "monitor.token_file %s: %s", path, why);
  }
  mon->token = buf;
  mon->token_len = n;
  return 0;
}

/* "HOST:PORT" or "[V6]:PORT" into host and port. */
static int split_listen(const char *s, char *host, size_t hcap, char *port, size_t pcap) {
  const char *colon;
  size_t hl;
  if (s[0] == '[') {
    const char *close = strchr(s, ']');
    if (!close || close[1] != ':') return -1;
    hl = (size_t)(close - s - 1);
    s++;
    colon = close + 1;
  } else {
    colon = strrchr(s, ':');
    if (!colon || memchr(s, ':', (size_t)(colon - s))) return -1; /* an IPv6 host needs brackets */
    hl = (size_t)(colon - s);
  }
  const char *p = colon + 1;
  if (hl == 0 || hl >= hcap || !*p || strlen(p) >= pcap || strspn(p, "0123456789") != strlen(p) || strlen(p) > 5 ||
      atoi(p) > 65535)
    return -1;
  memcpy(host, s, hl);
  host[hl] = 0;
  snprintf(port, pcap, "%s", p);
  return 0;
}

static int is_loopback(const struct sockaddr *a) {
  if (a->sa_family == AF_INET) return (ntohl(((const struct sockaddr_in *)a)->sin_addr.s_addr) >> 24) == 127;
  if (a->sa_family == AF_INET6) {
    const struct in6_addr *x = &((const struct sockaddr_in6 *)a)->sin6_addr;
    return IN6_IS_ADDR_LOOPBACK(x) || (IN6_IS_ADDR_V4MAPPED(x) && x->s6_addr[12] == 127);
  }
  return 0;
}

/* Why no socket can listen on a, whatever the host; NULL when one may. Checked in --dry-run as in
 * a run, so that the dry run refuses what the run would fail to bind. */
static const char *unlistenable(const struct sockaddr *a) {
  if (a->sa_family == AF_INET) {
    in_addr_t x = ntohl(((const struct sockaddr_in *)a)->sin_addr.s_addr);
    if (IN_MULTICAST(x)) return "a multicast address cannot be listened on";
    if (x == INADDR_BROADCAST) return "the broadcast address cannot be listened on";
  } else if (a->sa_family == AF_INET6) {
    const struct sockaddr_in6 *x = (const struct sockaddr_in6 *)a;
    if (IN6_IS_ADDR_V4MAPPED(&x->sin6_addr))
      return "an IPv4-mapped IPv6 address cannot be listened on (the socket is IPv6 only); give the IPv4 address, "
             "as 127.0.0.1:PORT";
    if (IN6_IS_ADDR_MULTICAST(&x->sin6_addr)) return "a multicast address cannot be listened on";
    if (IN6_IS_ADDR_LINKLOCAL(&x->sin6_addr) && !x->sin6_scope_id)
      return "a link-local IPv6 address needs its interface, as [fe80::1%eth0]:PORT";
  }
  return NULL;
}

/* Resolves monitor.listen and checks that it is loopback or has a token; binds and listens when
 * bind_now, noting the bound address (its port when 0 was asked for) in mon->where. */
static int open_socket(dt_monitor *mon, int bind_now, dt_status *st) {
  char host[256], port[8];
  if (split_listen(mon->listen, host, sizeof host, port, sizeof port))
    return dt_fail(st, DT_EXIT_INPUT,
                   "monitor.listen '%s': expected HOST:PORT such as 127.0.0.1:9400 or [::1]:9400 (port 0-65535)",
                   mon->listen);
  struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_NUMERICSERV}, *res;
  int rc = getaddrinfo(host, port, &hints, &res);
  if (rc)
    return dt_fail(st, DT_EXIT_INPUT, "monitor.listen %s: cannot resolve '%s': %s", mon->listen, host,
                   rc == EAI_SYSTEM ? strerror(errno) : gai_strerror(rc));
  const char *why = unlistenable(res->ai_addr);
  if (why) {
    freeaddrinfo(res);
    return dt_fail(st, DT_EXIT_INPUT, "monitor.listen %s: %s", mon->listen, why);
  }
  mon->family = res->ai_family;
  mon->loopback = is_loopback(res->ai_addr);
  if (!mon->loopback && !mon->token) {
    freeaddrinfo(res);
    return dt_fail(st, DT_EXIT_INPUT,
                   "monitor.listen %s is not a loopback address: anyone who can reach it could stop the run, so it "
                   "needs monitor.token_file (a file only you can read, holding the token clients must send)",
                   mon->listen);
  }
  if (!bind_now) {
    freeaddrinfo(res);
    return 0;
  }
  const char *step = "socket";
  int one = 1, fd = socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd >= 0) step = "setsockopt";
  if (fd >= 0 && !setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) &&
      (res->ai_family != AF_INET6 || !setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &one, sizeof one))) {
    step = "bind";
    if (!bind(fd, res->ai_addr, res->ai_addrlen)) step = listen(fd, 64) ? "listen" : NULL;
  }
  freeaddrinfo(res);
  if (step) {
    int e = errno;
    if (fd >= 0) close(fd);
    if (e == EADDRINUSE)
      return dt_fail(st, DT_EXIT_INPUT,
                     "monitor.listen %s: the address is already in use (another run's monitor?); choose another port",
                     mon->listen);
    return dt_fail(st, DT_EXIT_INPUT, "monitor.listen %s: %s: %s", mon->listen, step, strerror(e));
  }
  struct sockaddr_storage bound;
  socklen_t blen = sizeof bound;
  char ip[INET6_ADDRSTRLEN] = "?";
  if (getsockname(fd, (struct sockaddr *)&bound, &blen)) {
    int e = errno;
    close(fd);
    return dt_fail(st, DT_EXIT_INPUT, "monitor.listen %s: getsockname: %s", mon->listen, strerror(e));
  }
  const void *raw = bound.ss_family == AF_INET6 ? (const void *)&((struct sockaddr_in6 *)&bound)->sin6_addr
                                                : (const void *)&((struct sockaddr_in *)&bound)->sin_addr;
  unsigned bport = ntohs(bound.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&bound)->sin6_port
                                                     : ((struct sockaddr_in *)&bound)->sin_port);
  if (!inet_ntop(bound.ss_family, raw, ip, sizeof ip)) snprintf(ip, sizeof ip, "%s", host);
  snprintf(mon->where, sizeof mon->where, bound.ss_family == AF_INET6 ? "[%s]:%u" : "%s:%u", ip, bport);
  mon->fd = fd;
  return 0;
}

dt_monitor *monitor_open(const dt_monitor_opts *o, int bind_now, dt_status *st) {
  dt_monitor *mon = dt_calloc(1, sizeof *mon);
  mon->fd = -1;
  dt_strlcpy(mon->listen, o->listen, sizeof mon->listen);
  mon->stall_s = o->stall_s;
  mon->checkpoints = o->checkpoints;
  dt_strlcpy(mon->log_dir, o->log_dir, sizeof mon->log_dir);
  if (o->log_dir[0]) snprintf(mon->history_path, sizeof mon->history_path, "%s/metrics.jsonl", o->log_dir);
  mon->hist_max = -1;
  int rc = pthread_mutex_init(&mon->mu, NULL), rc2 = rc ? rc : pthread_mutex_init(&mon->hist_mu, NULL);
  if (rc || rc2) dt_fail(st, DT_EXIT_INPUT, "monitor: pthread_mutex_init: %s", strerror(rc ? rc : rc2));
  if (!st->code && o->listen[0] && o->token_file[0]) read_token(mon, o->token_file, st);
  if (!st->code && o->listen[0]) open_socket(mon, bind_now, st);
  if (st->code || !bind_now) {
    if (!rc) pthread_mutex_destroy(&mon->mu);
    if (!rc && !rc2) pthread_mutex_destroy(&mon->hist_mu);
    if (mon->token) explicit_bzero(mon->token, mon->token_len);
    free(mon->token);
    free(mon);
    return NULL;
  }
  return mon;
}

/* ---- the state: the training thread writes, requests copy ---- */

static void lock(dt_monitor *mon) {
  int rc = pthread_mutex_lock(&mon->mu);
  if (rc) dt_abort(__FILE__, __LINE__, "pthread_mutex_lock failed");
}

static void unlock(dt_monitor *mon) {
  int rc = pthread_mutex_unlock(&mon->mu);
  if (rc) dt_abort(__FILE__, __LINE__, "pthread_mutex_unlock failed");
}

void monitor_publish(dt_monitor *mon, const dt_monitor_snapshot *s) {
  if (!mon) return;
  size_t w = (size_t)mon->world;
  lock(mon);
  mon->snap = *s;
  mon->snap.rank_compute_ms = mon->snap.gpu = NULL; /* borrowed: the copies below stand in */
  if (s->rank_compute_ms) memcpy(mon->rank_compute_ms, s->rank_compute_ms, w * sizeof(double));
  if (s->gpu) memcpy(mon->gpu, s->gpu, w * DT_MON_GPU_FIELDS * sizeof(double));
  mon->has_gpu = mon->has_gpu || s->gpu;
  mon->published = 1;
  mon->t_publish = dt_now();
  unlock(mon);
}

int monitor_take_requests(dt_monitor *mon) {
  if (!mon) return 0;
  lock(mon);
  int r = mon->requests;
  mon->requests = 0;
  unlock(mon);
  return r;
}

void monitor_note_wait(void *ctx, const char *what, int64_t step, double waited_s, const char *missing) {
  dt_monitor *mon = ctx;
  if (!mon) return;
  lock(mon);
  mon->waiting = what != NULL;
  if (what) {
    dt_strlcpy(mon->wait_what, what, sizeof mon->wait_what);
    dt_strlcpy(mon->wait_missing, missing, sizeof mon->wait_missing);
    mon->wait_step = step;
    mon->wait_since = dt_now() - waited_s;
  }
  unlock(mon);
}

/* What a request reads: a copy taken under the mutex. */
typedef struct {
  int published, has_gpu, waiting;
  double since_step; /* seconds since the last publish */
  dt_monitor_snapshot s;
  double *rank_compute_ms, *gpu; /* owned copies */
  char wait_what[128], wait_missing[512];
  int64_t wait_step;
  double wait_s;
} view;

static void take_view(dt_monitor *mon, view *v) {
  size_t w = (size_t)mon->world;
  v->rank_compute_ms = dt_malloc(w * sizeof(double));
  v->gpu = dt_malloc(w * DT_MON_GPU_FIELDS * sizeof(double));
  lock(mon);
  double now = dt_now();
  v->published = mon->published;
  v->has_gpu = mon->has_gpu;
  v->since_step = now - mon->t_publish;
  v->s = mon->snap;
  memcpy(v->rank_compute_ms, mon->rank_compute_ms, w * sizeof(double));
  memcpy(v->gpu, mon->gpu, w * DT_MON_GPU_FIELDS * sizeof(double));
  v->waiting = mon->waiting;
  memcpy(v->wait_what, mon->wait_what, sizeof v->wait_what);
  memcpy(v->wait_missing, mon->wait_missing, sizeof v->wait_missing);
  v->wait_step = mon->wait_step;
  v->wait_s = now - mon->wait_since;
  unlock(mon);
}

static void free_view(view *v) {
  free(v->rank_compute_ms);
  free(v->gpu);
}

static int stalled(const dt_monitor *mon, const view *v) {
  return v->published && v->since_step >= mon->stall_s;
}

/* Seconds to the last step at the pace so far; < 0 when unknown. */
static double eta_s(const view *v) {
  if (!v->published || v->s.steps_run <= 0 || v->s.train_s <= 0) return -1;
  double left = (double)(v->s.total_steps - v->s.step) * v->s.train_s / (double)v->s.steps_run - v->since_step;
  return left > 0 ? left : 0;
}

/* ---- the endpoints: each fills body and returns the HTTP status ---- */

static unsigned get_health(dt_monitor *mon, sbuf *b) {
  view v = {0};
  take_view(mon, &v);
  unsigned code = MHD_HTTP_OK;
  if (!v.published) {
    sb_printf(b, "{\"status\": \"starting\"}\n");
  } else if (stalled(mon, &v)) {
    code = MHD_HTTP_SERVICE_UNAVAILABLE;
    sb_printf(b, "{\"status\": \"stalled\", \"step\": %lld, \"seconds_since_step\": %.1f, \"stall_s\": %g",
              (long long)v.s.step, v.since_step, mon->stall_s);
    if (v.waiting) {
      sb_printf(b, ", \"waiting_in\": ");
      sb_json_str(b, v.wait_what);
      sb_printf(b, ", \"waiting_at_step\": %lld, \"waiting_s\": %.1f, \"missing_ranks\": [%s]", (long long)v.wait_step,
                v.wait_s, v.wait_missing);
    }
    sb_printf(b, "}\n");
  } else {
    sb_printf(b, "{\"status\": \"ok\", \"step\": %lld, \"total_steps\": %lld, \"seconds_since_step\": %.1f}\n",
              (long long)v.s.step, (long long)v.s.total_steps, v.since_step);
  }
  free_view(&v);
  return code;
}

static void prom_head(sbuf *b, const char *name, const char *type, const char *help) {
  sb_printf(b, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

static void prom_value(sbuf *b, const char *name, const char *labels, double v) {
  char num[40];
  if (isnan(v))
    snprintf(num, sizeof num, "NaN");
  else if (isinf(v))
    snprintf(num, sizeof num, v > 0 ? "+Inf" : "-Inf");
  else
    fmt_num(num, sizeof num, v);
  sb_printf(b, "%s%s %s\n", name, labels ? labels : "", num);
}

static void prom_gauge(sbuf *b, const char *name, const char *help, double v) {
  prom_head(b, name, "gauge", help);
  prom_value(b, name, NULL, v);
}

/* {rank="r",host="h"} or with gpu="g" */
static void rank_labels(const dt_monitor *mon, int r, int gpu, char *out, size_t cap) {
  sbuf l = {0};
  sb_printf(&l, "{rank=\"%d\",host=\"", r);
  sb_label(&l, mon->hosts[r]);
  if (gpu >= 0)
    sb_printf(&l, "\",gpu=\"%d\"}", gpu);
  else
    sb_printf(&l, "\"}");
  dt_strlcpy(out, l.p, cap);
  free(l.p);
}

static unsigned get_metrics(dt_monitor *mon, sbuf *b) {
  view v = {0};
  take_view(mon, &v);
  const dt_monitor_snapshot *s = &v.s;
  char labels[600];
  prom_head(b, "ddp_train_info", "gauge", "The run: ddp_train version, config hash and world size (value 1).");
  sb_printf(b, "ddp_train_info{version=\"%s\",config_hash=\"%016llx\",world_size=\"%d\"} 1\n", DT_VERSION,
            (unsigned long long)mon->config_hash, mon->world);
  prom_gauge(b, "ddp_train_world_size", "Ranks in the job.", mon->world);
  prom_gauge(b, "ddp_train_up", "1 once training has started, 0 during start-up.", v.published);
  if (!v.published) goto out;
  prom_gauge(b, "ddp_train_step", "The last optimizer step finished.", (double)s->step);
  prom_gauge(b, "ddp_train_planned_steps", "Optimizer steps in the whole run.", (double)s->total_steps);
  prom_gauge(b, "ddp_train_epoch", "The epoch of the last step, counted from 1.", (double)s->epoch);
  prom_head(b, "ddp_train_steps_total", "counter", "Optimizer steps run by this process (since its start or resume).");
  prom_value(b, "ddp_train_steps_total", NULL, (double)s->steps_run);
  prom_gauge(b, "ddp_train_seconds_since_step", "Seconds since the last step finished.", v.since_step);
  prom_gauge(b, "ddp_train_stalled", "1 when no step has finished for monitor.stall_s (GET /health answers 503).",
             stalled(mon, &v));
  double eta = eta_s(&v);
  if (eta >= 0) prom_gauge(b, "ddp_train_eta_seconds", "Seconds to the last step at the pace so far.", eta);
  if (s->log_step > 0) {
    prom_gauge(b, "ddp_train_metrics_step",
               "The step of the metrics.jsonl record that the loss, rates and times come from (log.every_steps).",
               (double)s->log_step);
    prom_gauge(b, "ddp_train_loss", "Mean training loss over the log window.", s->loss);
    prom_gauge(b, "ddp_train_learning_rate", "Learning rate of the last step.", s->lr);
    prom_gauge(b, "ddp_train_samples_per_second", "Training samples per second over the log window.", s->samples_per_s);
    if (s->tokens_per_s > 0)
      prom_gauge(b, "ddp_train_tokens_per_second", "Training tokens per second over the log window.", s->tokens_per_s);
    prom_gauge(b, "ddp_train_step_seconds", "Mean wall time per step over the log window.", s->step_ms / 1e3);
    prom_gauge(b, "ddp_train_compute_seconds", "Rank 0's mean compute time per step (step less data and comm).",
               s->compute_ms / 1e3);
    prom_gauge(b, "ddp_train_data_seconds", "Rank 0's mean wait for input data per step.", s->data_ms / 1e3);
    prom_gauge(b, "ddp_train_comm_seconds", "Rank 0's mean wait for the gradient allreduce per step.",
               s->comm_ms / 1e3);
    prom_head(b, "ddp_train_rank_compute_seconds", "gauge", "Each rank's mean compute time per step.");
    for (int r = 0; r < mon->world; r++) {
      rank_labels(mon, r, -1, labels, sizeof labels);
      prom_value(b, "ddp_train_rank_compute_seconds", labels, v.rank_compute_ms[r] / 1e3);
    }
    prom_gauge(b, "ddp_train_straggler_rank", "The rank more than 10% over the median compute time; -1: none.",
               s->straggler_rank);
  }
  if (s->val_step > 0) {
    prom_gauge(b, "ddp_train_val_step", "The step of the last validation.", (double)s->val_step);
    prom_gauge(b, "ddp_train_val_loss", "Validation loss of the last evaluation.", s->val_loss);
    if (s->val_acc >= 0)
      prom_gauge(b, "ddp_train_val_accuracy", "Validation accuracy of the last evaluation (0 to 1).", s->val_acc);
    if (s->has_ema) {
      prom_gauge(b, "ddp_train_ema_val_loss", "Validation loss of the weights' moving average (train.ema).",
                 s->ema_val_loss);
      if (s->val_acc >= 0)
        prom_gauge(b, "ddp_train_ema_val_accuracy", "Validation accuracy of the weights' moving average.",
                   s->ema_val_acc);
    }
  }
  if (s->ckpt_step > 0) {
    prom_gauge(b, "ddp_train_checkpoint_step", "The step of the last checkpoint this process wrote.",
               (double)s->ckpt_step);
    prom_gauge(b, "ddp_train_checkpoint_age_seconds", "Seconds since the last checkpoint was written.",
               dt_now() - s->ckpt_time);
  }
  if (v.has_gpu) {
    static const struct {
      const char *name, *help;
      int field;
      double scale;
    } g[] = {
        {"ddp_train_gpu_memory_used_bytes", "GPU memory in use (NVML).", DT_MON_GPU_MEM_USED, 1048576.0},
        {"ddp_train_gpu_memory_peak_bytes", "Most GPU memory in use at a reading so far.", DT_MON_GPU_MEM_PEAK,
         1048576.0},
        {"ddp_train_gpu_utilization_ratio", "GPU utilisation (NVML, 0 to 1).", DT_MON_GPU_UTIL, 0.01},
        {"ddp_train_gpu_power_watts", "GPU power draw (NVML).", DT_MON_GPU_POWER, 1.0},
        {"ddp_train_gpu_temperature_celsius", "GPU temperature (NVML).", DT_MON_GPU_TEMP, 1.0},
    };
    for (size_t k = 0; k < sizeof g / sizeof *g; k++) {
      prom_head(b, g[k].name, "gauge", g[k].help);
      for (int r = 0; r < mon->world; r++) {
        const double *x = v.gpu + (size_t)r * DT_MON_GPU_FIELDS;
        if (!x[DT_MON_GPU_VALID]) continue;
        rank_labels(mon, r, (int)x[DT_MON_GPU_INDEX], labels, sizeof labels);
        prom_value(b, g[k].name, labels, x[g[k].field] * g[k].scale);
      }
    }
  }
out:
  free_view(&v);
  return MHD_HTTP_OK;
}

/* /status's "distill": the teacher, or null. */
static void distill_json(const dt_monitor *mon, sbuf *b) {
  if (mon->teacher[0]) {
    sb_printf(b, "{\"teacher\": ");
    sb_json_str(b, mon->teacher);
    sb_printf(b, ", \"weights\": ");
    sb_json_str(b, mon->teacher_weights);
    sb_printf(b, ", \"teacher_parameters\": %lld, \"loss\": ", (long long)mon->teacher_params);
    sb_json_str(b, mon->distill_loss);
    sb_printf(b, ", \"temperature\": ");
    sb_json_num(b, mon->temperature);
    sb_printf(b, ", \"alpha\": ");
    sb_json_num(b, mon->alpha);
    sb_printf(b, "}");
  } else {
    sb_printf(b, "null");
  }
}

/* /status's "ranks" items: host, device, the last log window's compute time and the NVML reading. */
static void ranks_json(const dt_monitor *mon, const view *v, sbuf *b) {
  const dt_monitor_snapshot *s = &v->s;
  for (int r = 0; r < mon->world; r++) {
    sb_printf(b, "%s{\"rank\": %d, \"host\": ", r ? ", " : "", r);
    sb_json_str(b, mon->hosts[r]);
    sb_printf(b, ", \"device\": ");
    sb_json_str(b, mon->devices[r]);
    sb_printf(b, ", \"compute_ms\": "); /* the last log window's mean */
    sb_json_num(b, v->published && s->log_step > 0 ? v->rank_compute_ms[r] : NAN);
    const double *g = v->gpu + (size_t)r * DT_MON_GPU_FIELDS;
    if (v->has_gpu && g[DT_MON_GPU_VALID])
      sb_printf(b,
                ", \"gpu\": {\"index\": %d, \"util_pct\": %.0f, \"mem_used_mib\": %.0f, \"mem_peak_mib\": %.0f, "
                "\"power_w\": %.0f, \"temp_c\": %.0f}}",
                (int)g[DT_MON_GPU_INDEX], g[DT_MON_GPU_UTIL], g[DT_MON_GPU_MEM_USED], g[DT_MON_GPU_MEM_PEAK],
                g[DT_MON_GPU_POWER], g[DT_MON_GPU_TEMP]);
    else
      sb_printf(b, ", \"gpu\": null}");
  }
}

/* /status's object for the view, in `state` ("starting", "training", "stalled"; report.html's
 * "finished" or "stopped"). */
static void status_json(const dt_monitor *mon, const view *v, const char *state, sbuf *b) {
  const dt_monitor_snapshot *s = &v->s;
  sb_printf(b, "{\"version\": \"%s\", \"state\": \"%s\", \"config\": ", DT_VERSION, state);
  sb_json_str(b, mon->config_path);
  sb_printf(b,
            ", \"config_hash\": \"%016llx\", \"world_size\": %d, \"global_batch\": %lld, \"batch\": {\"rank_rows\": "
            "%lld, \"grad_accum\": %lld, \"auto\": ",
            (unsigned long long)mon->config_hash, mon->world, (long long)mon->global_batch, (long long)mon->rank_rows,
            (long long)mon->grad_accum);
  if (mon->auto_batch[0])
    sb_json_str(b, mon->auto_batch);
  else
    sb_printf(b, "null");
  sb_printf(b, "}, \"optimizer\": {\"name\": ");
  sb_json_str(b, mon->optim_name);
  sb_printf(b, ", \"zero\": %d, \"state_bytes_per_rank\": %lld", mon->zero, (long long)mon->optim_state_bytes);
  sb_printf(b, "}, \"distill\": ");
  distill_json(mon, b);
  sb_printf(b, ", \"ranks\": [");
  ranks_json(mon, v, b);
  sb_printf(b, "], \"monitor\": {\"listen\": ");
  sb_json_str(b, mon->where);
  sb_printf(b, ", \"stall_s\": %g, \"post\": %s}, \"log_dir\": ", mon->stall_s,
            mon->token ? "\"bearer token\"" : "\"refused\"");
  sb_json_str(b, mon->log_dir);
  sb_printf(b, ", \"data\": ");
  sb_json_str(b, mon->data_path);
  sb_printf(b, ", \"model_summary\": ");
  sb_json_str(b, mon->model_summary);
  if (v->published) {
    double eta = eta_s(v);
    sb_printf(b,
              ", \"progress\": {\"step\": %lld, \"total_steps\": %lld, \"epoch\": %lld, \"epochs\": %lld, "
              "\"fraction\": %.4f}, \"train_s\": %.1f, \"seconds_since_step\": %.1f, \"eta_s\": ",
              (long long)s->step, (long long)s->total_steps, (long long)s->epoch, (long long)mon->epochs,
              s->total_steps > 0 ? (double)s->step / (double)s->total_steps : 0.0, s->train_s + v->since_step,
              v->since_step);
    sb_json_num(b, eta >= 0 ? eta : NAN);
  }
  if (v->published && s->log_step > 0) {
    sb_printf(b, ", \"last_log\": {\"step\": %lld, \"loss\": ", (long long)s->log_step);
    sb_json_num(b, s->loss);
    sb_printf(b, ", \"lr\": ");
    sb_json_num(b, s->lr);
    if (s->tokens_per_s > 0) sb_printf(b, ", \"tokens_per_s\": %.1f", s->tokens_per_s);
    sb_printf(b,
              ", \"samples_per_s\": %.1f, \"step_ms\": %.3f, \"compute_ms\": %.3f, \"data_ms\": %.3f, "
              "\"comm_ms\": %.3f, \"straggler_rank\": %d}",
              s->samples_per_s, s->step_ms, s->compute_ms, s->data_ms, s->comm_ms, s->straggler_rank);
  }
  if (v->published && s->val_step > 0) {
    sb_printf(b, ", \"last_eval\": {\"step\": %lld, \"val_loss\": ", (long long)s->val_step);
    sb_json_num(b, s->val_loss);
    if (s->val_acc >= 0) {
      sb_printf(b, ", \"val_acc\": ");
      sb_json_num(b, s->val_acc);
    }
    if (s->has_ema) {
      sb_printf(b, ", \"ema_val_loss\": ");
      sb_json_num(b, s->ema_val_loss);
      if (s->val_acc >= 0) {
        sb_printf(b, ", \"ema_val_acc\": ");
        sb_json_num(b, s->ema_val_acc);
      }
    }
    sb_printf(b, "}");
  }
  if (v->published && s->ckpt_step > 0)
    sb_printf(b, ", \"last_checkpoint\": {\"step\": %lld, \"age_s\": %.1f}", (long long)s->ckpt_step,
              dt_now() - s->ckpt_time);
  sb_printf(b, "}");
}

static unsigned get_status(dt_monitor *mon, sbuf *b) {
  view v = {0};
  take_view(mon, &v);
  status_json(mon, &v, !v.published ? "starting" : stalled(mon, &v) ? "stalled" : "training", b);
  sb_printf(b, "\n");
  free_view(&v);
  return MHD_HTTP_OK;
}

/* Query argument `name`, a whole number in [0, max]: dflt when it is absent, -1 when it is not one.
 * Taken with its length, not as a C string. */
static long long count_arg(struct MHD_Connection *c, const char *name, long long dflt, long long max) {
  const char *s;
  size_t n;
  if (MHD_lookup_connection_value_n(c, MHD_GET_ARGUMENT_KIND, name, strlen(name), &s, &n) != MHD_YES) return dflt;
  if (!s || n == 0 || n > 18 || strspn(s, "0123456789") != n) return -1;
  long long x = strtoll(s, NULL, 10);
  return x <= max ? x : -1;
}

/* A whole record line of metrics.jsonl: its step, or -1 for a line without one. */
static long long record_step(const char *line) {
  const char *k = strstr(line, "\"step\": ");
  return k ? strtoll(k + 8, NULL, 10) : -1;
}

/* path opened for reading, or NULL with errno set and why in msg. Opened without blocking and
 * refused unless a regular file: a FIFO put in place of metrics.jsonl would hold the server's one
 * thread in open() until a writer came. */
static FILE *open_regular(const char *path, char *msg, size_t cap) {
  struct stat sb;
  FILE *f = NULL;
  int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY), e = errno;
  if (fd >= 0 && fstat(fd, &sb))
    e = errno;
  else if (fd >= 0 && !S_ISREG(sb.st_mode))
    e = -1;
  else if (fd >= 0 && !(f = fdopen(fd, "r")))
    e = errno;
  if (f) return f;
  if (fd >= 0) close(fd);
  if (e < 0)
    snprintf(msg, cap, "%s is %s, not a regular file", path, file_kind(sb.st_mode));
  else
    snprintf(msg, cap, "%s: %s", path, strerror(e));
  errno = e < 0 ? EINVAL : e;
  return NULL;
}

/* Extends the index of metrics.jsonl over the whole lines appended since the last request: a mark
 * every HISTORY_STRIDE records holding its offset and the largest step before it. Starting at the
 * last mark whose largest step before is under `since` skips only records under it, whatever their
 * order (a resume after a crash logs some steps twice), and reads at most a stride of them. */
enum { HISTORY_STRIDE = 64 };
static int index_history(dt_monitor *mon, FILE *f) {
  struct stat sb;
  if (fstat(fileno(f), &sb)) return -1;
  if (sb.st_size < mon->hist_indexed) mon->hist_indexed = mon->hist_records = mon->n_marks = 0; /* replaced */
  if (fseeko(f, mon->hist_indexed, SEEK_SET)) return -1;
  char *line = NULL;
  size_t cap = 0;
  ssize_t n;
  while ((n = getline(&line, &cap, f)) > 0 && line[n - 1] == '\n') {
    if (mon->hist_records % HISTORY_STRIDE == 0) {
      if (mon->n_marks == mon->cap_marks) {
        mon->cap_marks = mon->cap_marks ? 2 * mon->cap_marks : 256;
        mon->marks = dt_realloc(mon->marks, (size_t)mon->cap_marks * sizeof *mon->marks);
      }
      mon->marks[mon->n_marks++] = (hist_mark){.offset = mon->hist_indexed, .max_before = mon->hist_max};
    }
    long long step = record_step(line);
    if (step > mon->hist_max) mon->hist_max = step;
    mon->hist_records++;
    mon->hist_indexed += n;
  }
  free(line);
  return ferror(f) ? -1 : 0;
}

/* The records of metrics.jsonl from record index `from` on (a record's index: its line number
 * from 0) whose step is at least `since`, as a JSON array; at most limit (*next: the index to go on
 * from, or -1 when none is left). The index is the cursor: a step is not one, as records share a
 * step (an evaluation's) and a resume logs some steps twice. One request costs at most
 * HISTORY_SCAN bytes read and HISTORY_BODY bytes sent (a whole file of thousands of records, asked
 * for again and again, took three quarters of rank 0's core): the rest is the next page's. Only
 * whole lines are read: the training thread may be appending one. */
static unsigned get_history(dt_monitor *mon, struct MHD_Connection *c, sbuf *b, long long *next) {
  *next = -1;
  long long since = count_arg(c, "since", 0, (long long)1 << 62), from = count_arg(c, "from", 0, (long long)1 << 62);
  long long limit = count_arg(c, "limit", MAX_HISTORY, MAX_HISTORY);
  if (since < 0 || from < 0 || limit < 1) {
    sb_printf(b,
              "{\"error\": \"since must be a step number (0 or more), from a record index (0 or more) and limit a "
              "count in [1, %d]\"}\n",
              MAX_HISTORY);
    return MHD_HTTP_BAD_REQUEST;
  }
  if (!mon->history_path[0]) {
    sb_printf(b, "{\"error\": \"no metrics.jsonl: log.dir is empty\"}\n");
    return MHD_HTTP_NOT_FOUND;
  }
  lock(mon);
  int started = mon->published; /* metrics.jsonl is (re)opened before the first publish */
  unlock(mon);
  if (!started) {
    sb_printf(b, "[]\n");
    return MHD_HTTP_OK;
  }
  int rc = pthread_mutex_lock(&mon->hist_mu);
  if (rc) dt_abort(__FILE__, __LINE__, "pthread_mutex_lock failed");
  char msg[1300];
  FILE *f = open_regular(mon->history_path, msg, sizeof msg);
  if (!f) {
    int e = errno;
    sb_printf(b, "{\"error\": ");
    sb_json_str(b, msg);
    sb_printf(b, "}\n");
    if ((rc = pthread_mutex_unlock(&mon->hist_mu))) dt_abort(__FILE__, __LINE__, "pthread_mutex_unlock failed");
    return e == ENOENT ? MHD_HTTP_NOT_FOUND : MHD_HTTP_INTERNAL_SERVER_ERROR;
  }
  int bad = index_history(mon, f);
  int lo = 0, hi = mon->n_marks - 1; /* the last mark with nothing at or over since before it */
  while (lo < hi) {
    int mid = (lo + hi + 1) / 2;
    if (mon->marks[mid].max_before < since)
      lo = mid;
    else
      hi = mid - 1;
  }
  long long by_index = from / HISTORY_STRIDE; /* the last mark at or before record `from` */
  if (by_index > lo) lo = by_index < mon->n_marks ? (int)by_index : mon->n_marks;
  off_t pos = lo < mon->n_marks ? mon->marks[lo].offset : mon->hist_indexed, end = mon->hist_indexed;
  long long index = (long long)lo * HISTORY_STRIDE; /* of the record at pos */
  if ((rc = pthread_mutex_unlock(&mon->hist_mu))) dt_abort(__FILE__, __LINE__, "pthread_mutex_unlock failed");
  char *line = NULL;
  size_t cap = 0;
  ssize_t n;
  long long count = 0;
  const off_t start = pos;
  sb_printf(b, "[");
  if (!bad) bad = fseeko(f, pos, SEEK_SET);
  while (!bad && pos < end && (n = getline(&line, &cap, f)) > 0 && line[n - 1] == '\n') {
    long long i = index++;
    if (pos - start >= HISTORY_SCAN) { /* may be no record yet: the next page goes on from here */
      *next = i;
      break;
    }
    pos += n;
    if (i < from || record_step(line) < since) continue;
    if (count == limit || (count && b->len + (size_t)n > HISTORY_BODY)) {
      *next = i;
      break;
    }
    sb_printf(b, "%s\n", count ? "," : "");
    sb_append(b, line, (size_t)n - 1);
    count++;
  }
  bad = bad || ferror(f);
  free(line);
  fclose(f);
  if (bad) {
    b->len = 0;
    sb_printf(b, "{\"error\": \"cannot read metrics.jsonl\"}\n");
    return MHD_HTTP_INTERNAL_SERVER_ERROR;
  }
  sb_printf(b, "%s]\n", count ? "\n" : "");
  return MHD_HTTP_OK;
}

static unsigned post_request(dt_monitor *mon, int bit, sbuf *b) {
  lock(mon);
  mon->requests |= bit;
  int64_t step = mon->snap.step;
  unlock(mon);
  sb_printf(b, "{\"accepted\": \"%s\", \"at\": \"the next step boundary\", \"step\": %lld}\n",
            bit == DT_MON_STOP ? "stop" : "checkpoint", (long long)step);
  return MHD_HTTP_ACCEPTED;
}

/* ---- connections: the daemon's thread ---- */

/* The slot of c, set when it was accepted; NULL for none. */
static conn_slot *slot_of(struct MHD_Connection *c) {
  const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
  return ci ? ci->socket_context : NULL;
}

/* Past MAX_CONNECTIONS, closes a connection other than `newcomer`: the one longest in its headers,
 * else the one waiting longest for a request line (idle, or not yet read), else the one answered
 * longest. libmicrohttpd's limits refuse newcomers instead, so that slow clients (a header byte
 * every few seconds never times out) from a few addresses could hold every connection and lock out
 * /health and POST /stop. A request sent whole goes from WAITING to ANSWERING in one round of the
 * daemon, and is closed only when no connection is in its headers and 32 newer ones came in that
 * round. shutdown() makes the daemon see the connection end and close it; the descriptor stays
 * open until its CLOSED notice. */
static void make_room(dt_monitor *mon, const conn_slot *newcomer) {
  conn_slot *victim = NULL;
  int live = 0;
  for (int i = 0; i < MHD_CONNECTIONS; i++) {
    conn_slot *s = &mon->conns[i];
    if (!s->c || s->closing) continue;
    live++;
    if (s != newcomer &&
        (!victim || s->stage < victim->stage || (s->stage == victim->stage && s->since < victim->since)))
      victim = s;
  }
  if (live <= MAX_CONNECTIONS || !victim) return;
  victim->closing = 1;
  if (shutdown(victim->fd, SHUT_RDWR) && errno != ENOTCONN) /* ENOTCONN: the client left already */
    dt_abort(__FILE__, __LINE__, "shutdown of a monitor connection failed");
}

static void on_connection(void *cls, struct MHD_Connection *c, void **socket_context,
                          enum MHD_ConnectionNotificationCode toe) {
  dt_monitor *mon = cls;
  if (toe == MHD_CONNECTION_NOTIFY_CLOSED) {
    conn_slot *s = *socket_context;
    if (s) s->c = NULL;
    return;
  }
  conn_slot *s = NULL;
  for (int i = 0; i < MHD_CONNECTIONS && !s; i++)
    if (!mon->conns[i].c) s = &mon->conns[i];
  const union MHD_ConnectionInfo *fd = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
  DT_ASSERT(s && fd); /* as many slots as the daemon takes connections */
  *s = (conn_slot){.c = c, .fd = fd->connect_fd, .stage = WAITING, .since = dt_now()};
  *socket_context = s;
  make_room(mon, s);
}

/* A request line has come: its target as sent (libmicrohttpd hands the handler the target
 * percent-decoded, in which "/%68ealth" and "/health%00.json" read "/health"). */
static void *on_request_line(void *cls, const char *uri, struct MHD_Connection *c) {
  (void)cls;
  conn_slot *s = slot_of(c);
  if (s) {
    s->stage = IN_HEADERS;
    s->since = dt_now();
    size_t n = uri ? strcspn(uri, "?") : 0;
    if (n >= sizeof s->path) n = 0;
    if (n) memcpy(s->path, uri, n);
    s->path[n] = 0;
  }
  return NULL; /* the handler's *req_cls starts NULL */
}

/* A request is done (answered, or given up): its connection waits for the next one. */
static void on_completed(void *cls, struct MHD_Connection *c, void **req_cls, enum MHD_RequestTerminationCode toe) {
  (void)cls;
  (void)req_cls;
  (void)toe;
  conn_slot *s = slot_of(c);
  if (s) {
    s->stage = WAITING;
    s->since = dt_now();
  }
}

/* ---- the request handler ---- */

/* Compares the Authorization header (len bytes) with the token in time that depends only on the
 * token's length. */
static int authorised(const dt_monitor *mon, const char *header, size_t len) {
  if (!mon->token || !header || len < 7 || strncasecmp(header, "Bearer ", 7)) return 0;
  size_t skip = 7;
  while (skip < len && header[skip] == ' ') skip++;
  const char *given = header + skip;
  size_t n = len - skip;
  unsigned diff = n != mon->token_len;
  for (size_t i = 0; i < mon->token_len; i++)
    diff |= (unsigned char)(i < n ? given[i] : 0) ^ (unsigned char)mon->token[i];
  return diff == 0;
}

/* Every answer's headers. The page may load scripts, styles and data from this server only, and
 * nothing may frame it: an answer that a browser takes for a page runs nothing from elsewhere. */
static const struct {
  const char *name, *value;
} security_headers[] = {
    {"Content-Security-Policy",
     "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
     "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"},
    {"X-Content-Type-Options", "nosniff"},
    {"Referrer-Policy", "no-referrer"},
    {MHD_HTTP_HEADER_CACHE_CONTROL, "no-store"},
};

/* Queues r with its headers, and releases it. */
static enum MHD_Result queue(struct MHD_Connection *c, unsigned code, struct MHD_Response *r, const char *type,
                             const char *hname, const char *hvalue) {
  enum MHD_Result ok = MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, type);
  for (size_t i = 0; i < sizeof security_headers / sizeof *security_headers && ok == MHD_YES; i++)
    ok = MHD_add_response_header(r, security_headers[i].name, security_headers[i].value);
  if (ok == MHD_YES && hname) ok = MHD_add_response_header(r, hname, hvalue);
  if (ok == MHD_YES) ok = MHD_queue_response(c, code, r);
  MHD_destroy_response(r);
  return ok;
}

/* Whether a Host header (len bytes) names loopback: localhost, 127.x.y.z or [::1], with or without a
 * port. A site whose DNS name was pointed at 127.0.0.1 sends its own name, so a browser on this
 * machine (or at the far end of an ssh tunnel) cannot be made to read a run for it. */
static int loopback_host(const char *h, size_t len) {
  char host[300];
  if (len == 0 || len >= sizeof host) return 0;
  memcpy(host, h, len);
  host[len] = 0;
  char *port = host[0] == '[' ? strchr(host, ']') : strrchr(host, ':');
  if (host[0] == '[') {
    if (!port) return 0;
    *port++ = 0; /* "[::1]:9400": port at ":9400" */
  }
  if (port && *port) {
    if (*port != ':' || strspn(port + 1, "0123456789") != strlen(port + 1)) return 0;
    *port = 0;
  }
  if (host[0] == '[') return !strcmp(host + 1, "::1");
  struct in_addr a;
  return !strcasecmp(host, "localhost") || (inet_pton(AF_INET, host, &a) == 1 && ntohl(a.s_addr) >> 24 == 127);
}

static enum MHD_Result respond(struct MHD_Connection *c, unsigned code, const char *type, sbuf *b, const char *hname,
                               const char *hvalue) {
  if (!b->p) sb_printf(b, "\n");
  struct MHD_Response *r = MHD_create_response_from_buffer(b->len, b->p, MHD_RESPMEM_MUST_FREE);
  if (!r) {
    free(b->p);
    return MHD_NO; /* MHD closes the connection */
  }
  return queue(c, code, r, type, hname, hvalue);
}

/* One of the page's files, from the binary. */
static enum MHD_Result respond_file(struct MHD_Connection *c, const unsigned char *p, unsigned long n,
                                    const char *type) {
  struct MHD_Response *r = MHD_create_response_from_buffer(n, (void *)p, MHD_RESPMEM_PERSISTENT);
  return r ? queue(c, MHD_HTTP_OK, r, type, NULL, NULL) : MHD_NO;
}

/* MHD_KeyValueIteratorN: stops at a name or value that holds a control character (a header value
 * may hold a tab). Lengths are libmicrohttpd's: a NUL inside is seen where it keeps one (a decoded
 * query argument), while 0.9.75 ends a header's value at a NUL itself. */
static enum MHD_Result no_control(void *cls, enum MHD_ValueKind kind, const char *key, size_t key_size,
                                  const char *value, size_t value_size) {
  for (int part = 0; part < 2; part++) {
    const unsigned char *p = (const unsigned char *)(part ? value : key);
    size_t n = part ? value_size : key_size;
    for (size_t i = 0; p && i < n; i++)
      if ((p[i] < 0x20 && !(p[i] == '\t' && part && kind == MHD_HEADER_KIND)) || p[i] == 0x7f) {
        *(int *)cls = 1;
        return MHD_NO;
      }
  }
  return MHD_YES;
}

static enum MHD_Result fail(struct MHD_Connection *c, unsigned code, const char *msg, const char *hname,
                            const char *hvalue) {
  sbuf b = {0};
  sb_printf(&b, "{\"error\": ");
  sb_json_str(&b, msg);
  sb_printf(&b, "}\n");
  return respond(c, code, "application/json", &b, hname, hvalue);
}

enum { EP_HEALTH, EP_METRICS, EP_STATUS, EP_HISTORY, EP_CHECKPOINT, EP_STOP, EP_PAGE, EP_JS, EP_CSS, EP_CHART };
/* page: one of the dashboard's files, the same for everyone (no run data: that comes from /status
 * and /history, under their rules), so served without the token also off loopback */
static const struct {
  const char *path;
  int post, page;
} endpoints[] = {{"/health", 0, 0},        {"/metrics", 0, 0},     {"/status", 0, 0}, {"/history", 0, 0},
                 {"/checkpoint", 1, 0},    {"/stop", 1, 0},        {"/", 0, 1},       {"/dashboard.js", 0, 1},
                 {"/dashboard.css", 0, 1}, {"/chart.min.js", 0, 1}};

/* The path is matched as the client sent it: only the documented spelling of an endpoint is that
 * endpoint. */
static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                                  const char *version, const char *upload_data, size_t *upload_data_size,
                                  void **req_cls) {
  (void)url; /* percent-decoded: slot->path instead */
  (void)version;
  (void)upload_data;
  dt_monitor *mon = cls;
  if (*req_cls) { /* a body after the answer was queued: dropped */
    *upload_data_size = 0;
    return MHD_YES;
  }
  *req_cls = mon;
  conn_slot *slot = slot_of(c);
  if (slot) {
    slot->stage = ANSWERING;
    slot->since = dt_now();
  }
  if (MHD_get_connection_values(c, MHD_HEADER_KIND, NULL, NULL) > MAX_HEADERS)
    return fail(c, MHD_HTTP_REQUEST_HEADER_FIELDS_TOO_LARGE, "more than 64 header fields", NULL, NULL);
  int control = 0;
  MHD_get_connection_values_n(c, MHD_HEADER_KIND | MHD_GET_ARGUMENT_KIND, no_control, &control);
  if (control) return fail(c, MHD_HTTP_BAD_REQUEST, "a header or query argument holds a control character", NULL, NULL);
  int ep = -1;
  for (int i = 0; i < (int)(sizeof endpoints / sizeof *endpoints) && slot; i++)
    if (!strcmp(slot->path, endpoints[i].path)) ep = i;
  if (ep < 0)
    return fail(c, MHD_HTTP_NOT_FOUND,
                "no such endpoint: GET / (the dashboard), /health, /metrics, /status, "
                "/history?since=STEP&from=INDEX&limit=N; POST /checkpoint, /stop",
                NULL, NULL);
  int is_get = !strcmp(method, MHD_HTTP_METHOD_GET) || !strcmp(method, MHD_HTTP_METHOD_HEAD);
  if (endpoints[ep].post ? strcmp(method, MHD_HTTP_METHOD_POST) != 0 : !is_get)
    return fail(c, MHD_HTTP_METHOD_NOT_ALLOWED, endpoints[ep].post ? "use POST" : "use GET", MHD_HTTP_HEADER_ALLOW,
                endpoints[ep].post ? "POST" : "GET, HEAD");
  const char *auth, *host;
  size_t auth_len = 0, host_len = 0;
  if (MHD_lookup_connection_value_n(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION,
                                    strlen(MHD_HTTP_HEADER_AUTHORIZATION), &auth, &auth_len) != MHD_YES)
    auth = NULL;
  if (MHD_lookup_connection_value_n(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_HOST, strlen(MHD_HTTP_HEADER_HOST), &host,
                                    &host_len) != MHD_YES)
    host = NULL; /* HTTP/1.0 may leave it out; a browser always sends it */
  if (!endpoints[ep].post && mon->loopback && host && !loopback_host(host, host_len) &&
      !authorised(mon, auth, auth_len))
    return fail(c, MHD_HTTP_FORBIDDEN,
                "the Host header names no loopback address: without the token, ask for http://127.0.0.1:PORT/ or "
                "http://localhost:PORT/ (a page from another site cannot read the run)",
                NULL, NULL);
  if (endpoints[ep].post || (!mon->loopback && !endpoints[ep].page)) {
    if (!mon->token)
      return fail(c, MHD_HTTP_FORBIDDEN, "POST is refused: the run was started without monitor.token_file", NULL, NULL);
    if (!authorised(mon, auth, auth_len))
      return fail(
          c, MHD_HTTP_UNAUTHORIZED,
          auth ? "wrong token" : "this needs an Authorization: Bearer header with the token of monitor.token_file",
          MHD_HTTP_HEADER_WWW_AUTHENTICATE, "Bearer realm=\"ddp_train\"");
  }
  sbuf b = {0};
  unsigned code;
  long long next = -1;
  switch (ep) {
    case EP_HEALTH: code = get_health(mon, &b); break;
    case EP_METRICS:
      code = get_metrics(mon, &b);
      return respond(c, code, "text/plain; version=0.0.4; charset=utf-8", &b, NULL, NULL);
    case EP_STATUS: code = get_status(mon, &b); break;
    case EP_HISTORY: {
      code = get_history(mon, c, &b, &next);
      char more[32];
      snprintf(more, sizeof more, "%lld", next);
      return respond(c, code, "application/json", &b, next >= 0 ? "X-Next-From" : NULL, more);
    }
    case EP_CHECKPOINT:
      if (!mon->checkpoints)
        return fail(c, MHD_HTTP_CONFLICT, "checkpoint.dir is empty: this run writes no checkpoints", NULL, NULL);
      code = post_request(mon, DT_MON_CHECKPOINT, &b);
      break;
    case EP_STOP: code = post_request(mon, DT_MON_STOP, &b); break;
    case EP_PAGE: return respond_file(c, dt_dash_page, dt_dash_page_len, "text/html; charset=utf-8");
    case EP_JS: return respond_file(c, dt_dash_js, dt_dash_js_len, "text/javascript; charset=utf-8");
    case EP_CSS: return respond_file(c, dt_dash_css, dt_dash_css_len, "text/css; charset=utf-8");
    default: return respond_file(c, dt_dash_chart, dt_dash_chart_len, "text/javascript; charset=utf-8");
  }
  return respond(c, code, "application/json", &b, NULL, NULL);
}

int monitor_start(dt_monitor *mon, const dt_monitor_run *run, dt_status *st) {
  if (!mon) return 0;
  mon->config_path = dt_strdup(run->config_path);
  mon->model_summary = dt_strdup(run->model_summary ? run->model_summary : "");
  mon->data_path = dt_strdup(run->data_path ? run->data_path : "");
  mon->config_hash = run->config_hash;
  mon->world = run->world_size;
  mon->global_batch = run->global_batch;
  mon->rank_rows = run->rank_rows;
  mon->grad_accum = run->grad_accum;
  mon->auto_batch = dt_strdup(run->auto_batch);
  mon->optim_name = dt_strdup(run->optim_name);
  mon->zero = run->zero;
  mon->optim_state_bytes = run->optim_state_bytes;
  mon->epochs = run->epochs;
  mon->teacher = dt_strdup(run->teacher ? run->teacher : "");
  mon->teacher_weights = dt_strdup(run->teacher_weights ? run->teacher_weights : "");
  mon->distill_loss = dt_strdup(run->distill_loss ? run->distill_loss : "");
  mon->teacher_params = run->teacher_params;
  mon->temperature = run->temperature;
  mon->alpha = run->alpha;
  mon->hosts = dt_calloc((size_t)mon->world, sizeof(char *));
  mon->devices = dt_calloc((size_t)mon->world, sizeof(char *));
  for (int r = 0; r < mon->world; r++) {
    mon->hosts[r] = dt_strdup(run->hosts[r]);
    mon->devices[r] = dt_strdup(run->devices[r]);
  }
  mon->rank_compute_ms = dt_calloc((size_t)mon->world, sizeof(double));
  mon->gpu = dt_calloc((size_t)mon->world * DT_MON_GPU_FIELDS, sizeof(double));
  if (!mon->listen[0]) return 0; /* report.html's state only */
  if (MHD_is_feature_supported(MHD_FEATURE_AUTOSUPPRESS_SIGPIPE) != MHD_YES) {
    /* a client that hangs up must not kill the run */
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = SIG_IGN;
    if (sigemptyset(&sa.sa_mask) || sigaction(SIGPIPE, &sa, NULL))
      return dt_fail(st, DT_EXIT_INPUT, "monitor: cannot ignore SIGPIPE: %s", strerror(errno));
  }
  unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_AUTO | (mon->family == AF_INET6 ? MHD_USE_IPv6 : 0);
  mon->daemon = MHD_start_daemon(
      flags, 0, NULL, NULL, on_request, mon, MHD_OPTION_LISTEN_SOCKET, (MHD_socket)mon->fd, MHD_OPTION_CONNECTION_LIMIT,
      (unsigned)MHD_CONNECTIONS, MHD_OPTION_NOTIFY_CONNECTION, on_connection, mon, MHD_OPTION_URI_LOG_CALLBACK,
      on_request_line, mon, MHD_OPTION_NOTIFY_COMPLETED, on_completed, mon, MHD_OPTION_CONNECTION_TIMEOUT,
      (unsigned)IDLE_TIMEOUT_S, MHD_OPTION_CONNECTION_MEMORY_LIMIT, (size_t)MEMORY_LIMIT, MHD_OPTION_END);
  if (!mon->daemon)
    return dt_fail(st, DT_EXIT_INPUT, "monitor.listen %s: libmicrohttpd could not start its server thread",
                   mon->listen);
  mon->fd = -1; /* the daemon's now: MHD_stop_daemon closes it */
  printf(
      "monitor: listening on http://%s (the dashboard at /; GET /health /metrics /status /history; POST "
      "/checkpoint /stop %s)\n",
      mon->where, mon->token ? "with the token in monitor.token_file" : "refused: no monitor.token_file");
  if (!mon->loopback) printf("monitor: %s is not loopback: every request needs the bearer token\n", mon->where);
  fflush(stdout);
  return 0;
}

/* JSON text s (len bytes) as it may stand inside <script>: '<', '>' and '&' as \\u escapes, which
 * no JSON reader tells apart (none of them ends a JSON string), so no "</script>" or "<!--" in a
 * name or path can end the element. */
static void sb_json_in_html(sbuf *b, const char *s, size_t len) {
  size_t from = 0;
  for (size_t i = 0; i < len; i++) {
    if (s[i] != '<' && s[i] != '>' && s[i] != '&') continue;
    sb_append(b, s + from, i - from);
    sb_printf(b, "\\u%04x", (unsigned)s[i]);
    from = i + 1;
  }
  sb_append(b, s + from, len - from);
}

int monitor_write_report(dt_monitor *mon, int code, dt_status *st) {
  if (!mon || !mon->log_dir[0] || !mon->world) return 0;
  FILE *f = fopen(mon->history_path, "r"); /* NULL: no metrics.jsonl (yet), no records */
  if (!f && errno != ENOENT)
    return dt_fail(st, DT_EXIT_IO, "%s: cannot read for report.html: %s", mon->history_path, strerror(errno));
  struct stat fs;
  if (f && fstat(fileno(f), &fs)) {
    int e = errno;
    fclose(f);
    return dt_fail(st, DT_EXIT_IO, "%s: cannot stat for report.html: %s", mon->history_path, strerror(e));
  }
  /* a log past REPORT_BYTES keeps every k-th training record, every evaluation and the last */
  const long long every = f ? 1 + (long long)fs.st_size / REPORT_BYTES : 1;
  view v = {0};
  take_view(mon, &v);
  sbuf json = {0}, page = {0};
  sb_printf(&json, "{\"status\": ");
  status_json(mon, &v, code == DT_EXIT_STOPPED ? "stopped" : "finished", &json);
  free_view(&v);
  /* each record a JSON string, parsed one by one by the page: a line that a crash cut and a resume
   * appended to spoils that record only */
  sb_printf(&json, ", \"records\": [");
  char *bufs[2] = {NULL, NULL}; /* bufs[cur ^ 1]: the last whole line */
  size_t caps[2] = {0, 0};
  int cur = 0, last_out = 1;
  ssize_t n;
  long long records = 0, index = 0;
  while (f && (n = getline(&bufs[cur], &caps[cur], f)) > 0) {
    char *line = bufs[cur];
    if (line[n - 1] != '\n') continue; /* whole lines only */
    line[n - 1] = 0;
    last_out = index++ % every == 0 || strstr(line, "\"val_loss\"") != NULL;
    if (last_out) {
      sb_printf(&json, "%s\n", records++ ? "," : "");
      sb_json_str(&json, line);
    }
    cur ^= 1;
  }
  if (!last_out) {
    sb_printf(&json, "%s\n", records++ ? "," : "");
    sb_json_str(&json, bufs[cur ^ 1]);
  }
  int bad = f && ferror(f);
  free(bufs[0]);
  free(bufs[1]);
  if (f) fclose(f);
  sb_printf(&json, "]}");
  if (bad) {
    free(json.p);
    return dt_fail(st, DT_EXIT_IO, "%s: reading it for report.html failed", mon->history_path);
  }
  sb_append(&page, (const char *)dt_dash_report_head, dt_dash_report_head_len);
  sb_json_in_html(&page, json.p, json.len);
  sb_append(&page, (const char *)dt_dash_report_tail, dt_dash_report_tail_len);
  free(json.p);
  char path[1100];
  snprintf(path, sizeof path, "%s/report.html", mon->log_dir);
  int rc = dt_write_atomic(path, page.p, page.len, "the run's report", st);
  free(page.p);
  return rc;
}

void monitor_close(dt_monitor *mon) {
  if (!mon) return;
  if (mon->daemon) MHD_stop_daemon(mon->daemon);
  if (mon->fd >= 0) close(mon->fd);
  for (int r = 0; r < mon->world && mon->hosts; r++) {
    free(mon->hosts[r]);
    free(mon->devices[r]);
  }
  free(mon->hosts);
  free(mon->devices);
  free(mon->config_path);
  free(mon->model_summary);
  free(mon->data_path);
  free(mon->auto_batch);
  free(mon->optim_name);
  free(mon->teacher);
  free(mon->teacher_weights);
  free(mon->distill_loss);
  free(mon->rank_compute_ms);
  free(mon->gpu);
  if (mon->token) explicit_bzero(mon->token, mon->token_len);
  free(mon->token);
  free(mon->marks);
  pthread_mutex_destroy(&mon->mu);
  pthread_mutex_destroy(&mon->hist_mu);
  free(mon);
}
