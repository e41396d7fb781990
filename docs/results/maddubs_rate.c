/* VPMADDUBSW / FMA throughput on this CPU: 12 independent chains each, ns per instruction (docs/results/zen2-1205.txt).
   gcc -O2 -march=native docs/results/maddubs_rate.c -o /tmp/mr && /tmp/mr */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(){
  __m256i a[12]; __m256i x=_mm256_set1_epi8(3), y=_mm256_set1_epi8(5);
  for(int i=0;i<12;i++) a[i]=_mm256_set1_epi16(i);
  long N=100000000;
  double t0=now();
  for(long n=0;n<N;n++){
    #pragma GCC unroll 12
    for(int i=0;i<12;i++){ a[i]=_mm256_maddubs_epi16(x,a[i]); }
    __asm__ volatile("" : "+x"(x));
  }
  double t1=now();
  // maddubs independent + add
  __m256i b[12]; for(int i=0;i<12;i++) b[i]=_mm256_set1_epi16(i);
  double t2=now();
  for(long n=0;n<N;n++){
    #pragma GCC unroll 12
    for(int i=0;i<6;i++){ b[i]=_mm256_add_epi16(b[i], _mm256_maddubs_epi16(x,y)); b[i+6]=_mm256_add_epi16(b[i+6], _mm256_maddubs_epi16(y,x)); }
    __asm__ volatile("" : "+x"(x), "+x"(y));
  }
  double t3=now();
  // fma throughput reference
  __m256 f[12]; __m256 fx=_mm256_set1_ps(1.0001f);
  for(int i=0;i<12;i++) f[i]=_mm256_set1_ps(i);
  double t4=now();
  for(long n=0;n<N;n++){
    #pragma GCC unroll 12
    for(int i=0;i<12;i++){ f[i]=_mm256_fmadd_ps(fx,f[i],fx); }
    __asm__ volatile("" : "+x"(fx));
  }
  double t5=now();
  int s=0; for(int i=0;i<12;i++) s+=_mm256_extract_epi16(a[i],0)+_mm256_extract_epi16(b[i],0)+(int)f[i][0];
  printf("maddubs chain x12: %.3f ns/instr\nmaddubs+add x12: %.3f ns/pair\nfma x12: %.3f ns/instr (%d)\n",(t1-t0)/N/12*1e9,(t3-t2)/N/12*1e9,(t5-t4)/N/12*1e9,s);
}
