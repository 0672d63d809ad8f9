/* The Python type and module of blockcore.c: BlockIndex, sequence_hash. */

static PyObject *str_block_hash, *str_tokens_hash;

static int as_u64(PyObject *o, uint64_t *out) {
    if (!PyLong_Check(o) || PyBool_Check(o)) {
        PyErr_Format(PyExc_TypeError, "a block hash must be an int, not %.100s", Py_TYPE(o)->tp_name);
        return -1;
    }
    /* PyLong_AsUnsignedLong, not ...LongLong: on CPython 3.11 the latter converts a hash of more than
     * 30 bits through _PyLong_AsByteArray, which was 37% of a 256-block walk (perf); the former shifts
     * the digits in, with the same range checks.  unsigned long is 64 bits on every LP64 platform. */
#if ULONG_MAX == UINT64_MAX
    *out = PyLong_AsUnsignedLong(o);
#else
    *out = PyLong_AsUnsignedLongLong(o);
#endif
    if (*out == (uint64_t)-1 && PyErr_Occurred()) {
        PyErr_SetString(PyExc_OverflowError, "a block hash must be an unsigned 64-bit integer");
        return -1;
    }
    return 0;
}

static PyObject *Index_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    if (PyTuple_GET_SIZE(args) || (kw && PyDict_GET_SIZE(kw))) {
        PyErr_SetString(PyExc_TypeError, "BlockIndex() takes no arguments");
        return NULL;
    }
    Index *ix = (Index *)type->tp_alloc(type, 0);
    if (!ix) return NULL;
    ix->by_key = PyDict_New();
    if (!ix->by_key) { Py_DECREF(ix); return NULL; }
    return (PyObject *)ix;
}

static void Index_dealloc(Index *ix) {
    for (uint32_t i = 0; i < ix->nworkers; i++) {
        if (ix->workers[i].key) {
            Py_CLEAR(ix->workers[i].key);
            map_free(&ix->workers[i].lookup);
        }
    }
    free(ix->arena);
    free(ix->workers);
    free(ix->free_idx);
    free(ix->scratch);
    blocks_free(&ix->blocks);
    Py_XDECREF(ix->by_key);
    Py_TYPE(ix)->tp_free((PyObject *)ix);
}

static PyObject *Index_apply_stored(Index *ix, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) { PyErr_SetString(PyExc_TypeError, "apply_stored(worker, parent_hash, blocks)"); return NULL; }
    uint64_t parent = 0;
    int has_parent = args[1] != Py_None;
    if (has_parent && as_u64(args[1], &parent) < 0) return NULL;
    PyObject *seq = PySequence_Fast(args[2], "blocks must be iterable");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    Block *blocks = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(Block));
    if (!blocks) { Py_DECREF(seq); return PyErr_NoMemory(); }
    int rc = 0;
    for (Py_ssize_t i = 0; i < n && rc == 0; i++) {
        PyObject *b = PySequence_Fast_GET_ITEM(seq, i);
        if (PyTuple_Check(b) && PyTuple_GET_SIZE(b) == 2) {
            rc = as_u64(PyTuple_GET_ITEM(b, 0), &blocks[i].name) < 0 || as_u64(PyTuple_GET_ITEM(b, 1), &blocks[i].local) < 0;
        } else {
            PyObject *name = PyObject_GetAttr(b, str_block_hash), *local = name ? PyObject_GetAttr(b, str_tokens_hash) : NULL;
            rc = !local || as_u64(name, &blocks[i].name) < 0 || as_u64(local, &blocks[i].local) < 0;
            Py_XDECREF(name);
            Py_XDECREF(local);
        }
    }
    if (rc == 0) rc = store_blocks(ix, args[0], has_parent, parent, blocks, n);
    PyMem_Free(blocks);
    Py_DECREF(seq);
    if (rc < 0 || PyErr_Occurred()) return NULL;
    return PyBool_FromLong(rc == 0);
}

static PyObject *Index_apply_own_chain(Index *ix, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) { PyErr_SetString(PyExc_TypeError, "apply_own_chain(worker, seq_hashes)"); return NULL; }
    PyObject *seq = PySequence_Fast(args[1], "seq_hashes must be iterable");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    int64_t wi = n ? worker_index(ix, args[0], 1) : 0;
    if (wi < 0) { Py_DECREF(seq); return NULL; }
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t s;
        if (as_u64(PySequence_Fast_GET_ITEM(seq, i), &s) < 0 || map_put(&ix->workers[wi].lookup, s, s) < 0
            || add_holder(ix, s, (uint32_t)wi, -1) < 0) {
            Py_DECREF(seq);
            return NULL;
        }
    }
    Py_DECREF(seq);
    Py_RETURN_NONE;
}

static PyObject *Index_apply_removed(Index *ix, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) { PyErr_SetString(PyExc_TypeError, "apply_removed(worker, block_hashes)"); return NULL; }
    PyObject *seq = PySequence_Fast(args[1], "block_hashes must be iterable");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    uint64_t *names = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(uint64_t));
    if (!names) { Py_DECREF(seq); return PyErr_NoMemory(); }
    Py_ssize_t unknown = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (as_u64(PySequence_Fast_GET_ITEM(seq, i), &names[i]) < 0) { unknown = -1; break; }
    }
    if (unknown == 0) unknown = remove_blocks(ix, args[0], names, n);
    PyMem_Free(names);
    Py_DECREF(seq);
    return unknown < 0 ? NULL : PyLong_FromSsize_t(unknown);
}

static PyObject *Index_remove_worker(Index *ix, PyObject *key) {
    int64_t wi = worker_index(ix, key, 0);
    if (wi == -2) return NULL;
    if (wi >= 0 && drop_worker_blocks(ix, (uint32_t)wi) < 0) return NULL;
    Py_RETURN_NONE;
}

static int add_score(Index *ix, PyObject *scores, uint32_t w, Py_ssize_t depth) {
    PyObject *v = PyLong_FromSsize_t(depth);
    int rc = v ? PyDict_SetItem(scores, ix->workers[w].key, v) : -1;
    Py_XDECREF(v);
    return rc;
}

/* A block held by two or more workers costs one more load besides its node (its set in the arena).
 * The nodes after this one are most likely the walk's next blocks (a chain stored together), so their
 * sets are fetched PREFETCH_SETS nodes ahead. */
#define PREFETCH_SETS 8

static inline void prefetch_sets_ahead(const Index *ix, int64_t idx) {
    const Blocks *b = &ix->blocks;
    if ((uint64_t)idx + PREFETCH_SETS < b->nnodes) {
        uint64_t v = b->nodes[idx + PREFETCH_SETS].v;
        if ((v & 1) && v != FREE_NODE) __builtin_prefetch(set_at(ix, v));
    }
}

/* a few workers at most, most often one: a loop the compiler inlines, not a call to memcmp (which was
 * a fifth of a 256-block walk, called once a block) */
static inline int same_u32(const uint32_t *a, const uint32_t *b, uint32_t n) {
    for (uint32_t i = 0; i < n; i++)
        if (a[i] != b[i]) return 0;
    return 1;
}

/* blocks converted and hashed at a time: few enough that a query matching nothing early costs little */
#define WALK_AHEAD 32

/* (scores, blocks looked at); `local`: the sequence holds local hashes, chained here as the walk goes */
static PyObject *walk(Index *ix, PyObject *hashes, int local, int early_exit) {
    PyObject *seq = PySequence_Fast(hashes, "hashes must be iterable");
    if (!seq) return NULL;
    PyObject *scores = PyDict_New();
    if (!scores) { Py_DECREF(seq); return NULL; }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), depth = 0, looked = -1;
    uint32_t nactive = 0;
    uint64_t prev = 0, prev_v = 0, ahead[WALK_AHEAD];
    int64_t node = -1;
    int done = 0;
    for (Py_ssize_t start = 0; start < n && !done; start += WALK_AHEAD) {
        Py_ssize_t stop = start + WALK_AHEAD < n ? start + WALK_AHEAD : n;
        for (Py_ssize_t i = start; i < stop; i++) {
            uint64_t x;
            if (as_u64(PySequence_Fast_GET_ITEM(seq, i), &x) < 0) goto fail;
            prev = ahead[i - start] = local && i ? seq_hash(prev, x) : x;
        }
        for (Py_ssize_t i = start; i < stop; i++) {
            int64_t idx = blocks_find_after(&ix->blocks, node, ahead[i - start]);
            if (idx < 0) { done = 1; break; }
            node = idx;
            prefetch_sets_ahead(ix, idx);
            uint64_t v = ix->blocks.nodes[idx].v;
            if (depth > 0 && v == prev_v) {  /* the very holders of the block before (one worker, or the same set): nobody drops out */
                depth++;
                continue;
            }
            prev_v = v;
            uint32_t one = (uint32_t)(v >> 1), hn = 1, *hw = &one;
            if (v & 1) { hn = set_at(ix, v)[0]; hw = set_at(ix, v) + 2; }
            if (depth == 0) {
                if (grow_u32(&ix->scratch, &ix->capscratch, hn) < 0) goto fail;
                memcpy(ix->scratch, hw, (size_t)hn * sizeof(uint32_t));
                nactive = hn;
            } else if (hn == nactive && same_u32(hw, ix->scratch, hn)) {
                /* the same workers as the block before (a prefix they share): nobody drops out */
            } else {
                uint32_t keep = 0, h = 0;
                for (uint32_t a = 0; a < nactive; a++) {
                    uint32_t w = ix->scratch[a];
                    while (h < hn && hw[h] < w) h++;
                    if (h < hn && hw[h] == w) ix->scratch[keep++] = w;
                    else if (add_score(ix, scores, w, depth) < 0) goto fail;
                }
                nactive = keep;
                if (!nactive) { looked = depth + 1; done = 1; break; }
            }
            depth++;
            if (early_exit && nactive == 1) { done = 1; break; }
        }
    }
    for (uint32_t a = 0; a < nactive; a++)
        if (add_score(ix, scores, ix->scratch[a], depth) < 0) goto fail;
    Py_DECREF(seq);
    return Py_BuildValue("(Nn)", scores, looked < 0 ? depth : looked);
fail:
    Py_DECREF(seq);
    Py_DECREF(scores);
    return NULL;
}

static int early_exit_arg(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, int *early) {
    *early = 0;
    PyObject *flag = nargs > 1 ? args[1] : NULL;
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t i = 0; i < nkw; i++) {
        if (PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(kwnames, i), "early_exit") != 0) {
            PyErr_SetString(PyExc_TypeError, "the only keyword is early_exit");
            return -1;
        }
        flag = args[nargs + i];
    }
    if (nargs < 1 || nargs > 2) { PyErr_SetString(PyExc_TypeError, "walk(hashes, early_exit=False)"); return -1; }
    if (flag) {
        int t = PyObject_IsTrue(flag);
        if (t < 0) return -1;
        *early = t;
    }
    return 0;
}

static PyObject *Index_walk(Index *ix, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    int early;
    if (early_exit_arg(args, nargs, kwnames, &early) < 0) return NULL;
    return walk(ix, args[0], 0, early);
}

static PyObject *Index_walk_local(Index *ix, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    int early;
    if (early_exit_arg(args, nargs, kwnames, &early) < 0) return NULL;
    return walk(ix, args[0], 1, early);
}

static PyObject *Index_find_matches(Index *ix, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) { PyErr_SetString(PyExc_TypeError, "find_matches(local_hashes, seq_hashes=None)"); return NULL; }
    int have_seq = nargs == 2 && args[1] != Py_None;
    PyObject *pair = walk(ix, have_seq ? args[1] : args[0], !have_seq, 0);
    if (!pair) return NULL;
    PyObject *scores = PyTuple_GET_ITEM(pair, 0);
    Py_INCREF(scores);
    Py_DECREF(pair);
    return scores;
}

static PyObject *Index_holders(Index *ix, PyObject *arg) {
    uint64_t s;
    if (as_u64(arg, &s) < 0) return NULL;
    PyObject *out = PyList_New(0);
    int64_t idx = blocks_find(&ix->blocks, s);
    if (!out || idx < 0) return out;
    uint64_t v = ix->blocks.nodes[idx].v;
    uint32_t one = (uint32_t)(v >> 1), hn = 1, *hw = &one;
    if (v & 1) { hn = set_at(ix, v)[0]; hw = set_at(ix, v) + 2; }
    for (uint32_t i = 0; i < hn; i++)
        if (PyList_Append(out, ix->workers[hw[i]].key) < 0) { Py_DECREF(out); return NULL; }
    return out;
}

static PyObject *Index_workers(Index *ix, PyObject *Py_UNUSED(unused)) {
    return PyDict_Keys(ix->by_key);
}

static PyObject *Index_num_blocks(Index *ix, PyObject *key) {
    int64_t wi = worker_index(ix, key, 0);
    if (wi == -2) return NULL;
    return PyLong_FromSize_t(wi < 0 ? 0 : ix->workers[wi].lookup.n);
}

static PyObject *Index_node_count(Index *ix, PyObject *Py_UNUSED(unused)) {
    return PyLong_FromSize_t(ix->blocks.n);
}

static PyObject *Index_compact(Index *ix, PyObject *Py_UNUSED(unused)) {
    arena_compact_now(ix);
    Py_RETURN_NONE;
}

static PyObject *Index_memory_bytes(Index *ix, PyObject *Py_UNUSED(unused)) {
    size_t total = ix->blocks.cap * sizeof(ISlot) + (size_t)ix->blocks.capnodes * sizeof(Node)
                   + (size_t)ix->blocks.capfree * sizeof(uint32_t) + (size_t)ix->capworkers * sizeof(Worker)
                   + ix->arena_cap * sizeof(uint32_t);
    for (uint32_t i = 0; i < ix->nworkers; i++)
        if (ix->workers[i].key) total += ix->workers[i].lookup.cap * sizeof(Slot);
    return PyLong_FromSize_t(total);
}

/* apply_json(raw, worker=None): see the .pyi */
static PyObject *Index_apply_json(Index *ix, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) { PyErr_SetString(PyExc_TypeError, "apply_json(raw, worker=None)"); return NULL; }
    const char *buf;
    Py_ssize_t len;
    if (PyBytes_Check(args[0])) {
        buf = PyBytes_AS_STRING(args[0]);
        len = PyBytes_GET_SIZE(args[0]);
    } else if (PyUnicode_Check(args[0])) {
        buf = PyUnicode_AsUTF8AndSize(args[0], &len);
        if (!buf) return NULL;
    } else {
        return PyLong_FromLong(FALLBACK);
    }
    int32_t root = jparse(buf, len);
    if (root < 0 || jnodes[root].type != J_OBJ) return PyLong_FromLong(FALLBACK);
    Py_ssize_t rc;
    if (nargs == 2 && args[1] != Py_None) {
        rc = apply_bare(ix, args[1], root, 1);
    } else {
        int32_t wid = jget(root, "worker_id"), ev = jget(root, "event"), tier = jget(root, "storage_tier");
        if (wid < 0 || jnodes[wid].type != J_UINT || jnodes[wid].u > (uint64_t)INT64_MAX || ev < 0
            || (tier >= 0 && jnodes[tier].type != J_NULL))
            return PyLong_FromLong(FALLBACK);
        PyObject *key = PyLong_FromUnsignedLongLong(jnodes[wid].u);
        if (!key) return NULL;
        rc = apply_bare(ix, key, ev, 0);
        Py_DECREF(key);
    }
    if (rc == FAILED) return NULL;
    return PyLong_FromSsize_t(rc);
}

static PyMethodDef Index_methods[] = {
    {"apply_stored", (PyCFunction)(void (*)(void))Index_apply_stored, METH_FASTCALL, NULL},
    {"apply_own_chain", (PyCFunction)(void (*)(void))Index_apply_own_chain, METH_FASTCALL, NULL},
    {"apply_removed", (PyCFunction)(void (*)(void))Index_apply_removed, METH_FASTCALL, NULL},
    {"apply_json", (PyCFunction)(void (*)(void))Index_apply_json, METH_FASTCALL, NULL},
    {"remove_worker", (PyCFunction)Index_remove_worker, METH_O, NULL},
    {"clear_worker", (PyCFunction)Index_remove_worker, METH_O, NULL},
    {"find_matches", (PyCFunction)(void (*)(void))Index_find_matches, METH_FASTCALL, NULL},
    {"walk", (PyCFunction)(void (*)(void))Index_walk, METH_FASTCALL | METH_KEYWORDS, NULL},
    {"walk_local", (PyCFunction)(void (*)(void))Index_walk_local, METH_FASTCALL | METH_KEYWORDS, NULL},
    {"holders", (PyCFunction)Index_holders, METH_O, NULL},
    {"workers", (PyCFunction)Index_workers, METH_NOARGS, NULL},
    {"num_blocks", (PyCFunction)Index_num_blocks, METH_O, NULL},
    {"node_count", (PyCFunction)Index_node_count, METH_NOARGS, NULL},
    {"memory_bytes", (PyCFunction)Index_memory_bytes, METH_NOARGS, NULL},
    {"compact", (PyCFunction)Index_compact, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject IndexType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "dynamo.kv.native.blockcore.BlockIndex",
    .tp_basicsize = sizeof(Index),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Which worker holds which KV block (see dynamo.kv.indexer).",
    .tp_new = Index_new,
    .tp_dealloc = (destructor)Index_dealloc,
    .tp_methods = Index_methods,
};

static PyObject *py_sequence_hash(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs) {
    uint64_t parent, local;
    if (nargs != 2) { PyErr_SetString(PyExc_TypeError, "sequence_hash(parent, local)"); return NULL; }
    if (as_u64(args[0], &parent) < 0 || as_u64(args[1], &local) < 0) return NULL;
    return PyLong_FromUnsignedLongLong(seq_hash(parent, local));
}

static PyMethodDef module_methods[] = {
    {"sequence_hash", (PyCFunction)(void (*)(void))py_sequence_hash, METH_FASTCALL, NULL},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "dynamo.kv.native.blockcore", "The KV block index in C (dynamo.kv.indexer).", -1,
    module_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit_blockcore(void) {
    init_flips();
    str_block_hash = PyUnicode_InternFromString("block_hash");
    str_tokens_hash = PyUnicode_InternFromString("tokens_hash");
    if (!str_block_hash || !str_tokens_hash || PyType_Ready(&IndexType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module_def);
    if (!m) return NULL;
    Py_INCREF(&IndexType);
    if (PyModule_AddObject(m, "BlockIndex", (PyObject *)&IndexType) < 0) {
        Py_DECREF(&IndexType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
