/* The KV block index in C: which worker holds which block, keyed by sequence hash.
 *
 * Why C (measured with benchmarks/router/radix_api.py, 100 workers x 2,000 blocks, one round on a shared
 * 2-core machine): the pure-Python index (dicts of sequence hash -> worker bitmask, msgspec decoding)
 * applied 19,200 events/s through RadixTree.apply_event and 28,400 through KvIndexer, where Dynamo 1.6.1's
 * Rust binding applied 69,300 (0.28x and 0.41x); 16 blocks an event cost about 2 us each in Python (a
 * dict lookup, a hash, a dict store per block, plus decoding), and find_matches hashed the whole prompt
 * (256 Python xxh3 calls) before looking at the index.  Here an event is parsed straight from its JSON
 * bytes (the exact shapes the engines send; anything else goes back to the Python parser, which says
 * what is wrong), sequence hashes are computed inline, and the walk hashes a query's blocks only as far
 * as some worker still matches.  Figures: docs/routing.md ("The index at fleet scale").
 *
 * Data: an open-addressing table (linear probing, backward-shift deletion) of u64 -> u64 for the
 * holders (sequence hash -> one worker's index, or a sorted set of worker indices) and one per worker
 * (its block names -> sequence hashes).  Workers are Python objects (ints) mapped to small indices,
 * given out in order and reused last-freed-first after a worker is removed.
 *
 * The sequence hash is xxh3-64 (seed 1337) of 16 bytes: LE64(parent) || LE64(local); xxh3's 9-16 byte
 * case needs only the two constants derived from its default secret and the seed (checked against the
 * xxhash package by tests/unit/kv/test_blockcore.py).
 *
 * Not thread-safe by itself: every entry point runs with the GIL held and never releases it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

/* ---------------------------------------------------------------- sequence hash (xxh3-64, 16 bytes) */
static const uint8_t XXH3_SECRET_24_56[32] = {
    0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f, 0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78,
    0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21, 0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e,
};
#define KV_HASH_SEED 1337ULL

static uint64_t flip_lo, flip_hi;

static uint64_t read_le64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

static void init_flips(void) {
    flip_lo = (read_le64(XXH3_SECRET_24_56) ^ read_le64(XXH3_SECRET_24_56 + 8)) + KV_HASH_SEED;
    flip_hi = (read_le64(XXH3_SECRET_24_56 + 16) ^ read_le64(XXH3_SECRET_24_56 + 24)) - KV_HASH_SEED;
}

static inline uint64_t seq_hash(uint64_t parent, uint64_t local) {
    uint64_t lo = parent ^ flip_lo, hi = local ^ flip_hi;
    __uint128_t m = (__uint128_t)lo * hi;
    uint64_t acc = 16 + __builtin_bswap64(lo) + hi + ((uint64_t)m ^ (uint64_t)(m >> 64));
    acc ^= acc >> 37;
    acc *= 0x165667919E3779F9ULL;
    acc ^= acc >> 32;
    return acc;
}

/* ---------------------------------------------------------------- u64 -> u64 table */
typedef struct { uint64_t k, v; } Slot;
typedef struct {
    Slot *slots;   /* key 0 marks an empty slot; the key 0 itself lives in zero_* */
    size_t cap;    /* a power of two, or 0 */
    size_t n;      /* entries, the key 0 included */
    int has_zero;
    uint64_t zero_val;
} Map;

static inline size_t slot_of(const Map *m, uint64_t k) {
    return (size_t)((k * 0x9E3779B97F4A7C15ULL) >> 32) & (m->cap - 1);
}

static int map_get(const Map *m, uint64_t k, uint64_t *v) {
    if (k == 0) {
        if (m->has_zero) *v = m->zero_val;
        return m->has_zero;
    }
    if (!m->cap) return 0;
    for (size_t i = slot_of(m, k);; i = (i + 1) & (m->cap - 1)) {
        if (m->slots[i].k == k) { *v = m->slots[i].v; return 1; }
        if (m->slots[i].k == 0) return 0;
    }
}

/* Tables from 4 MiB up are mapped on their own, asking for huge pages: a walk touches one random slot
 * per block, and with 4 KiB pages most of those also miss the TLB. */
#define BIG_TABLE (4u << 20)

static Slot *slots_alloc(size_t cap) {
    size_t bytes = cap * sizeof(Slot);
    if (bytes < BIG_TABLE) return calloc(cap, sizeof(Slot));
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return NULL;
#ifdef MADV_HUGEPAGE
    madvise(p, bytes, MADV_HUGEPAGE);
#endif
    return p;
}

static void slots_free(Slot *slots, size_t cap) {
    if (!slots) return;
    if (cap * sizeof(Slot) < BIG_TABLE) free(slots);
    else munmap(slots, cap * sizeof(Slot));
}

static inline void map_prefetch(const Map *m, uint64_t k) {
    if (m->cap) __builtin_prefetch(&m->slots[slot_of(m, k)]);
}

static int map_grow(Map *m) {
    size_t cap = m->cap ? m->cap * 2 : 8;
    Slot *fresh = slots_alloc(cap);
    if (!fresh) { PyErr_NoMemory(); return -1; }
    Slot *old = m->slots;
    size_t old_cap = m->cap;
    m->slots = fresh;
    m->cap = cap;
    for (size_t j = 0; j < old_cap; j++) {
        if (old[j].k == 0) continue;
        size_t i = slot_of(m, old[j].k);
        while (fresh[i].k) i = (i + 1) & (cap - 1);
        fresh[i] = old[j];
    }
    slots_free(old, old_cap);
    return 0;
}

/* insert or overwrite; -1 on no memory */
static int map_put(Map *m, uint64_t k, uint64_t v) {
    if (k == 0) {
        m->n += !m->has_zero;
        m->has_zero = 1;
        m->zero_val = v;
        return 0;
    }
    if (m->cap) {
        size_t i = slot_of(m, k);
        while (m->slots[i].k && m->slots[i].k != k) i = (i + 1) & (m->cap - 1);
        if (m->slots[i].k == k) { m->slots[i].v = v; return 0; }
    }
    if ((m->n + 1) * 4 > m->cap * 3 && map_grow(m) < 0) return -1;
    size_t i = slot_of(m, k);
    while (m->slots[i].k) i = (i + 1) & (m->cap - 1);
    m->slots[i].k = k;
    m->slots[i].v = v;
    m->n++;
    return 0;
}

static int map_del(Map *m, uint64_t k, uint64_t *old) {
    if (k == 0) {
        if (!m->has_zero) return 0;
        *old = m->zero_val;
        m->has_zero = 0;
        m->n--;
        return 1;
    }
    if (!m->cap) return 0;
    size_t mask = m->cap - 1, i = slot_of(m, k);
    for (;; i = (i + 1) & mask) {
        if (m->slots[i].k == k) break;
        if (m->slots[i].k == 0) return 0;
    }
    *old = m->slots[i].v;
    m->n--;
    /* backward shift: move later entries of the run into the hole when their home allows it */
    size_t hole = i;
    for (size_t j = (i + 1) & mask; m->slots[j].k; j = (j + 1) & mask) {
        size_t home = slot_of(m, m->slots[j].k);
        if (((j - home) & mask) >= ((j - hole) & mask)) {
            m->slots[hole] = m->slots[j];
            hole = j;
        }
    }
    m->slots[hole].k = 0;
    m->slots[hole].v = 0;
    return 1;
}

static void map_free(Map *m) {
    slots_free(m->slots, m->cap);
    memset(m, 0, sizeof(*m));
}

/* ---------------------------------------------------------------- worker sets */
/* A holders value: (worker index << 1) for one holder, (set index << 1) | 1 for two or more. */
typedef struct { uint32_t n, cap; uint32_t *w; } WSet;

typedef struct {
    PyObject *key;  /* the worker, as the caller names it; NULL for a free index */
    Map lookup;     /* block name -> sequence hash */
} Worker;

typedef struct {
    PyObject_HEAD
    Map holders;
    Worker *workers;
    uint32_t nworkers, capworkers;
    uint32_t *free_idx;  /* indices of removed workers, reused last first */
    uint32_t nfree, capfree;
    PyObject *by_key;    /* dict: worker key -> index (insertion order = workers()) */
    WSet *sets;
    uint32_t nsets, capsets;
    uint32_t *free_sets;
    uint32_t nfree_sets, capfree_sets;
    uint32_t *scratch;   /* the walk's active workers */
    uint32_t capscratch;
} Index;

static int grow_u32(uint32_t **arr, uint32_t *cap, uint32_t need) {
    if (need <= *cap) return 0;
    uint32_t c = *cap ? *cap : 8;
    while (c < need) c *= 2;
    uint32_t *fresh = realloc(*arr, (size_t)c * sizeof(uint32_t));
    if (!fresh) { PyErr_NoMemory(); return -1; }
    *arr = fresh;
    *cap = c;
    return 0;
}

static int64_t new_set(Index *ix, uint32_t a, uint32_t b) {
    uint32_t s;
    if (ix->nfree_sets) {
        s = ix->free_sets[--ix->nfree_sets];
    } else {
        if (ix->nsets == ix->capsets) {
            uint32_t c = ix->capsets ? ix->capsets * 2 : 64;
            WSet *fresh = realloc(ix->sets, (size_t)c * sizeof(WSet));
            if (!fresh) { PyErr_NoMemory(); return -1; }
            ix->sets = fresh;
            ix->capsets = c;
        }
        s = ix->nsets++;
        ix->sets[s].w = NULL;
        ix->sets[s].cap = 0;
    }
    WSet *set = &ix->sets[s];
    set->n = 0;
    if (grow_u32(&set->w, &set->cap, 2) < 0) return -1;
    set->w[0] = a < b ? a : b;
    set->w[1] = a < b ? b : a;
    set->n = 2;
    return s;
}

static void drop_set(Index *ix, uint32_t s) {
    WSet *set = &ix->sets[s];
    free(set->w);
    set->w = NULL;
    set->n = set->cap = 0;
    if (grow_u32(&ix->free_sets, &ix->capfree_sets, ix->nfree_sets + 1) == 0)
        ix->free_sets[ix->nfree_sets++] = s;
    else
        PyErr_Clear();  /* the slot is only lost for reuse */
}

/* first position in the sorted set whose worker is >= w */
static uint32_t set_find(const WSet *set, uint32_t w) {
    uint32_t lo = 0, hi = set->n;
    while (lo < hi) {
        uint32_t mid = (lo + hi) / 2;
        if (set->w[mid] < w) lo = mid + 1; else hi = mid;
    }
    return lo;
}

static int add_holder(Index *ix, uint64_t seq, uint32_t w) {
    uint64_t v;
    if (!map_get(&ix->holders, seq, &v)) return map_put(&ix->holders, seq, (uint64_t)w << 1);
    if (!(v & 1)) {
        uint32_t only = (uint32_t)(v >> 1);
        if (only == w) return 0;
        int64_t s = new_set(ix, only, w);
        if (s < 0) return -1;
        return map_put(&ix->holders, seq, ((uint64_t)s << 1) | 1);
    }
    WSet *set = &ix->sets[v >> 1];
    uint32_t pos = set_find(set, w);
    if (pos < set->n && set->w[pos] == w) return 0;
    if (grow_u32(&set->w, &set->cap, set->n + 1) < 0) return -1;
    memmove(set->w + pos + 1, set->w + pos, (size_t)(set->n - pos) * sizeof(uint32_t));
    set->w[pos] = w;
    set->n++;
    return 0;
}

static void clear_holder(Index *ix, uint64_t seq, uint32_t w) {
    uint64_t v, old;
    if (!map_get(&ix->holders, seq, &v)) return;
    if (!(v & 1)) {
        if ((uint32_t)(v >> 1) == w) map_del(&ix->holders, seq, &old);
        return;
    }
    uint32_t s = (uint32_t)(v >> 1);
    WSet *set = &ix->sets[s];
    uint32_t pos = set_find(set, w);
    if (pos >= set->n || set->w[pos] != w) return;
    memmove(set->w + pos, set->w + pos + 1, (size_t)(set->n - pos - 1) * sizeof(uint32_t));
    set->n--;
    if (set->n == 1) {
        uint32_t only = set->w[0];
        drop_set(ix, s);
        map_put(&ix->holders, seq, (uint64_t)only << 1);  /* the key is there: no allocation */
    }
}

/* ---------------------------------------------------------------- workers */
/* The index of worker `key`; -1 if unknown and not `create`, -2 on error. */
static int64_t worker_index(Index *ix, PyObject *key, int create) {
    PyObject *found = PyDict_GetItemWithError(ix->by_key, key);
    if (found) return PyLong_AsLongLong(found);
    if (PyErr_Occurred()) return -2;
    if (!create) return -1;
    uint32_t i;
    if (ix->nfree) {
        i = ix->free_idx[--ix->nfree];
    } else {
        if (ix->nworkers == ix->capworkers) {
            uint32_t c = ix->capworkers ? ix->capworkers * 2 : 16;
            Worker *fresh = realloc(ix->workers, (size_t)c * sizeof(Worker));
            if (!fresh) { PyErr_NoMemory(); return -2; }
            ix->workers = fresh;
            ix->capworkers = c;
        }
        i = ix->nworkers++;
    }
    PyObject *idx = PyLong_FromUnsignedLong(i);
    if (!idx || PyDict_SetItem(ix->by_key, key, idx) < 0) {
        Py_XDECREF(idx);
        if (ix->nworkers == i + 1) ix->nworkers--; else ix->free_idx[ix->nfree++] = i;
        return -2;
    }
    Py_DECREF(idx);
    Py_INCREF(key);
    ix->workers[i].key = key;
    memset(&ix->workers[i].lookup, 0, sizeof(Map));
    return i;
}

static int forget_worker(Index *ix, uint32_t i) {
    Worker *wk = &ix->workers[i];
    map_free(&wk->lookup);
    int rc = PyDict_DelItem(ix->by_key, wk->key);
    Py_CLEAR(wk->key);
    if (grow_u32(&ix->free_idx, &ix->capfree, ix->nfree + 1) < 0) return -1;
    ix->free_idx[ix->nfree++] = i;
    return rc;
}

static int drop_worker_blocks(Index *ix, uint32_t i) {
    Map *lk = &ix->workers[i].lookup;
    if (lk->has_zero) clear_holder(ix, lk->zero_val, i);
    for (size_t j = 0; j < lk->cap; j++)
        if (lk->slots[j].k) clear_holder(ix, lk->slots[j].v, i);
    return forget_worker(ix, i);
}

/* ---------------------------------------------------------------- applying blocks */
typedef struct { uint64_t name, local; } Block;

/* 0 applied; 1 the parent is not a block the worker holds; -1 error */
static int store_blocks(Index *ix, PyObject *key, int has_parent, uint64_t parent_name,
                        const Block *blocks, Py_ssize_t n) {
    int64_t wi = worker_index(ix, key, 0);
    if (wi == -2) return -1;
    uint64_t parent = 0;
    if (has_parent) {
        if (wi < 0 || !map_get(&ix->workers[wi].lookup, parent_name, &parent)) return 1;
    }
    if (wi < 0 && (wi = worker_index(ix, key, 1)) < 0) return -1;
    uint32_t w = (uint32_t)wi;
    Map *lk = &ix->workers[w].lookup;
    /* the sequence hashes first (they depend on the parent only), so that the slots every block will
     * touch are fetched from memory together rather than one miss after another */
    uint64_t stack_seqs[64], *seqs = n <= 64 ? stack_seqs : PyMem_Malloc((size_t)n * sizeof(uint64_t));
    if (!seqs) { PyErr_NoMemory(); return -1; }
    for (Py_ssize_t b = 0; b < n; b++) {
        parent = seqs[b] = has_parent || b ? seq_hash(parent, blocks[b].local) : blocks[b].local;
        map_prefetch(lk, blocks[b].name);
        map_prefetch(&ix->holders, seqs[b]);
    }
    int rc = 0;
    for (Py_ssize_t b = 0; b < n && rc == 0; b++) {
        uint64_t seq = seqs[b];
        uint64_t old;
        if (map_get(lk, blocks[b].name, &old)) {
            if (old != seq) {
                clear_holder(ix, old, w);
                rc = map_put(lk, blocks[b].name, seq);
            }
        } else {
            rc = map_put(lk, blocks[b].name, seq);
        }
        if (rc == 0) rc = add_holder(ix, seq, w);
    }
    if (seqs != stack_seqs) PyMem_Free(seqs);
    return rc;
}

/* how many of the names the worker did not hold; -1 error */
static Py_ssize_t remove_blocks(Index *ix, PyObject *key, const uint64_t *names, Py_ssize_t n) {
    int64_t wi = worker_index(ix, key, 0);
    if (wi == -2) return -1;
    if (wi < 0) return n;
    uint32_t w = (uint32_t)wi;
    Map *lk = &ix->workers[w].lookup;
    Py_ssize_t unknown = 0;
    for (Py_ssize_t b = 0; b < n; b++) map_prefetch(lk, names[b]);
    for (Py_ssize_t b = 0; b < n; b++) {
        uint64_t seq;
        if (!map_del(lk, names[b], &seq)) { unknown++; continue; }
        clear_holder(ix, seq, w);
    }
    if (lk->n == 0 && forget_worker(ix, w) < 0) return -1;
    return unknown;
}

#include "blockcore_json.h"
#include "blockcore_py.h"
