/* Peak zmm FMA and VPDPBUSD throughput of one core (docs/results/tried-1206h.txt item 5):
   gcc -O2 -march=native -o peak docs/results/cpu_peaks.c && ./peak */
/* FMA and VPDPBUSD throughput per core: independent accumulator chains kept in registers (no memory clobber) */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
#define CH 12
int main(){
  long N=200000000;
  __m512 a0=_mm512_set1_ps(0.f),a1=_mm512_set1_ps(1.f),a2=_mm512_set1_ps(2.f),a3=_mm512_set1_ps(3.f),a4=_mm512_set1_ps(4.f),a5=_mm512_set1_ps(5.f),a6=_mm512_set1_ps(6.f),a7=_mm512_set1_ps(7.f),a8=_mm512_set1_ps(8.f),a9=_mm512_set1_ps(9.f),a10=_mm512_set1_ps(10.f),a11=_mm512_set1_ps(11.f);
  __m512 x=_mm512_set1_ps(0.999999f), y=_mm512_set1_ps(1e-7f);
  double t=now();
  for(long n=0;n<N;n++){
    a0=_mm512_fmadd_ps(a0,x,y);a1=_mm512_fmadd_ps(a1,x,y);a2=_mm512_fmadd_ps(a2,x,y);a3=_mm512_fmadd_ps(a3,x,y);
    a4=_mm512_fmadd_ps(a4,x,y);a5=_mm512_fmadd_ps(a5,x,y);a6=_mm512_fmadd_ps(a6,x,y);a7=_mm512_fmadd_ps(a7,x,y);
    a8=_mm512_fmadd_ps(a8,x,y);a9=_mm512_fmadd_ps(a9,x,y);a10=_mm512_fmadd_ps(a10,x,y);a11=_mm512_fmadd_ps(a11,x,y);
    __asm__ volatile("" : "+v"(x));
  }
  double dt=now()-t;
  __m512 s=_mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a0,a1),_mm512_add_ps(a2,a3)),_mm512_add_ps(_mm512_add_ps(a4,a5),_mm512_add_ps(a6,a7)));
  s=_mm512_add_ps(s,_mm512_add_ps(_mm512_add_ps(a8,a9),_mm512_add_ps(a10,a11)));
  printf("zmm FMA: %.2f per ns, %.1f GFLOP/s a core (%g)\n", N*12.0/dt/1e9, N*12.0*32/dt/1e9, _mm512_reduce_add_ps(s));
  __m512i b0=_mm512_set1_epi32(0),b1=_mm512_set1_epi32(1),b2=_mm512_set1_epi32(2),b3=_mm512_set1_epi32(3),b4=_mm512_set1_epi32(4),b5=_mm512_set1_epi32(5),b6=_mm512_set1_epi32(6),b7=_mm512_set1_epi32(7),b8=_mm512_set1_epi32(8),b9=_mm512_set1_epi32(9),b10=_mm512_set1_epi32(10),b11=_mm512_set1_epi32(11);
  __m512i u=_mm512_set1_epi8(3), v=_mm512_set1_epi8(5);
  t=now();
  for(long n=0;n<N;n++){
    b0=_mm512_dpbusd_epi32(b0,u,v);b1=_mm512_dpbusd_epi32(b1,u,v);b2=_mm512_dpbusd_epi32(b2,u,v);b3=_mm512_dpbusd_epi32(b3,u,v);
    b4=_mm512_dpbusd_epi32(b4,u,v);b5=_mm512_dpbusd_epi32(b5,u,v);b6=_mm512_dpbusd_epi32(b6,u,v);b7=_mm512_dpbusd_epi32(b7,u,v);
    b8=_mm512_dpbusd_epi32(b8,u,v);b9=_mm512_dpbusd_epi32(b9,u,v);b10=_mm512_dpbusd_epi32(b10,u,v);b11=_mm512_dpbusd_epi32(b11,u,v);
    __asm__ volatile("" : "+v"(u));
  }
  dt=now()-t;
  __m512i r=_mm512_add_epi32(_mm512_add_epi32(_mm512_add_epi32(b0,b1),_mm512_add_epi32(b2,b3)),_mm512_add_epi32(_mm512_add_epi32(b4,b5),_mm512_add_epi32(b6,b7)));
  r=_mm512_add_epi32(r,_mm512_add_epi32(_mm512_add_epi32(b8,b9),_mm512_add_epi32(b10,b11)));
  printf("zmm VPDPBUSD: %.2f per ns, %.0f GMAC/s a core (%d)\n", N*12.0/dt/1e9, N*12.0*64/dt/1e9, _mm512_reduce_add_epi32(r));
}
