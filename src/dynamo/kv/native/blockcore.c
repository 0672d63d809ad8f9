/* The KV block index in C: which worker holds which block, keyed by sequence hash.
 *
 * Why C (measured with benchmarks/router/radix_api.py, 100 workers x 2,000 blocks, one round on a shared
 * 2-core machine): the pure-Python index (dicts of sequence hash -> worker bitmask, msgspec decoding)
 * applied 19,200 events/s through RadixTree.apply_event and 28,400 through KvIndexer, where Dynamo 1.6.1's
 * Rust binding applied 69,300 (0.28x and 0.41x); 16 blocks an event cost about 2 us each in Python (a
 * dict lookup, a hash, a dict store per block, plus decoding), and find_matches hashed the whole prompt
 * (256 Python xxh3 calls) before looking at the index.  No rearrangement of that Python work closes a
 * 2.5-3.6x gap.  In C, at 1,000 workers x 10,000 blocks: 1.4-2.1x Dynamo's events/s through RadixTree,
 * 1.4-2.5x through KvIndexer, 1.37 GB peak RSS against 2.26 GB for the Python index (Dynamo: 1.57 GB).  Here an event is parsed straight from its JSON
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

#define HUGE_PAGE ((size_t)2 << 20)

/* zeroed pages at a huge-page boundary (so that all of them can be huge), asking for huge pages */
static void *huge_map(size_t bytes) {
    size_t span = bytes + HUGE_PAGE;
    char *p = mmap(NULL, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return NULL;
    char *a = (char *)(((uintptr_t)p + HUGE_PAGE - 1) & ~(uintptr_t)(HUGE_PAGE - 1));
    if (a > p) munmap(p, (size_t)(a - p));
    if (p + span > a + bytes) munmap(a + bytes, (size_t)(p + span - (a + bytes)));
#ifdef MADV_HUGEPAGE
    madvise(a, bytes, MADV_HUGEPAGE);
#endif
    return a;
}

static void *big_alloc(size_t bytes) {
    return bytes < BIG_TABLE ? calloc(1, bytes) : huge_map(bytes);
}

static void big_free(void *p, size_t bytes) {
    if (!p) return;
    if (bytes < BIG_TABLE) free(p);
    else munmap(p, bytes);
}

static Slot *slots_alloc(size_t cap) { return big_alloc(cap * sizeof(Slot)); }
static void slots_free(Slot *slots, size_t cap) { big_free(slots, cap * sizeof(Slot)); }

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

/* ---------------------------------------------------------------- blocks: sequence hash -> holders */
/* Each block is a node {sequence hash, holders} in one array, found through a table of (tag, node)
 * slots.  Nodes are appended as blocks arrive, so the blocks of a chain stored in one event lie next to
 * each other, and a walk (or a store of a chain others hold already) tries the node after the previous
 * one before the table: most blocks then cost no random memory access.  Measured at 1,000 workers x
 * 10,000 blocks (benchmarks/router/radix_api.py, a shared machine): with one table slot per block (a
 * cache and TLB miss each) and sets allocated one by one, find_matches took 43-63 us of CPU at p50
 * against Dynamo's 15-20; with the nodes in order and the sets in one arena, 17-18 against 12-19.
 * A holders value: (worker index << 1) for one holder, (arena offset << 1) | 1 for two or more. */
typedef struct { uint64_t seq, v; } Node;
#define FREE_NODE UINT64_MAX
typedef struct { uint32_t tag, node1; } ISlot;  /* node1: node index + 1; 0 marks an empty slot */
typedef struct {
    Node *nodes;
    uint32_t nnodes, capnodes;
    uint32_t *free_nodes;  /* reused last freed first: a chain evicted newest first comes back in order */
    uint32_t nfree, capfree;
    ISlot *slots;
    size_t cap, n;
} Blocks;

static inline uint32_t tag_of(uint64_t s) { return (uint32_t)((s * 0x9E3779B97F4A7C15ULL) >> 32); }

static int64_t blocks_find(const Blocks *b, uint64_t s) {
    if (!b->cap) return -1;
    uint32_t t = tag_of(s);
    size_t mask = b->cap - 1;
    for (size_t i = t & mask;; i = (i + 1) & mask) {
        uint32_t n1 = b->slots[i].node1;
        if (!n1) return -1;
        if (b->slots[i].tag == t && b->nodes[n1 - 1].seq == s) return (int64_t)n1 - 1;
    }
}

static inline void blocks_prefetch(const Blocks *b, uint64_t s) {
    if (b->cap) __builtin_prefetch(&b->slots[tag_of(s) & (b->cap - 1)]);
}

/* the node after `prev` when it is block `s` (a chain stored together lies together), else a lookup */
static inline int64_t blocks_find_after(const Blocks *b, int64_t prev, uint64_t s) {
    if (prev >= 0 && (uint64_t)prev + 1 < b->nnodes && b->nodes[prev + 1].seq == s
        && b->nodes[prev + 1].v != FREE_NODE)
        return prev + 1;
    return blocks_find(b, s);
}

static int blocks_grow(Blocks *b) {
    size_t cap = b->cap ? b->cap * 2 : 16;
    ISlot *fresh = big_alloc(cap * sizeof(ISlot));
    if (!fresh) { PyErr_NoMemory(); return -1; }
    for (size_t j = 0; j < b->cap; j++) {
        if (!b->slots[j].node1) continue;
        size_t i = b->slots[j].tag & (cap - 1);
        while (fresh[i].node1) i = (i + 1) & (cap - 1);
        fresh[i] = b->slots[j];
    }
    big_free(b->slots, b->cap * sizeof(ISlot));
    b->slots = fresh;
    b->cap = cap;
    return 0;
}

/* The node array from BIG_TABLE up is a mapping of its own on huge pages, as the tables are: a walk reads
 * a node wherever a query crosses from one stored event's blocks to the next, and on 4 KiB pages each
 * such read also missed the TLB (realloc had left 2/3 of a 128 MB array on small pages).  It grows by
 * moving its pages to a bigger mapping (mremap), not by copying them, so the peak memory stays that of
 * the array itself.  NULL on no memory (the old array is then untouched). */
static Node *nodes_resize(Node *old, size_t old_bytes, size_t new_bytes) {
    if (new_bytes < BIG_TABLE) return realloc(old, new_bytes);
    char *fresh = huge_map(new_bytes);
    if (!fresh) return NULL;
    if (old_bytes < BIG_TABLE) {
        if (old_bytes) memcpy(fresh, old, old_bytes);
        free(old);
        return (Node *)fresh;
    }
#if defined(MREMAP_MAYMOVE) && defined(MREMAP_FIXED)
    /* the old pages replace the start of the new mapping, huge pages staying huge (both are aligned) */
    if (mremap(old, old_bytes, old_bytes, MREMAP_MAYMOVE | MREMAP_FIXED, fresh) != MAP_FAILED) {
#ifdef MADV_HUGEPAGE
        madvise(fresh, new_bytes, MADV_HUGEPAGE);
#endif
        return (Node *)fresh;
    }
#endif
    memcpy(fresh, old, old_bytes);
    munmap(old, old_bytes);
    return (Node *)fresh;
}

/* a new node for block `s` with holders `v`: its index, or -1 on no memory */
static int64_t blocks_insert(Blocks *b, uint64_t s, uint64_t v) {
    if ((b->n + 1) * 4 > b->cap * 3 && blocks_grow(b) < 0) return -1;
    uint32_t idx;
    if (b->nfree) {
        idx = b->free_nodes[--b->nfree];
    } else {
        if (b->nnodes == b->capnodes) {
            uint32_t c = b->capnodes ? b->capnodes * 2 : 64;
            Node *fresh = nodes_resize(b->nodes, (size_t)b->capnodes * sizeof(Node), (size_t)c * sizeof(Node));
            if (!fresh) { PyErr_NoMemory(); return -1; }
            b->nodes = fresh;
            b->capnodes = c;
        }
        idx = b->nnodes++;
    }
    b->nodes[idx].seq = s;
    b->nodes[idx].v = v;
    uint32_t t = tag_of(s);
    size_t mask = b->cap - 1, i = t & mask;
    while (b->slots[i].node1) i = (i + 1) & mask;
    b->slots[i].tag = t;
    b->slots[i].node1 = idx + 1;
    b->n++;
    return idx;
}

static void blocks_delete(Blocks *b, uint32_t idx) {
    size_t mask = b->cap - 1, i = tag_of(b->nodes[idx].seq) & mask;
    while (b->slots[i].node1 != idx + 1) i = (i + 1) & mask;
    size_t hole = i;
    for (size_t j = (i + 1) & mask; b->slots[j].node1; j = (j + 1) & mask) {
        size_t home = b->slots[j].tag & mask;
        if (((j - home) & mask) >= ((j - hole) & mask)) {
            b->slots[hole] = b->slots[j];
            hole = j;
        }
    }
    b->slots[hole].node1 = 0;
    b->n--;
    b->nodes[idx].v = FREE_NODE;
    if (b->nfree == b->capfree) {
        uint32_t c = b->capfree ? b->capfree * 2 : 64;
        uint32_t *fresh = realloc(b->free_nodes, (size_t)c * sizeof(uint32_t));
        if (!fresh) return;  /* the node is only lost for reuse */
        b->free_nodes = fresh;
        b->capfree = c;
    }
    b->free_nodes[b->nfree++] = idx;
}

static void blocks_free(Blocks *b) {
    big_free(b->nodes, (size_t)b->capnodes * sizeof(Node));
    free(b->free_nodes);
    big_free(b->slots, b->cap * sizeof(ISlot));
    memset(b, 0, sizeof(*b));
}

/* ---------------------------------------------------------------- worker sets */
/* A block held by two or more workers points into one arena of u32: [n, cap, worker indices (sorted)].
 * A set that outgrows its room moves to the arena's end; once half the arena is left behind, it is
 * compacted in node order, so the sets of a chain's blocks lie in a row, as the nodes do: a walk along a
 * prefix 16 workers share then reads memory in order instead of two scattered loads per block. */

typedef struct {
    PyObject *key;  /* the worker, as the caller names it; NULL for a free index */
    Map lookup;     /* block name -> sequence hash */
} Worker;

typedef struct {
    PyObject_HEAD
    Blocks blocks;
    Worker *workers;
    uint32_t nworkers, capworkers;
    uint32_t *free_idx;  /* indices of removed workers, reused last first */
    uint32_t nfree, capfree;
    PyObject *by_key;    /* dict: worker key -> index (insertion order = workers()) */
    uint32_t *arena;     /* the worker sets */
    size_t arena_len, arena_cap, arena_garbage;
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

static inline uint32_t *set_at(const Index *ix, uint64_t v) { return ix->arena + (v >> 1); }

/* room for a set of up to `cap` workers at the arena's end: its offset, or -1 on no memory */
static int64_t arena_take(Index *ix, uint32_t cap) {
    size_t need = ix->arena_len + 2 + cap;
    if (need > ix->arena_cap) {
        size_t c = ix->arena_cap ? ix->arena_cap : 1024;
        while (c < need) c *= 2;
        uint32_t *fresh = realloc(ix->arena, c * sizeof(uint32_t));
        if (!fresh) { PyErr_NoMemory(); return -1; }
        ix->arena = fresh;
        ix->arena_cap = c;
    }
    size_t off = ix->arena_len;
    ix->arena_len = need;
    ix->arena[off] = 0;
    ix->arena[off + 1] = cap;
    return (int64_t)off;
}

static void arena_release(Index *ix, uint64_t v) { ix->arena_garbage += 2 + set_at(ix, v)[1]; }

/* lay the live sets out again in node order once half the arena is garbage */
static void arena_compact_now(Index *ix);

static void arena_compact(Index *ix) {
    if (ix->arena_garbage >= 65536 && ix->arena_garbage * 2 >= ix->arena_len) arena_compact_now(ix);
}

static void arena_compact_now(Index *ix) {
    size_t live = ix->arena_len - ix->arena_garbage, cap = live + live / 2 + 1024;
    uint32_t *fresh = malloc(cap * sizeof(uint32_t));
    if (!fresh) return;  /* keep the old layout */
    size_t len = 0;
    Node *nodes = ix->blocks.nodes;
    for (uint32_t i = 0; i < ix->blocks.nnodes; i++) {
        uint64_t v = nodes[i].v;
        if (v == FREE_NODE || !(v & 1)) continue;
        uint32_t *p = set_at(ix, v), words = 2 + p[1];
        memcpy(fresh + len, p, words * sizeof(uint32_t));
        nodes[i].v = ((uint64_t)len << 1) | 1;
        len += words;
    }
    free(ix->arena);
    ix->arena = fresh;
    ix->arena_len = len;
    ix->arena_cap = cap;
    ix->arena_garbage = 0;
}

/* first position in the sorted set `p` whose worker is >= w */
static uint32_t set_find(const uint32_t *p, uint32_t w) {
    uint32_t lo = 0, hi = p[0];
    const uint32_t *m = p + 2;
    while (lo < hi) {
        uint32_t mid = (lo + hi) / 2;
        if (m[mid] < w) lo = mid + 1; else hi = mid;
    }
    return lo;
}

/* worker `w` holds block `seq` (tried first at the node after `prev`): the block's node, or -1 */
static int64_t add_holder(Index *ix, uint64_t seq, uint32_t w, int64_t prev) {
    Blocks *b = &ix->blocks;
    int64_t idx = blocks_find_after(b, prev, seq);
    if (idx < 0) return blocks_insert(b, seq, (uint64_t)w << 1);
    uint64_t v = b->nodes[idx].v;
    if (!(v & 1)) {
        uint32_t only = (uint32_t)(v >> 1);
        if (only == w) return idx;
        int64_t off = arena_take(ix, 4);
        if (off < 0) return -1;
        uint32_t *p = ix->arena + off;
        p[0] = 2;
        p[2] = only < w ? only : w;
        p[3] = only < w ? w : only;
        b->nodes[idx].v = ((uint64_t)off << 1) | 1;
        return idx;
    }
    uint32_t *p = set_at(ix, v), pos = set_find(p, w);
    if (pos < p[0] && p[2 + pos] == w) return idx;
    if (p[0] == p[1]) {  /* full: move it to the end with twice the room */
        int64_t off = arena_take(ix, p[1] * 2);
        if (off < 0) return -1;
        p = set_at(ix, v);  /* the arena may have moved */
        uint32_t *q = ix->arena + off;
        q[0] = p[0];
        memcpy(q + 2, p + 2, (size_t)p[0] * sizeof(uint32_t));
        arena_release(ix, v);
        v = ((uint64_t)off << 1) | 1;
        b->nodes[idx].v = v;
        p = q;
    }
    memmove(p + 2 + pos + 1, p + 2 + pos, (size_t)(p[0] - pos) * sizeof(uint32_t));
    p[2 + pos] = w;
    p[0]++;
    return idx;
}

static void clear_holder(Index *ix, uint64_t seq, uint32_t w) {
    Blocks *b = &ix->blocks;
    int64_t idx = blocks_find(b, seq);
    if (idx < 0) return;
    uint64_t v = b->nodes[idx].v;
    if (!(v & 1)) {
        if ((uint32_t)(v >> 1) == w) blocks_delete(b, (uint32_t)idx);
        return;
    }
    uint32_t *p = set_at(ix, v), pos = set_find(p, w);
    if (pos >= p[0] || p[2 + pos] != w) return;
    memmove(p + 2 + pos, p + 2 + pos + 1, (size_t)(p[0] - pos - 1) * sizeof(uint32_t));
    p[0]--;
    if (p[0] == 1) {
        b->nodes[idx].v = (uint64_t)p[2] << 1;
        arena_release(ix, v);
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
    arena_compact(ix);
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
        blocks_prefetch(&ix->blocks, seqs[b]);
    }
    int rc = 0;
    int64_t node = -1;
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
        if (rc == 0 && (node = add_holder(ix, seq, w, node)) < 0) rc = -1;
    }
    if (seqs != stack_seqs) PyMem_Free(seqs);
    arena_compact(ix);
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
    arena_compact(ix);
    if (lk->n == 0 && forget_worker(ix, w) < 0) return -1;
    return unknown;
}

#include "blockcore_json.h"
#include "blockcore_py.h"
