// lockwatch: an LD_PRELOAD shim that records which thread holds each pthread mutex and rwlock that a
// shared library (libcuda) takes through the PLT, and, when a thread has waited on one for
// LOCKWATCH_SECS seconds (default 15), writes who waits on what and who holds it to
// $LOCKWATCH_DIR/lockwatch-PID-N.txt (at most three dumps, LOCKWATCH_SECS apart).
//
// glibc records a mutex's owner and a rwlock's writer, but not a rwlock's readers; this shim keeps
// the readers too, so a stall shows whether the lock is held by a thread that waits on another lock (a
// cycle), by a thread that has exited, or by nobody (the lock word itself damaged).
// LOCKWATCH_BT=1 also keeps the first frames of each acquisition's stack (slower).
//
// Built and used by scripts/stress-conformance.sh (LOCKWATCH=1); by hand:
//   gcc -O2 -shared -fPIC -o /tmp/lockwatch.so scripts/repro/lockwatch.c -ldl -lpthread
//   LD_PRELOAD=/tmp/lockwatch.so LOCKWATCH_DIR=/tmp ./binary
// A diagnostic for issue 33, not part of the product.
#define _GNU_SOURCE
#include <dirent.h>
#include <dlfcn.h>
#include <execinfo.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define MAX_SLOTS 8192
#define TABLE 262144
#define HOLDERS 8
#define FRAMES 8
#define LIFE 262144
#define LFRAMES 24

struct slot {
  int tid;
  void *volatile wait_addr;
  volatile char wait_kind;
  void *volatile wait_ra;
  volatile uint64_t wait_start;
  uint64_t acquired;
};
struct holder {
  int tid;
  char mode;
  void *ra;
  int nframes;
  void *frames[FRAMES];
};
struct entry {
  void *volatile lock;
  volatile int spin;
  int n;
  struct holder h[HOLDERS];
};

// Where each mutex was last initialized and destroyed (the object it belongs to, and who tore it down).
struct life {
  void *volatile lock;
  int init_tid, destroy_tid;
  uint64_t init_ns, destroy_ns;
  int ninit, ndestroy;
  void *init_frames[LFRAMES];
  void *destroy_frames[LFRAMES];
};
static struct life *lives;
static int (*r_mutex_init)(pthread_mutex_t *, const pthread_mutexattr_t *);
static int (*r_mutex_destroy)(pthread_mutex_t *);

static struct slot slots[MAX_SLOTS];
static volatile int nslots;
static struct entry *table;
static volatile uint64_t overflow;
static int want_bt;
static double secs = 15;
static char dir[512] = "/tmp";
static __thread struct slot *me __attribute__((tls_model("initial-exec")));
static __thread int busy __attribute__((tls_model("initial-exec")));

static int (*r_mutex_lock)(pthread_mutex_t *);
static int (*r_mutex_trylock)(pthread_mutex_t *);
static int (*r_mutex_timedlock)(pthread_mutex_t *, const struct timespec *);
static int (*r_mutex_unlock)(pthread_mutex_t *);
static int (*r_rdlock)(pthread_rwlock_t *);
static int (*r_wrlock)(pthread_rwlock_t *);
static int (*r_tryrdlock)(pthread_rwlock_t *);
static int (*r_trywrlock)(pthread_rwlock_t *);
static int (*r_timedrdlock)(pthread_rwlock_t *, const struct timespec *);
static int (*r_timedwrlock)(pthread_rwlock_t *, const struct timespec *);
static int (*r_rw_unlock)(pthread_rwlock_t *);
static int (*r_cond_wait)(pthread_cond_t *, pthread_mutex_t *);
static int (*r_cond_timedwait)(pthread_cond_t *, pthread_mutex_t *, const struct timespec *);
static int (*r_create)(pthread_t *, const pthread_attr_t *, void *(*)(void *), void *);

#define RESOLVE(v, name)                                                                                     \
  do {                                                                                                       \
    if (!v) *(void **)&v = dlsym(RTLD_NEXT, name);                                                           \
  } while (0)

static uint64_t now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

static struct slot *self(void) {
  if (me) return me;
  int i = __atomic_fetch_add(&nslots, 1, __ATOMIC_RELAXED);
  if (i >= MAX_SLOTS) return NULL;
  slots[i].tid = (int)syscall(SYS_gettid);
  me = &slots[i];
  return me;
}

// The element of an open-addressed table (`n` elements of `size` bytes, each starting with its key
// `void *volatile lock`) that holds `lock`, claimed for it when `create`; NULL when absent or full.
static void *probe(void *base, size_t size, size_t n, void *lock, int create) {
  if (!base) return NULL;
  uintptr_t h = ((uintptr_t)lock >> 3) * 0x9E3779B97F4A7C15ull;
  for (unsigned i = 0; i < 64; i++) {
    void *e = (char *)base + ((h + i) % n) * size;
    void *volatile *key = (void *volatile *)e;
    void *cur = *key;
    if (cur == lock) return e;
    if (cur == NULL) {
      if (!create) return NULL;
      void *expected = NULL;
      if (__atomic_compare_exchange_n(key, &expected, lock, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) return e;
      if (expected == lock) return e;
    }
  }
  return NULL;
}

static struct entry *find(void *lock, int create) {
  struct entry *e = probe(table, sizeof *table, TABLE, lock, create);
  if (!e && table && create) __atomic_fetch_add(&overflow, 1, __ATOMIC_RELAXED);
  return e;
}

static void spin_lock(struct entry *e) {
  while (__atomic_exchange_n(&e->spin, 1, __ATOMIC_ACQUIRE)) __builtin_ia32_pause();
}
static void spin_unlock(struct entry *e) { __atomic_store_n(&e->spin, 0, __ATOMIC_RELEASE); }

static void add_holder(void *lock, char mode, void *ra) {
  struct slot *s = self();
  struct entry *e = find(lock, 1);
  if (!s || !e) return;
  struct holder h = {.tid = s->tid, .mode = mode, .ra = ra, .nframes = 0};
  if (want_bt && !busy) {
    busy = 1;
    h.nframes = backtrace(h.frames, FRAMES);
    busy = 0;
  }
  s->acquired++;
  spin_lock(e);
  if (e->n < HOLDERS) e->h[e->n++] = h;
  else __atomic_fetch_add(&overflow, 1, __ATOMIC_RELAXED);
  spin_unlock(e);
}

static void drop_holder(void *lock) {
  struct slot *s = self();
  struct entry *e = find(lock, 0);
  if (!s || !e) return;
  spin_lock(e);
  for (int i = e->n - 1; i >= 0; i--) {
    if (e->h[i].tid == s->tid) {
      e->h[i] = e->h[e->n - 1];
      e->n--;
      break;
    }
  }
  spin_unlock(e);
}

static void begin_wait(void *lock, char kind, void *ra) {
  struct slot *s = self();
  if (!s) return;
  s->wait_kind = kind;
  s->wait_ra = ra;
  s->wait_start = now_ns();
  s->wait_addr = lock;
}
static void end_wait(void) {
  if (me) me->wait_addr = NULL;
}

#define LOCK_HOOK(name, real, type, kind)                                                                    \
  int name(type *l) {                                                                                        \
    RESOLVE(real, #name);                                                                                    \
    void *ra = __builtin_return_address(0);                                                                  \
    begin_wait(l, kind, ra);                                                                                 \
    int r = real(l);                                                                                         \
    end_wait();                                                                                              \
    if (r == 0) add_holder(l, kind, ra);                                                                     \
    return r;                                                                                                \
  }
#define TRY_HOOK(name, real, type, kind)                                                                     \
  int name(type *l) {                                                                                        \
    RESOLVE(real, #name);                                                                                    \
    int r = real(l);                                                                                         \
    if (r == 0) add_holder(l, kind, __builtin_return_address(0));                                            \
    return r;                                                                                                \
  }
#define TIMED_HOOK(name, real, type, kind)                                                                   \
  int name(type *l, const struct timespec *t) {                                                              \
    RESOLVE(real, #name);                                                                                    \
    void *ra = __builtin_return_address(0);                                                                  \
    begin_wait(l, kind, ra);                                                                                 \
    int r = real(l, t);                                                                                      \
    end_wait();                                                                                              \
    if (r == 0) add_holder(l, kind, ra);                                                                     \
    return r;                                                                                                \
  }

LOCK_HOOK(pthread_mutex_lock, r_mutex_lock, pthread_mutex_t, 'M')
TRY_HOOK(pthread_mutex_trylock, r_mutex_trylock, pthread_mutex_t, 'M')
TIMED_HOOK(pthread_mutex_timedlock, r_mutex_timedlock, pthread_mutex_t, 'M')
LOCK_HOOK(pthread_rwlock_rdlock, r_rdlock, pthread_rwlock_t, 'R')
LOCK_HOOK(pthread_rwlock_wrlock, r_wrlock, pthread_rwlock_t, 'W')
TRY_HOOK(pthread_rwlock_tryrdlock, r_tryrdlock, pthread_rwlock_t, 'R')
TRY_HOOK(pthread_rwlock_trywrlock, r_trywrlock, pthread_rwlock_t, 'W')
TIMED_HOOK(pthread_rwlock_timedrdlock, r_timedrdlock, pthread_rwlock_t, 'R')
TIMED_HOOK(pthread_rwlock_timedwrlock, r_timedwrlock, pthread_rwlock_t, 'W')

int pthread_mutex_unlock(pthread_mutex_t *m) {
  RESOLVE(r_mutex_unlock, "pthread_mutex_unlock");
  drop_holder(m);
  return r_mutex_unlock(m);
}
int pthread_rwlock_unlock(pthread_rwlock_t *l) {
  RESOLVE(r_rw_unlock, "pthread_rwlock_unlock");
  drop_holder(l);
  return r_rw_unlock(l);
}
int pthread_cond_wait(pthread_cond_t *c, pthread_mutex_t *m) {
  RESOLVE(r_cond_wait, "pthread_cond_wait");
  void *ra = __builtin_return_address(0);
  drop_holder(m);
  begin_wait(c, 'C', ra);
  int r = r_cond_wait(c, m);
  end_wait();
  add_holder(m, 'M', ra);
  return r;
}
int pthread_cond_timedwait(pthread_cond_t *c, pthread_mutex_t *m, const struct timespec *t) {
  RESOLVE(r_cond_timedwait, "pthread_cond_timedwait");
  void *ra = __builtin_return_address(0);
  drop_holder(m);
  begin_wait(c, 'T', ra);
  int r = r_cond_timedwait(c, m, t);
  end_wait();
  add_holder(m, 'M', ra);
  return r;
}

static struct life *life_of(void *lock, int create) { return probe(lives, sizeof *lives, LIFE, lock, create); }

int pthread_mutex_init(pthread_mutex_t *m, const pthread_mutexattr_t *a) {
  RESOLVE(r_mutex_init, "pthread_mutex_init");
  int r = r_mutex_init(m, a);
  struct life *e = busy ? NULL : life_of(m, 1);
  if (e) {
    busy = 1;
    struct slot *s = self();
    e->init_tid = s ? s->tid : 0;
    e->init_ns = now_ns();
    e->ninit = backtrace(e->init_frames, LFRAMES);
    busy = 0;
  }
  struct entry *t = find(m, 0);
  if (t) t->n = 0;
  return r;
}

int pthread_mutex_destroy(pthread_mutex_t *m) {
  RESOLVE(r_mutex_destroy, "pthread_mutex_destroy");
  int r = r_mutex_destroy(m);
  struct life *e = busy ? NULL : life_of(m, 1);
  if (e && r == 0) {
    busy = 1;
    struct slot *s = self();
    e->destroy_tid = s ? s->tid : 0;
    e->destroy_ns = now_ns();
    e->ndestroy = backtrace(e->destroy_frames, LFRAMES);
    busy = 0;
  }
  return r;
}

static void where(FILE *f, void *addr) {
  Dl_info info;
  if (addr && dladdr(addr, &info) && info.dli_fname) {
    const char *b = strrchr(info.dli_fname, '/');
    fprintf(f, "%s+0x%lx", b ? b + 1 : info.dli_fname, (unsigned long)((char *)addr - (char *)info.dli_fbase));
    if (info.dli_sname) fprintf(f, "(%s)", info.dli_sname);
  } else {
    fprintf(f, "%p", addr);
  }
}

static int alive(int tid, char *comm, size_t n) {
  char p[64];
  snprintf(p, sizeof p, "/proc/self/task/%d/comm", tid);
  FILE *f = fopen(p, "r");
  if (!f) {
    snprintf(comm, n, "(exited)");
    return 0;
  }
  if (!fgets(comm, (int)n, f)) comm[0] = 0;
  comm[strcspn(comm, "\n")] = 0;
  fclose(f);
  return 1;
}

static void print_lock_state(FILE *f, void *lock, char kind) {
  if (kind == 'M') {
    pthread_mutex_t *m = lock;
    fprintf(f, "  glibc: mutex lock=%d owner=%d count=%u kind=%d\n", m->__data.__lock, m->__data.__owner,
            m->__data.__count, m->__data.__kind);
    struct life *e = life_of(lock, 0);
    uint64_t t = now_ns();
    if (!e) {
      fprintf(f, "  initialized and destroyed: not seen\n");
    } else {
      fprintf(f, "  last initialized by tid %d %.3f s ago:\n", e->init_tid, (double)(int64_t)(t - e->init_ns) / 1e9);
      for (int k = 0; k < e->ninit; k++) {
        fprintf(f, "      #%d ", k);
        where(f, e->init_frames[k]);
        fprintf(f, "\n");
      }
      if (e->ndestroy)
        fprintf(f, "  last destroyed by tid %d %.3f s ago:\n", e->destroy_tid,
                (double)(int64_t)(t - e->destroy_ns) / 1e9);
      else
        fprintf(f, "  never destroyed\n");
      for (int k = 0; k < e->ndestroy; k++) {
        fprintf(f, "      #%d ", k);
        where(f, e->destroy_frames[k]);
        fprintf(f, "\n");
      }
    }
  } else if (kind == 'R' || kind == 'W') {
    pthread_rwlock_t *l = lock;
    unsigned rd = l->__data.__readers;
    fprintf(f, "  glibc: rwlock readers=%u%s%s%s writers=%u cur_writer=%d flags=%u\n", rd >> 3,
            (rd & 1) ? " WRPHASE" : "", (rd & 2) ? " WRLOCKED" : "", (rd & 4) ? " RWAITING" : "",
            l->__data.__writers, l->__data.__cur_writer, l->__data.__flags);
  }
}

static void print_holders(FILE *f, struct entry *e) {
  int n = e->n;
  if (n == 0) fprintf(f, "  holders recorded: none\n");
  for (int i = 0; i < n && i < HOLDERS; i++) {
    struct holder h = e->h[i];
    char comm[64];
    int a = alive(h.tid, comm, sizeof comm);
    fprintf(f, "  held %c by tid %d [%s]%s since site ", h.mode, h.tid, comm, a ? "" : " EXITED");
    where(f, h.ra);
    fprintf(f, "\n");
    for (int k = 0; k < h.nframes; k++) {
      fprintf(f, "      #%d ", k);
      where(f, h.frames[k]);
      fprintf(f, "\n");
    }
    // What the holder does now.
    for (int j = 0; j < nslots && j < MAX_SLOTS; j++) {
      if (slots[j].tid == h.tid && slots[j].wait_addr) {
        fprintf(f, "      and now waits %c on %p at ", slots[j].wait_kind, slots[j].wait_addr);
        where(f, slots[j].wait_ra);
        fprintf(f, "\n");
      }
    }
  }
}

static void dump(int seq) {
  char path[600];
  snprintf(path, sizeof path, "%s/lockwatch-%d-%d.txt", dir, (int)getpid(), seq);
  FILE *f = fopen(path, "w");
  if (!f) return;
  uint64_t t = now_ns();
  int n = nslots < MAX_SLOTS ? nslots : MAX_SLOTS;
  fprintf(f, "# lockwatch pid %d: a thread waited on a lock for more than %.0f s; %d threads seen; table "
             "overflow %lu\n",
          (int)getpid(), secs, n, (unsigned long)overflow);
  fprintf(f, "## waiting threads\n");
  for (int i = 0; i < n; i++) {
    struct slot *s = &slots[i];
    void *w = s->wait_addr;
    if (!w) continue;
    char comm[64];
    alive(s->tid, comm, sizeof comm);
    fprintf(f, "tid %d [%s] waits %c on %p for %.1f s at ", s->tid, comm, s->wait_kind, w,
            (double)(t - s->wait_start) / 1e9);
    where(f, s->wait_ra);
    fprintf(f, "\n");
  }
  fprintf(f, "## the locks waited on\n");
  void *seen[MAX_SLOTS];
  int nseen = 0;
  for (int i = 0; i < n; i++) {
    struct slot *s = &slots[i];
    void *w = s->wait_addr;
    char kind = s->wait_kind;
    if (!w || kind == 'C' || kind == 'T') continue;
    int dup = 0;
    for (int k = 0; k < nseen; k++) dup |= seen[k] == w;
    if (dup) continue;
    seen[nseen++] = w;
    fprintf(f, "lock %p (%c)\n", w, kind);
    print_lock_state(f, w, kind);
    struct entry *e = find(w, 0);
    if (e) print_holders(f, e);
    else fprintf(f, "  never acquired through the hooks\n");
  }
  fprintf(f, "## every lock held by a thread that has exited\n");
  for (int i = 0; i < TABLE; i++) {
    struct entry *e = &table[i];
    for (int k = 0; k < e->n && k < HOLDERS; k++) {
      char comm[64];
      if (!alive(e->h[k].tid, comm, sizeof comm)) {
        fprintf(f, "lock %p held %c by exited tid %d since ", e->lock, e->h[k].mode, e->h[k].tid);
        where(f, e->h[k].ra);
        fprintf(f, "\n");
        for (int j = 0; j < e->h[k].nframes; j++) {
          fprintf(f, "      #%d ", j);
          where(f, e->h[k].frames[j]);
          fprintf(f, "\n");
        }
      }
    }
  }
  fprintf(f, "## every lock held now (lock: holders)\n");
  for (int i = 0; i < TABLE; i++) {
    struct entry *e = &table[i];
    if (e->n == 0) continue;
    fprintf(f, "%p:", e->lock);
    for (int k = 0; k < e->n && k < HOLDERS; k++) {
      fprintf(f, " %c/%d@", e->h[k].mode, e->h[k].tid);
      where(f, e->h[k].ra);
    }
    fprintf(f, "\n");
  }
  fclose(f);
  fprintf(stderr, "lockwatch: wrote %s\n", path);
}

static void *watcher(void *arg) {
  (void)arg;
  int seq = 0;
  uint64_t last = 0;
  for (;;) {
    usleep(500000);
    uint64_t t = now_ns();
    int n = nslots < MAX_SLOTS ? nslots : MAX_SLOTS;
    int stuck = 0;
    for (int i = 0; i < n; i++) {
      uint64_t s1 = slots[i].wait_start;
      void *w = slots[i].wait_addr;
      char k = slots[i].wait_kind;
      uint64_t s2 = slots[i].wait_start;
      if (w && s1 == s2 && k != 'C' && k != 'T' && (int64_t)(t - s1) > (int64_t)(secs * 1e9)) stuck = 1;
    }
    if (stuck && seq < 3 && (last == 0 || t - last > (uint64_t)(secs * 1e9))) {
      dump(++seq);
      last = t;
    }
  }
  return NULL;
}

__attribute__((constructor)) static void init(void) {
  RESOLVE(r_mutex_lock, "pthread_mutex_lock");
  RESOLVE(r_mutex_unlock, "pthread_mutex_unlock");
  RESOLVE(r_rw_unlock, "pthread_rwlock_unlock");
  RESOLVE(r_create, "pthread_create");
  const char *d = getenv("LOCKWATCH_DIR");
  if (d) snprintf(dir, sizeof dir, "%s", d);
  const char *s = getenv("LOCKWATCH_SECS");
  if (s && atof(s) > 0) secs = atof(s);
  want_bt = getenv("LOCKWATCH_BT") && atoi(getenv("LOCKWATCH_BT")) > 0;
  table = calloc(TABLE, sizeof(struct entry));
  lives = calloc(LIFE, sizeof(struct life));
  void *warm[2];
  backtrace(warm, 2);
  pthread_t t;
  pthread_attr_t a;
  pthread_attr_init(&a);
  pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
  if (r_create) r_create(&t, &a, watcher, NULL);
}
