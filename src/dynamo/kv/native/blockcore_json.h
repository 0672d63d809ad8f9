/* KV events straight from their JSON bytes (part of blockcore.c).
 *
 * A small JSON reader for the shapes engines send: objects, arrays, unsigned integers, strings without
 * escapes, null, true and false.  Anything else (a negative or fractional number, an escape, a value that
 * does not fit in 64 bits, a shape the index does not take here) returns FALLBACK before anything is
 * changed, and the Python parser decodes the event instead (and says what is wrong with it).
 */

enum { J_NULL, J_BOOL, J_UINT, J_STR, J_ARR, J_OBJ };

typedef struct {
    uint8_t type;
    int32_t next;   /* next member of the parent, -1 at the end */
    int32_t child;  /* first member of an object or array, -1 if empty */
    const char *key;
    uint32_t klen;
    uint64_t u;
} JNode;

static JNode *jnodes;
static uint32_t jcap, jcount;
static Block *jblocks;
static uint32_t jblocks_cap;

#define FALLBACK (-1)
#define PARENT_UNKNOWN (-2)
#define FAILED (-3)

typedef struct { const char *p, *end; int depth; } JP;

static int32_t jalloc(uint8_t type) {
    if (jcount == jcap) {
        uint32_t c = jcap ? jcap * 2 : 256;
        JNode *fresh = realloc(jnodes, (size_t)c * sizeof(JNode));
        if (!fresh) return -1;
        jnodes = fresh;
        jcap = c;
    }
    JNode *n = &jnodes[jcount];
    n->type = type;
    n->next = n->child = -1;
    n->key = NULL;
    n->klen = 0;
    n->u = 0;
    return (int32_t)jcount++;
}

static void jws(JP *jp) {
    while (jp->p < jp->end && (*jp->p == ' ' || *jp->p == '\n' || *jp->p == '\r' || *jp->p == '\t')) jp->p++;
}

static int jstring(JP *jp, const char **s, uint32_t *len) {
    if (jp->p >= jp->end || *jp->p != '"') return -1;
    const char *start = ++jp->p;
    while (jp->p < jp->end && *jp->p != '"') {
        if (*jp->p == '\\' || (unsigned char)*jp->p < 0x20) return -1;
        jp->p++;
    }
    if (jp->p >= jp->end) return -1;
    *s = start;
    *len = (uint32_t)(jp->p - start);
    jp->p++;
    return 0;
}

static int jlit(JP *jp, const char *word, size_t n) {
    if ((size_t)(jp->end - jp->p) < n || memcmp(jp->p, word, n) != 0) return -1;
    jp->p += n;
    return 0;
}

static int32_t jvalue(JP *jp);

static int32_t jcontainer(JP *jp, int obj) {
    int32_t me = jalloc(obj ? J_OBJ : J_ARR), last = -1;
    if (me < 0 || ++jp->depth > 16) return -1;
    jp->p++;
    jws(jp);
    if (jp->p < jp->end && *jp->p == (obj ? '}' : ']')) { jp->p++; jp->depth--; return me; }
    for (;;) {
        const char *key = NULL;
        uint32_t klen = 0;
        if (obj) {
            jws(jp);
            if (jstring(jp, &key, &klen) < 0) return -1;
            jws(jp);
            if (jp->p >= jp->end || *jp->p != ':') return -1;
            jp->p++;
        }
        int32_t v = jvalue(jp);
        if (v < 0) return -1;
        jnodes[v].key = key;
        jnodes[v].klen = klen;
        if (last < 0) jnodes[me].child = v; else jnodes[last].next = v;
        last = v;
        jws(jp);
        if (jp->p >= jp->end) return -1;
        if (*jp->p == ',') { jp->p++; continue; }
        if (*jp->p == (obj ? '}' : ']')) { jp->p++; jp->depth--; return me; }
        return -1;
    }
}

static int32_t jvalue(JP *jp) {
    jws(jp);
    if (jp->p >= jp->end) return -1;
    char c = *jp->p;
    if (c == '{' || c == '[') return jcontainer(jp, c == '{');
    if (c == '"') {
        const char *s;
        uint32_t len;
        int32_t me = jalloc(J_STR);
        if (me < 0 || jstring(jp, &s, &len) < 0) return -1;
        jnodes[me].u = len;
        return me;
    }
    if (c >= '0' && c <= '9') {
        uint64_t v = 0;
        const char *start = jp->p;
        while (jp->p < jp->end && *jp->p >= '0' && *jp->p <= '9') {
            uint64_t d = (uint64_t)(*jp->p - '0');
            if (v > (UINT64_MAX - d) / 10) return -1;
            v = v * 10 + d;
            jp->p++;
        }
        if (jp->p - start > 1 && *start == '0') return -1;
        if (jp->p < jp->end && (*jp->p == '.' || *jp->p == 'e' || *jp->p == 'E')) return -1;
        int32_t me = jalloc(J_UINT);
        if (me < 0) return -1;
        jnodes[me].u = v;
        return me;
    }
    if (c == 'n') return jlit(jp, "null", 4) < 0 ? -1 : jalloc(J_NULL);
    if (c == 't') return jlit(jp, "true", 4) < 0 ? -1 : jalloc(J_BOOL);
    if (c == 'f') return jlit(jp, "false", 5) < 0 ? -1 : jalloc(J_BOOL);
    return -1;
}

/* the member `key` of object `obj` (the last one when repeated), or -1 */
static int32_t jget(int32_t obj, const char *key) {
    size_t n = strlen(key);
    int32_t found = -1;
    for (int32_t c = jnodes[obj].child; c >= 0; c = jnodes[c].next)
        if (jnodes[c].klen == n && memcmp(jnodes[c].key, key, n) == 0) found = c;
    return found;
}

static int jparse(const char *buf, Py_ssize_t len) {
    JP jp = {buf, buf + len, 0};
    jcount = 0;
    int32_t root = jvalue(&jp);
    if (root < 0) return -1;
    jws(&jp);
    return jp.p == jp.end ? root : -1;
}

/* Apply the bare event at node `ev` for `key`: 0 applied, FALLBACK, PARENT_UNKNOWN, FAILED (exception
 * set), or (> 0) how many removed blocks the worker did not hold.  `bare`: Dynamo's RadixTree shape
 * (event_id required, dp_rank 0 only); otherwise the event part of a wrapped event (no medium). */
static Py_ssize_t apply_bare(Index *ix, PyObject *key, int32_t ev, int bare) {
    if (jnodes[ev].type != J_OBJ) return FALLBACK;
    int32_t eid = jget(ev, "event_id");
    if (eid < 0 ? bare : jnodes[eid].type != J_UINT) return FALLBACK;
    if (bare) {
        int32_t dp = jget(ev, "dp_rank");
        if (dp >= 0 && (jnodes[dp].type != J_UINT || jnodes[dp].u != 0)) return FALLBACK;
    } else {
        int32_t medium = jget(ev, "medium");
        if (medium >= 0 && jnodes[medium].type != J_NULL) return FALLBACK;
    }
    int32_t data = jget(ev, "data");
    if (data < 0 || jnodes[data].type != J_OBJ) return FALLBACK;
    int32_t body = jnodes[data].child;
    if (body < 0 || jnodes[body].next >= 0 || jnodes[body].type != J_OBJ) return FALLBACK;
    if (jnodes[body].klen == 6 && memcmp(jnodes[body].key, "stored", 6) == 0) {
        int32_t parent = jget(body, "parent_hash"), blocks = jget(body, "blocks");
        if (parent >= 0 && jnodes[parent].type != J_NULL && jnodes[parent].type != J_UINT) return FALLBACK;
        if (blocks < 0 || jnodes[blocks].type != J_ARR) return FALLBACK;
        uint32_t n = 0;
        for (int32_t b = jnodes[blocks].child; b >= 0; b = jnodes[b].next) {
            if (jnodes[b].type != J_OBJ) return FALLBACK;
            int32_t bh = jget(b, "block_hash"), th = jget(b, "tokens_hash");
            if (bh < 0 || th < 0 || jnodes[bh].type != J_UINT || jnodes[th].type != J_UINT) return FALLBACK;
            if (n == jblocks_cap) {
                uint32_t c = jblocks_cap ? jblocks_cap * 2 : 64;
                Block *fresh = realloc(jblocks, (size_t)c * sizeof(Block));
                if (!fresh) { PyErr_NoMemory(); return FAILED; }
                jblocks = fresh;
                jblocks_cap = c;
            }
            jblocks[n].name = jnodes[bh].u;
            jblocks[n].local = jnodes[th].u;
            n++;
        }
        int has_parent = parent >= 0 && jnodes[parent].type == J_UINT;
        int rc = store_blocks(ix, key, has_parent, has_parent ? jnodes[parent].u : 0, jblocks, n);
        return rc < 0 ? FAILED : rc ? PARENT_UNKNOWN : 0;
    }
    if (jnodes[body].klen == 7 && memcmp(jnodes[body].key, "removed", 7) == 0) {
        int32_t hashes = jget(body, "block_hashes");
        if (hashes < 0 || jnodes[hashes].type != J_ARR) return FALLBACK;
        uint32_t n = 0;
        for (int32_t h = jnodes[hashes].child; h >= 0; h = jnodes[h].next) {
            if (jnodes[h].type != J_UINT) return FALLBACK;
            if (n == jblocks_cap) {
                uint32_t c = jblocks_cap ? jblocks_cap * 2 : 64;
                Block *fresh = realloc(jblocks, (size_t)c * sizeof(Block));
                if (!fresh) { PyErr_NoMemory(); return FAILED; }
                jblocks = fresh;
                jblocks_cap = c;
            }
            jblocks[n++].name = jnodes[h].u;
        }
        /* the names, packed at the front of the same buffer */
        uint64_t *names = (uint64_t *)jblocks;
        for (uint32_t i = 0; i < n; i++) names[i] = jblocks[i].name;
        Py_ssize_t unknown = remove_blocks(ix, key, names, n);
        return unknown < 0 ? FAILED : unknown;
    }
    return FALLBACK;
}
