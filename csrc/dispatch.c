/* CPU detection and the one dispatch table.
 *
 * A feature counts only when CPUID lists it AND the OS saves its registers
 * (XGETBV): CPUID on these machines lists AMX although a process must first
 * ask for it with arch_prctl, and a hypervisor may hide AVX-512 state. */
#define _GNU_SOURCE /* syscall() */
#include "kernels.h"
#include "scratch.h"

#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#define CISM_X86 1
#endif
#if defined(CISM_X86) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

static cism_kernels table;
static cism_cpu cpu;
static int level_in_use = -1;
static int level_max = CISM_ISA_REF;
static const char *isa_error = "";
static cism_amx_emulator amx_emulator; /* tests only: cism_emulate_amx */

static const char *const level_names[] = {"ref", "avx2", "avx512", "avx512vnni", "amx"};

const char *cism_isa_name(int level) {
    return (level >= 0 && level <= CISM_ISA_AMX) ? level_names[level] : "?";
}

#ifdef CISM_X86
static unsigned long long read_xcr0(void) {
    unsigned int eax, edx;
    __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
    return ((unsigned long long)edx << 32) | eax;
}
#endif

static void detect(void) {
    memset(&cpu, 0, sizeof cpu);
#ifdef CISM_X86
    unsigned int a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return;
    const int osxsave = (c >> 27) & 1;
    cpu.fma = (c >> 12) & 1;
    cpu.f16c = (c >> 29) & 1;
    const int avx = (c >> 28) & 1;
    unsigned long long xcr0 = 0;
    if (osxsave) xcr0 = read_xcr0();
    /* XMM (bit 1) and YMM (bit 2) state */
    cpu.os_avx = osxsave && avx && (xcr0 & 0x6) == 0x6;
    /* plus opmask (5), ZMM_Hi256 (6), Hi16_ZMM (7) */
    cpu.os_avx512 = cpu.os_avx && (xcr0 & 0xe0) == 0xe0;
    /* XTILECFG (17), XTILEDATA (18); still needs ARCH_REQ_XCOMP_PERM on Linux */
    cpu.os_amx = (xcr0 & 0x60000ULL) == 0x60000ULL;
    unsigned int max_leaf = __get_cpuid_max(0, 0);
    if (max_leaf >= 7) {
        __cpuid_count(7, 0, a, b, c, d);
        cpu.avx2 = (b >> 5) & 1;
        cpu.avx512f = (b >> 16) & 1;
        cpu.avx512dq = (b >> 17) & 1;
        cpu.avx512bw = (b >> 30) & 1;
        cpu.avx512vl = (b >> 31) & 1;
        cpu.avx512vnni = (c >> 11) & 1;
        cpu.avx512vbmi = (c >> 1) & 1;
        cpu.gfni = (c >> 8) & 1;
        cpu.amx_tile = (d >> 24) & 1;
        cpu.amx_bf16 = (d >> 22) & 1;
        cpu.amx_int8 = (d >> 25) & 1;
        __cpuid_count(7, 1, a, b, c, d);
        cpu.avx_vnni = (a >> 4) & 1;
        cpu.avx512bf16 = (a >> 5) & 1;
    }
    if (!cpu.os_avx) cpu.avx2 = cpu.fma = cpu.f16c = 0;
    if (!cpu.os_avx512) cpu.avx512f = cpu.avx512dq = cpu.avx512bw = cpu.avx512vl = cpu.avx512vnni = cpu.avx512vbmi = cpu.gfni = 0;
    if (!cpu.os_avx) cpu.avx_vnni = 0;
    if (!cpu.os_avx512) cpu.avx512bf16 = 0;
    if (!cpu.os_amx) cpu.amx_tile = cpu.amx_bf16 = cpu.amx_int8 = 0;
#if defined(__linux__) && defined(CISM_HAVE_AMX)
    /* Linux hands out the tile state (8 KiB per thread) only on request;
     * once granted it holds for every thread of the process. */
    if (cpu.amx_tile && cpu.amx_bf16 && cpu.amx_int8 && cpu.avx512bf16)
        cpu.amx_granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                  18 /* XFEATURE_XTILEDATA */) == 0;
#endif
    if (cpu.avx2 && cpu.fma && cpu.f16c) level_max = CISM_ISA_AVX2;
    if (level_max == CISM_ISA_AVX2 && cpu.avx512f && cpu.avx512bw && cpu.avx512vl && cpu.avx512dq)
        level_max = CISM_ISA_AVX512;
    if (level_max == CISM_ISA_AVX512 && cpu.avx512vnni) level_max = CISM_ISA_AVX512VNNI;
    if (level_max == CISM_ISA_AVX512VNNI && cpu.amx_granted && cpu.avx512vbmi && cpu.gfni) level_max = CISM_ISA_AMX;
#endif
}

static void fill(int level) {
    memset(&table, 0, sizeof table);
    cism_fill_gemm_ref(&table);
    cism_fill_gemm_q8_ref(&table);
    cism_fill_attn_ref(&table);
    cism_fill_convert_ref(&table);
    cism_fill_act_ref(&table);
#ifdef CISM_X86
    if (level >= CISM_ISA_AVX2) {
        cism_fill_gemm_avx2(&table);
        cism_fill_gemm_q8_avx2(&table);
        cism_fill_attn_avx2(&table);
        cism_fill_convert_avx2(&table);
        cism_fill_act_avx2(&table);
    }
    if (level >= CISM_ISA_AVX512) {
        cism_fill_gemm_avx512(&table);
        cism_fill_gemm_q8_avx512(&table);
        cism_fill_attn_avx512(&table);
        cism_fill_convert_avx512(&table);
        cism_fill_act_avx512(&table);
    }
    if (level >= CISM_ISA_AVX512VNNI) cism_fill_gemm_q8_avx512vnni(&table);
#ifdef CISM_HAVE_AMX
    /* bf16 without AMX (VDPBF16PS); the amx level's tile kernel replaces it */
    if (level >= CISM_ISA_AVX512VNNI && cpu.avx512bf16) {
        cism_fill_gemm_avx512bf16(&table);
        cism_fill_attn_avx512bf16(&table);
    }
#endif
    if (level >= CISM_ISA_AMX && amx_emulator) amx_emulator(&table, cism_scratch_get, cism_scratch_put);
#ifdef CISM_HAVE_AMX
    else if (level >= CISM_ISA_AMX) {
        cism_fill_gemm_amx(&table);
        cism_fill_gemm_q8_amx(&table);
    }
#endif
#endif
    level_in_use = level;
}

int cism_init(void) {
    if (level_in_use >= 0) return isa_error[0] ? -1 : 0;
    detect();
    int level = level_max;
    const char *env = getenv("CISM_ISA");
    if (env && *env) {
        int wanted = -1;
        for (int i = 0; i <= CISM_ISA_AMX; i++)
            if (strcmp(env, level_names[i]) == 0) wanted = i;
        if (wanted < 0) {
            isa_error = "CISM_ISA must be one of ref, avx2, avx512, avx512vnni, amx";
            level = CISM_ISA_REF;
        } else if (wanted > level_max) {
            /* asking for more than the CPU has is not an error: cap it */
            level = level_max;
        } else {
            level = wanted;
        }
    }
    fill(level);
    return isa_error[0] ? -1 : 0;
}

int cism_set_isa(int level) {
    cism_init();
    const int top = amx_emulator ? CISM_ISA_AMX : level_max;
    if (level < 0 || level > top) return -1;
    fill(level);
    return 0;
}

int cism_emulate_amx(cism_amx_emulator emulator) {
    cism_init();
    if (emulator && !(level_max >= CISM_ISA_AVX512VNNI && cpu.avx512bf16)) return -1;
    amx_emulator = emulator;
    if (level_in_use > level_max) fill(level_max);
    else if (level_in_use == CISM_ISA_AMX) fill(CISM_ISA_AMX); /* the real unit again, or now emulated */
    return 0;
}

const cism_kernels *cism_table(void) { cism_init(); return &table; }
const cism_cpu *cism_cpu_features(void) { cism_init(); return &cpu; }
int cism_isa_level(void) { cism_init(); return level_in_use; }
int cism_isa_max(void) { cism_init(); return level_max; }
const char *cism_isa_error(void) { return isa_error; }
