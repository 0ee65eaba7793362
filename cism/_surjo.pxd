# The Surjo family's C structures (cimport cism._surjo): the model, its
# layers and execution plan, a sequence's state, the forward's scratch.
from libc.stdint cimport uint8_t
from cism._kernels cimport cism_mat
from cism._attention cimport AttnWork
from cism._kvcache cimport KV
from cism._step cimport Stepper
from cism._weights cimport ModelBase, WeightStore


cdef struct Layer:
    bint xsa
    const float *input_norm    # (hidden,)
    const float *post_norm     # (hidden,)
    # XSA: q (H*Dh, D), k and v (Hkv*Dh, D), o (D, H*Dh).
    # GDN: q and k (Kt, D), v (Vt, D), o (D, Vt).
    cism_mat q, k, v, o
    const float *q_norm        # XSA (Dh,)
    const float *k_norm        # XSA (Dh,)
    cism_mat b                 # GDN beta (Kt, D)
    cism_mat w                 # GDN write gate (Vt, D)
    cism_mat f0, f1            # GDN decay rate: (Dv, D), (Kt, Dv)
    cism_mat g0, g1            # GDN output gate: (Dv, D), (Vt, Dv)
    const float *q_conv        # GDN (Kt, W), tap W-1 multiplies the newest input
    const float *k_conv        # GDN (Kt, W)
    const float *v_conv        # GDN (Vt, W)
    const float *a_exp         # GDN (H,) exp(A_log)
    const float *dt_bias       # GDN (Kt,)
    const float *g_bias        # GDN (Vt,)
    const float *o_norm        # GDN (Dv,)
    cism_mat gate, up, down    # SwiGLU MLP (F, D), (F, D), (D, F)


cdef struct Step:
    size_t layer
    size_t pass_
    int slot                   # XSA KV slot, or -1
    int state                  # GDN state index, or -1


cdef struct ModelC:
    ModelBase base             # sizes, embedding, head, final norm, rope, threads (cism/_weights.pxd)
    size_t v_heads, k_dim, v_dim, key_total, value_total, conv, fifo   # fifo = conv - 1
    size_t state_len           # floats of one GDN state incl. its FIFOs
    bint xsa_projection
    Layer *layer
    Step *plan
    size_t n_steps, n_slots, n_states
    bint kv_f16                # XSA slots hold binary16 (kv_precision "fp16")


cdef struct State:
    # Everything a sequence carries between tokens.
    KV kv                      # the XSA slots' rotated keys and values: a KV
                               #   cache (cism/_kvcache.pxd) with one "layer" per slot
    float *rec                 # (states, state_len): per GDN (layer, pass)
                               #   S (Hv, K, Dv), then FIFOs q (Kt, W-1), k (Kt, W-1), v (Vt, W-1)


cdef struct Work:
    AttnWork a      # the attention family's token-major scratch (XSA steps, MLP, head)
    float *gq       # (T, Kt)        GDN q, conv'd in place
    float *gk       # (T, Kt)
    float *gv       # (T, Vt)
    float *gb       # (T, Kt)        beta
    float *gw       # (T, Vt)        write gate
    float *gf       # (T, Kt)        decay rate, then decay
    float *gg       # (T, Vt)        output gate logits
    float *go       # (T, Vt)        GDN output
    float *fmid     # (T, Dv)
    float *gmid     # (T, Dv)
    float *delta    # (threads, 2 * Dv) delta-rule read and update vectors


cdef class SurjoModel(WeightStore):
    cdef ModelC c
    cdef size_t stream_bytes_
    cdef _build_plan(self)


cdef class SurjoStepper(Stepper):
    cdef const ModelC *m
    cdef Work w
    cdef const uint8_t *skip     # plan steps left out (the neural drafter), or NULL


cdef int state_alloc(State *st, const ModelC *m, size_t capacity) noexcept nogil
cdef void state_free(State *st) noexcept nogil
cdef object check_capacity(const ModelC *m, size_t prompt_len, size_t max_new)
