/* OpenMP queries that also compile without OpenMP (single-threaded build). */
#ifndef CISM_OMP_SHIM_H
#define CISM_OMP_SHIM_H
#ifdef _OPENMP
#include <omp.h>
static inline int cism_omp_available(void) { return 1; }
static inline int cism_omp_max_threads(void) { return omp_get_max_threads(); }
static inline int cism_omp_thread_num(void) { return omp_get_thread_num(); }
#else
static inline int cism_omp_available(void) { return 0; }
static inline int cism_omp_max_threads(void) { return 1; }
static inline int cism_omp_thread_num(void) { return 0; }
#endif
#endif
