/* A flag one thread sets (cancel) while another polls it inside compute. */
#ifndef CISM_FLAG_H
#define CISM_FLAG_H
static inline int cism_flag_get(const int *p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
static inline void cism_flag_set(int *p, int v) { __atomic_store_n(p, v, __ATOMIC_RELAXED); }
#endif
