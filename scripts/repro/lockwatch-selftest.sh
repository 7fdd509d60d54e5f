#!/usr/bin/env bash
# Host self-test of scripts/repro/lockwatch.c (the LD_PRELOAD shim that found issue 33's driver race), so
# that the diagnostic still works when the next stall comes: builds it with gcc, runs three small programs
# under it that stop on purpose, and checks that each dump names what happened:
#   - a lock-order cycle: each holder is named, and what it waits on;
#   - a rwlock held by a thread that has exited;
#   - a recursive (robust) mutex destroyed while a thread waits to take it (glibc's kind -1, as in issue 33), with
#     the stacks of its initialization and destruction.
# Prints 'lockwatch self-test: N passed, N failed'. Needs gcc and glibc (run by scripts/test.sh).
set -u
cd "$(dirname "$0")/../.." || exit 1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
gcc -O2 -Wall -Wextra -Werror -shared -fPIC -o "$work/lockwatch.so" scripts/repro/lockwatch.c -ldl -lpthread || exit 1
cat > "$work/cases.c" <<'C'
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
static pthread_mutex_t m = PTHREAD_MUTEX_INITIALIZER, *rm;
static pthread_rwlock_t rw = PTHREAD_RWLOCK_INITIALIZER, leaked = PTHREAD_RWLOCK_INITIALIZER;
static void *cycle_a(void *x) { pthread_rwlock_rdlock(&rw); sleep(1); pthread_mutex_lock(&m); return x; }
static void *cycle_b(void *x) { pthread_mutex_lock(&m); sleep(1); pthread_rwlock_wrlock(&rw); return x; }
static void *exit_reader(void *x) { pthread_rwlock_rdlock(&leaked); return x; }
static void *late_writer(void *x) { sleep(1); pthread_rwlock_wrlock(&leaked); return x; }
/* The destroyed case, ordered so that no machine's load can reorder it: the destroyer locks rm, the waiter
 * starts to wait on it, and once it waits the destroyer destroys rm while holding it (glibc allows that for a robust
 * mutex; issue 33's mutex was destroyed between its unlock and a woken waiter's return, a race that cannot be
 * staged reliably). The waiter's wait, 2.5 s in, triggers the dump, about 2 s after the destroy. */
static void *destroyer(void *x) {
  pthread_mutex_lock(rm);
  /* The waiter is committed to wait once it set the futex's waiters bit in the lock word (glibc's robust
   * mutex: owner tid | FUTEX_WAITERS): from then on the destroy cannot make it return. */
  while (!(__atomic_load_n(&rm->__data.__lock, __ATOMIC_ACQUIRE) & 0x80000000)) usleep(10000);
  if (pthread_mutex_destroy(rm) != 0) fprintf(stderr, "cases: the destroy was refused\n");
  sleep(100); return x;
}
static void *waiter(void *x) { usleep(100000); pthread_mutex_lock(rm); return x; }
int main(int argc, char **argv) {
  pthread_t t[3];
  if (argc < 2) return 2;
  if (!strcmp(argv[1], "cycle")) {
    pthread_create(&t[0], 0, cycle_a, 0); pthread_create(&t[1], 0, cycle_b, 0);
  } else if (!strcmp(argv[1], "exited")) {
    pthread_create(&t[0], 0, exit_reader, 0); pthread_join(t[0], 0); pthread_create(&t[1], 0, late_writer, 0);
  } else {
    pthread_mutexattr_t a; pthread_mutexattr_init(&a); pthread_mutexattr_settype(&a, PTHREAD_MUTEX_RECURSIVE);
    pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
    rm = malloc(sizeof *rm); pthread_mutex_init(rm, &a);
    pthread_create(&t[0], 0, destroyer, 0); pthread_create(&t[1], 0, waiter, 0);
  }
  sleep(5);
  return 0;
}
C
gcc -O0 -g -o "$work/cases" "$work/cases.c" -lpthread || exit 1
pass=0 fail=0
check() { # case description pattern...
  local case=$1 what=$2; shift 2
  local ok=0 p dump try
  # Up to three tries: every case is ordered (deadlocks, flags), so a retry is only for a machine so loaded
  # that a dump comes later than the program's 5 s.
  for try in 1 2 3; do
    rm -f "$work"/lockwatch-*.txt
    LD_PRELOAD="$work/lockwatch.so" LOCKWATCH_DIR="$work" LOCKWATCH_SECS=2.5 "$work/cases" "$case" > /dev/null 2>&1
    dump=$(ls "$work"/lockwatch-*-1.txt 2>/dev/null | head -1)
    ok=1
    if [ -z "$dump" ]; then ok=0; else for p in "$@"; do grep -qE -- "$p" "$dump" || { ok=0; [ "$try" = 3 ] && echo "  missing: $p"; }; done; fi
    [ "$ok" = 1 ] && break
  done
  if [ "$ok" = 1 ]; then pass=$((pass+1)); echo "ok: $what"; else fail=$((fail+1)); echo "FAILED: $what"; [ -n "$dump" ] && sed 's/^/  | /' "$dump" | head -40; fi
}
check cycle "a lock-order cycle names both holders and what each waits on" \
  'held R by tid [0-9]+' 'and now waits M on' 'held M by tid [0-9]+' 'and now waits W on'
check exited "a rwlock held by an exited thread" \
  'held R by exited tid [0-9]+' 'EXITED'
check destroyed "a mutex destroyed while waited on, with its init and destroy stacks" \
  'glibc: mutex lock=-?[0-9]+ owner=[0-9]+ count=1 kind=-1' 'last initialized by tid' 'last destroyed by tid' \
  'pthread_mutex_destroy'
echo "lockwatch self-test: $pass passed, $fail failed"
[ "$fail" = 0 ]
