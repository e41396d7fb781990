/* Scratch microbenchmark (2026-12-04, Xeon Sapphire Rapids, 1 core): AMX tile ops vs the vector rescale of their results.
   cc -O2 -march=native -o /tmp/amx_overlap docs/results/amx_overlap.c && /tmp/amx_overlap
   Output on 12-04:
     dpbsud only: 4.85 ns per op
     load A,B + dpbsud: 4.85 ns per group
     zero+load+dpbsud+store: 9.10 ns per group
     + 32 vector loads/cvt/add: 21.60 ns per group
     double-buffered readback: 19.06 ns per group
     vector part alone: 10.24 ns per group
   (a group: 16 rows x 16 outputs x 32 inputs; the vector part: 2 groups' 16 rows loaded, converted, added) */
#include <immintrin.h>
#include <stdio.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <sys/syscall.h>
#include <unistd.h>
typedef struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } __attribute__((packed)) cfg_t;
static double now(void){struct timespec t; clock_gettime(CLOCK_MONOTONIC,&t); return t.tv_sec+t.tv_nsec*1e-9;}
int main(void){
  syscall(SYS_arch_prctl, 0x1023, 18);
  cfg_t c; memset(&c,0,sizeof c); c.palette=1;
  for(int t=0;t<4;t++){c.rows[t]=16;c.colsb[t]=64;}
  for(int t=4;t<6;t++){c.rows[t]=16;c.colsb[t]=32;}
  for(int t=6;t<8;t++){c.rows[t]=8;c.colsb[t]=64;}
  _tile_loadconfig(&c);
  static int8_t A[16*2048] __attribute__((aligned(64))); static uint8_t B[8*64*64] __attribute__((aligned(64))); static int32_t C[4][256] __attribute__((aligned(64)));
  memset(A,1,sizeof A); memset(B,1,sizeof B);
  _tile_loadd(4,A,2048); _tile_loadd(5,A+32,2048); _tile_loadd(6,B,64); _tile_loadd(7,B+512,64);
  long N=2000000; double t;
  /* 1: dpbsud only, 4 independent accumulators */
  t=now(); for(long i=0;i<N;i++){_tile_dpbsud(0,4,6);_tile_dpbsud(1,5,7);_tile_dpbsud(2,4,6);_tile_dpbsud(3,5,7);} t=now()-t;
  printf("dpbsud only: %.2f ns per op\n", t/(4*N)*1e9);
  /* 2: load A,B + dpbsud per group, 2 sets */
  t=now(); for(long i=0;i<N;i++){ int o=(i&31)*32; _tile_loadd(4,A+o,2048); _tile_loadd(6,B+(i&7)*512,64); _tile_dpbsud(0,4,6); _tile_loadd(5,A+o+32,2048); _tile_loadd(7,B+((i+1)&7)*512,64); _tile_dpbsud(1,5,7);} t=now()-t;
  printf("load A,B + dpbsud: %.2f ns per group\n", t/(2*N)*1e9);
  /* 3: + zero + store C */
  t=now(); for(long i=0;i<N;i++){ int o=(i&31)*32; _tile_zero(0); _tile_loadd(4,A+o,2048); _tile_loadd(6,B+(i&7)*512,64); _tile_dpbsud(0,4,6); _tile_zero(1); _tile_loadd(5,A+o+32,2048); _tile_loadd(7,B+((i+1)&7)*512,64); _tile_dpbsud(1,5,7); _tile_stored(0,C[0],64); _tile_stored(1,C[1],64);} t=now()-t;
  printf("zero+load+dpbsud+store: %.2f ns per group\n", t/(2*N)*1e9);
  /* 4: + vector loads of C */
  __m512 acc[16]; for(int r=0;r<16;r++) acc[r]=_mm512_setzero_ps();
  t=now(); for(long i=0;i<N;i++){ int o=(i&31)*32; _tile_zero(0); _tile_loadd(4,A+o,2048); _tile_loadd(6,B+(i&7)*512,64); _tile_dpbsud(0,4,6); _tile_zero(1); _tile_loadd(5,A+o+32,2048); _tile_loadd(7,B+((i+1)&7)*512,64); _tile_dpbsud(1,5,7); _tile_stored(0,C[0],64); _tile_stored(1,C[1],64);
     for(int j=0;j<2;j++) for(int r=0;r<16;r++) acc[r]=_mm512_add_ps(acc[r], _mm512_cvtepi32_ps(_mm512_load_si512(C[j]+16*r)));} t=now()-t;
  float s=0; for(int r=0;r<16;r++) s+=_mm512_reduce_add_ps(acc[r]);
  printf("+ 32 vector loads/cvt/add: %.2f ns per group (%g)\n", t/(2*N)*1e9, s);

  /* 5: consume the previous iteration's C (double buffer) */
  static int32_t CC[2][2][256] __attribute__((aligned(64)));
  t=now(); for(long i=0;i<N;i++){ int o=(i&31)*32; int b=i&1; _tile_zero(0); _tile_loadd(4,A+o,2048); _tile_loadd(6,B+(i&7)*512,64); _tile_dpbsud(0,4,6); _tile_zero(1); _tile_loadd(5,A+o+32,2048); _tile_loadd(7,B+((i+1)&7)*512,64); _tile_dpbsud(1,5,7); _tile_stored(0,CC[b][0],64); _tile_stored(1,CC[b][1],64);
     for(int j=0;j<2;j++) for(int r=0;r<16;r++) acc[r]=_mm512_add_ps(acc[r], _mm512_cvtepi32_ps(_mm512_load_si512(CC[b^1][j]+16*r)));} t=now()-t;
  s=0; for(int r=0;r<16;r++) s+=_mm512_reduce_add_ps(acc[r]);
  printf("double-buffered readback: %.2f ns per group (%g)\n", t/(2*N)*1e9, s);
  /* 6: vector part alone (no tiles) */
  t=now(); for(long i=0;i<N;i++){ int b=i&1;
     for(int j=0;j<2;j++) for(int r=0;r<16;r++) acc[r]=_mm512_add_ps(acc[r], _mm512_cvtepi32_ps(_mm512_load_si512(CC[b^1][j]+16*r)));} t=now()-t;
  s=0; for(int r=0;r<16;r++) s+=_mm512_reduce_add_ps(acc[r]);
  printf("vector part alone: %.2f ns per group (%g)\n", t/(2*N)*1e9, s);
  return 0;
}
