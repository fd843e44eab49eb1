/* The Viterbi search of quantkit.schemes.trellis_viterbi in C: LANES sequences at once, one per vector lane.
 *
 * The same recursion as the torch search (see that module's docstring): with the 2^L states laid out as
 * s = j·M + r (M = 2^(L-kV), j the top kV bits), step t's cost of state s is
 *     prev[s >> kV] + Σ_v feat[t][v] · dist[v][s]
 * where prev is the best cost among s's 2^kV predecessors at step t-1. Step t's costs are never stored whole: while
 * they are computed, each is folded into next[r] = min_j cost(j·M + r), the best-predecessor costs of step t+1, and
 * the winning j is kept as that step's backpointer (one byte; kV <= 8). The lanes make every operation a vector
 * operation with no gathers: costs are [state][lane], the distortion table [F][2^L] is shared by all lanes.
 * GCC's and Clang's vector extensions keep it portable: the compiler picks the machine's vector width.
 *
 * A step's shared bits r can be split between threads (each writes its own r, reads any of the previous step's):
 * GPTQ asks for a few sequences at a time (one column block of tiles), too few to give every core a group of lanes.
 *
 * Layouts (float32 unless said; C order):
 *   feat   [n][F][LANES]  step t's features (w_v, -2 w_v x_v) per lane, F = 2V
 *   dist   [F][2^L]       c_v^2 then c_v per state
 *   init   [M][LANES]     step 0's predecessor costs (0, or inf outside a start overlap)
 *   end    [LANES] int32  the overlap the last state's low L-kV bits must equal, or -1 for none
 *   back   [n][M][LANES] uint8 scratch;  buf0, buf1 [M][LANES] scratch
 *   states [LANES][n] int32 out;  cost [LANES] out: the path's cost without the constant Σ w x^2
 */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#define LANES 16
#define MAX_THREADS 64
#define SPINS 20000  /* ~20-40 us of spinning before a waiting thread sleeps */
typedef float vfloat __attribute__((vector_size(4 * LANES)));
typedef int32_t vint __attribute__((vector_size(4 * LANES)));
typedef uint8_t vbyte __attribute__((vector_size(LANES)));
/* a where the lane mask m is set, else b (C has no vector ?:) */
#define SELECT(m, a, b) ((__typeof__(a))(((vint)(a) & (m)) | ((vint)(b) & ~(m))))

int64_t trellis_lanes(void) { return LANES; }

static inline vfloat state_cost(int F, const vfloat *f, const float *dist, int64_t N, int64_t s, vfloat prev) {
    vfloat c = prev;
    for (int v = 0; v < F; v++) c += f[v] * dist[v * N + s];
    return c;
}

/* One step t < n-1 for the shared bits r in [r0, r1): next[r] = min_j cost(j·M + r), back[r] = the minimizing j.
 * F is a constant at each call site, so the compiler unrolls the distortion's sum. */
static inline void step(int F, const vfloat *f, const float *dist, int64_t L, int64_t kV, const vfloat *restrict prev,
                        vfloat *restrict next, vbyte *restrict back, int64_t r0, int64_t r1) {
    const int64_t N = (int64_t)1 << L, M = N >> kV, P = (int64_t)1 << kV;
    for (int64_t r = r0; r < r1; r++) {
        next[r] = state_cost(F, f, dist, N, r, prev[r >> kV]);
        back[r] = (vbyte){0};
    }
    for (int64_t j = 1; j < P; j++) {
        const vbyte top = (vbyte){0} + (uint8_t)j;
        for (int64_t r = r0; r < r1; r++) {
            const int64_t s = j * M + r;
            const vfloat c = state_cost(F, f, dist, N, s, prev[s >> kV]);
            const vint better = c < next[r];
            const vbyte better8 = __builtin_convertvector(better, vbyte);
            next[r] = SELECT(better, c, next[r]);
            back[r] = (top & better8) | (back[r] & ~better8);
        }
    }
}

/* What the threads of one search share. */
typedef struct {
    int64_t n, F, L, kV, threads;
    const vfloat *feat, *init;
    const float *dist;
    uint8_t *back;
    vfloat *bufs[2];
    atomic_int arrived, generation, sleepers;
    atomic_int go;  /* 0 wait, 1 run, -1 leave (a thread could not start) */
    pthread_mutex_t lock;
    pthread_cond_t wake;
} search_t;

typedef struct {
    search_t *search;
    int64_t id;
} worker_t;

/* Waits until *x != value: spins a while (the other threads' share of a step is tens of microseconds), then sleeps
 * (a machine busier than its threads would let a spinning thread hold the core its peers need). Every change of x
 * is followed by wake_all: a sleeper counts itself before it checks x, the changer checks for sleepers after the
 * change (both sequentially consistent), so one of the two sees the other. */
static int wait_while(search_t *a, atomic_int *x, int value) {
    int now;
    for (int spins = 0; spins < SPINS; spins++)
        if ((now = atomic_load(x)) != value) return now;
    pthread_mutex_lock(&a->lock);
    atomic_fetch_add(&a->sleepers, 1);
    while ((now = atomic_load(x)) == value) pthread_cond_wait(&a->wake, &a->lock);
    atomic_fetch_sub(&a->sleepers, 1);
    pthread_mutex_unlock(&a->lock);
    return now;
}

static void wake_all(search_t *a) {
    if (atomic_load(&a->sleepers) > 0) {
        pthread_mutex_lock(&a->lock);
        pthread_cond_broadcast(&a->wake);
        pthread_mutex_unlock(&a->lock);
    }
}

/* Every thread waits here until all have arrived: step t+1 reads what every thread wrote at step t. */
static void barrier(search_t *a) {
    const int generation = atomic_load(&a->generation);
    if (atomic_fetch_add(&a->arrived, 1) == a->threads - 1) {
        atomic_store(&a->arrived, 0);
        atomic_fetch_add(&a->generation, 1);
        wake_all(a);
        return;
    }
    wait_while(a, &a->generation, generation);
}

/* Steps 0 .. n-2 of this worker's share of the shared bits. */
static void *steps(void *arg) {
    const worker_t *w = arg;
    search_t *a = w->search;
    if (wait_while(a, &a->go, 0) < 0) return NULL;
    const int64_t M = ((int64_t)1 << a->L) >> a->kV;
    const int64_t r0 = M * w->id / a->threads, r1 = M * (w->id + 1) / a->threads;
    const vfloat *prev = a->init;
    for (int64_t t = 0; t + 1 < a->n; t++) {
        vbyte *b = (vbyte *)(a->back + (t + 1) * M * LANES);
        vfloat *next = a->bufs[t & 1];
        if (a->F == 2)
            step(2, a->feat + t * 2, a->dist, a->L, a->kV, prev, next, b, r0, r1);
        else
            step(4, a->feat + t * 4, a->dist, a->L, a->kV, prev, next, b, r0, r1);
        if (a->threads > 1) barrier(a);
        prev = next;
    }
    return NULL;
}

/* threads: how many threads split each step (1: the caller's alone). */
void trellis_search(int64_t n, int64_t F, int64_t L, int64_t kV, int64_t threads, const float *feat,
                    const float *dist, const float *init, const int32_t *end, uint8_t *back, float *buf0, float *buf1,
                    int32_t *states, float *cost) {
    const int64_t N = (int64_t)1 << L, M = N >> kV;
    search_t a = {.n = n, .F = F, .L = L, .kV = kV, .threads = 1, .feat = (const vfloat *)feat,
                  .init = (const vfloat *)init, .dist = dist, .back = back, .bufs = {(vfloat *)buf0, (vfloat *)buf1}};
    atomic_init(&a.arrived, 0);
    atomic_init(&a.generation, 0);
    atomic_init(&a.go, 0);
    atomic_init(&a.sleepers, 0);
    pthread_mutex_init(&a.lock, NULL);
    pthread_cond_init(&a.wake, NULL);
    /* a share of fewer than 256 shared bits is not worth a barrier per step */
    int64_t want = threads < MAX_THREADS ? threads : MAX_THREADS;
    while (want > 1 && M / want < 256) want--;
    pthread_t helpers[MAX_THREADS];
    worker_t workers[MAX_THREADS];
    for (int64_t i = 0; i < want; i++) workers[i] = (worker_t){&a, i};
    int64_t started = 1;
    while (started < want && pthread_create(&helpers[started], NULL, steps, &workers[started]) == 0) started++;
    if (started < want) {  /* the system refused a thread: the started ones leave, the caller searches alone */
        atomic_store(&a.go, -1);
        wake_all(&a);
        for (int64_t i = 1; i < started; i++) pthread_join(helpers[i], NULL);
        started = 1;
    }
    a.threads = started;  /* the shares are fixed before any worker runs */
    atomic_store(&a.go, 1);
    wake_all(&a);
    steps(&workers[0]);
    for (int64_t i = 1; i < started; i++) pthread_join(helpers[i], NULL);
    pthread_cond_destroy(&a.wake);
    pthread_mutex_destroy(&a.lock);
    const vfloat *prev = n > 1 ? a.bufs[(n - 2) & 1] : a.init;

    /* The last step: the least cost over the states the end overlap allows (all where end is -1). */
    vfloat best = (vfloat){0} + INFINITY;
    vint at = (vint){0}, want_end;
    for (int l = 0; l < LANES; l++) want_end[l] = end[l];
    const vfloat *f = a.feat + (n - 1) * F;
    for (int64_t s = 0; s < N; s++) {
        const vfloat c = state_cost((int)F, f, dist, N, s, prev[s >> kV]);
        const vint ok = ((want_end < 0) | (want_end == (int32_t)(s & (M - 1)))) & (c < best);
        best = SELECT(ok, c, best);
        at = SELECT(ok, (vint){0} + (int32_t)s, at);
    }
    /* The backtrack: the predecessor of s at step t is back[t][s >> kV]·M + (s >> kV). */
    for (int l = 0; l < LANES; l++) {
        int64_t s = at[l];
        cost[l] = best[l];
        states[l * n + n - 1] = (int32_t)s;
        for (int64_t t = n - 1; t > 0; t--) {
            const int64_t m = s >> kV;
            s = (int64_t)back[(t * M + m) * LANES + l] * M + m;
            states[l * n + t - 1] = (int32_t)s;
        }
    }
}
