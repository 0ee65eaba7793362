/* OpenMP queries that also compile without OpenMP (single-threaded build). */
#ifndef CISM_OMP_SHIM_H
#define CISM_OMP_SHIM_H
#ifdef _OPENMP
#include <omp.h>
static inline int cism_omp_available(void) { return 1; }
static inline int cism_omp_max_threads(void) { return omp_get_max_threads(); }
static inline int cism_omp_thread_num(void) { return omp_get_thread_num(); }
/* Ends the calling thread's team (its worker threads); the next parallel
 * region it runs starts a new one. */
static inline int cism_omp_release_team(void) {
#if _OPENMP >= 201811 || (defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 9)
    return omp_pause_resource_all(omp_pause_soft);
#else
    return -1;
#endif
}
#else
static inline int cism_omp_available(void) { return 0; }
static inline int cism_omp_max_threads(void) { return 1; }
static inline int cism_omp_thread_num(void) { return 0; }
static inline int cism_omp_release_team(void) { return 0; }
#endif
#endif
