"""Could a hand-written CPU matmul make a few-row verify cheap on this CPU?

Times, side by side in one process, y = x @ W^T for 30 f32 matrices [3072, 576] (SmolLM2's layer
weights' scale, 212 MB) at M = 1..32 rows:
  xla      XLA:CPU's dot as the model runs it (`W @ x^T` at HIGHEST, one jit over the 30 matrices);
  rowdot   an AVX2/FMA kernel over W in its GGUF order [N, K] (2 rows x 4 outputs per register tile,
           reads each W tile once for all M rows), 2 OpenMP threads;
  panel    the BLIS-style form: W repacked at load into [N/16, K, 16] panels, 6 rows x 16 outputs
           per register tile (broadcast x, stream W), 2 OpenMP threads;
  q4_1     W kept in GGUF Q4_1 (random 4-bit codes, per-32 scale d and min m; as planes: codes
           [N, K/2] bytes, d and m [N, K/32] float32), unpacked in registers,
           y = sum_b d_b (q_b . x_b) + m_b sum(x_b): 0.75 bytes a weight read instead of 4;
and the machine's FMA peak (10 independent FMA chains per thread). Needs g++ with -mavx2 -mfma.

    python scripts/studies/cpu_handwritten_matmul.py --json_out bench_out/cpu/handwritten_matmul.json
"""
import argparse
import ctypes
import json
import os
import statistics
import subprocess
import tempfile
import time

import numpy as np

SRC = r"""
#include <immintrin.h>
#include <cstdint>
#include <chrono>
static inline float hsum(__m256 v){ __m128 a=_mm256_castps256_ps128(v), b=_mm256_extractf128_ps(v,1);
  a=_mm_add_ps(a,b); a=_mm_hadd_ps(a,a); a=_mm_hadd_ps(a,a); return _mm_cvtss_f32(a);}
template<int MG, int NB>
static inline void rtile(const float* x, const float* w, float* y, int64_t K, int64_t N, int64_t m0, int64_t n0){
  __m256 acc[MG][NB];
  for(int i=0;i<MG;i++) for(int j=0;j<NB;j++) acc[i][j]=_mm256_setzero_ps();
  for(int64_t k=0;k<K;k+=8){
    __m256 wv[NB];
    for(int j=0;j<NB;j++) wv[j]=_mm256_loadu_ps(w+(n0+j)*K+k);
    for(int i=0;i<MG;i++){ __m256 xv=_mm256_loadu_ps(x+(m0+i)*K+k);
      for(int j=0;j<NB;j++) acc[i][j]=_mm256_fmadd_ps(xv,wv[j],acc[i][j]); }
  }
  for(int i=0;i<MG;i++) for(int j=0;j<NB;j++) y[(m0+i)*N+n0+j]=hsum(acc[i][j]);
}
extern "C" void rowdot(const float* x, const float* w, float* y, int64_t M, int64_t N, int64_t K){
  #pragma omp parallel for schedule(static)
  for(int64_t n0=0;n0<N;n0+=4){ int64_t m=0;
    for(;m+2<=M;m+=2) rtile<2,4>(x,w,y,K,N,m,n0);
    for(;m<M;m++) rtile<1,4>(x,w,y,K,N,m,n0); }
}
template<int MG>
static inline void ptile(const float* x, const float* wp, float* y, int64_t K, int64_t N, int64_t m0, int64_t n0){
  __m256 a0[MG], a1[MG];
  for(int i=0;i<MG;i++){a0[i]=_mm256_setzero_ps(); a1[i]=_mm256_setzero_ps();}
  for(int64_t k=0;k<K;k++){
    __m256 w0=_mm256_loadu_ps(wp+k*16), w1=_mm256_loadu_ps(wp+k*16+8);
    for(int i=0;i<MG;i++){ __m256 b=_mm256_broadcast_ss(x+(m0+i)*K+k);
      a0[i]=_mm256_fmadd_ps(b,w0,a0[i]); a1[i]=_mm256_fmadd_ps(b,w1,a1[i]); }
  }
  for(int i=0;i<MG;i++){ _mm256_storeu_ps(y+(m0+i)*N+n0,a0[i]); _mm256_storeu_ps(y+(m0+i)*N+n0+8,a1[i]); }
}
extern "C" void panel(const float* x, const float* w, float* y, int64_t M, int64_t N, int64_t K){
  #pragma omp parallel for schedule(static)
  for(int64_t p=0;p<N/16;p++){ const float* wp=w+p*K*16; int64_t n0=p*16, m=0;
    for(;m+6<=M;m+=6) ptile<6>(x,wp,y,K,N,m,n0);
    switch(M-m){case 5: ptile<5>(x,wp,y,K,N,m,n0);break; case 4: ptile<4>(x,wp,y,K,N,m,n0);break;
      case 3: ptile<3>(x,wp,y,K,N,m,n0);break; case 2: ptile<2>(x,wp,y,K,N,m,n0);break;
      case 1: ptile<1>(x,wp,y,K,N,m,n0);break;} }
}
static inline float hsum_q(__m256 v){ __m128 a=_mm256_castps256_ps128(v), b=_mm256_extractf128_ps(v,1);
  a=_mm_add_ps(a,b); a=_mm_hadd_ps(a,a); a=_mm_hadd_ps(a,a); return _mm_cvtss_f32(a);}
// planes: qs [N, K/2] uint8 (ggml order within a block of 32: byte j holds w_j (low) and w_{j+16} (high)),
// d, m [N, K/32] f32.  xs: [M, K/32] block sums of x.  y[M,N] = x @ W^T
template<int MG>
static inline void row_tile(const float* x, const float* xs, const uint8_t* qs, const float* d, const float* mm,
                            float* y, int64_t K, int64_t N, int64_t n, int64_t m0){
  const int64_t nb=K/32;
  __m256 acc[MG]; for(int i=0;i<MG;i++) acc[i]=_mm256_setzero_ps();
  const __m128i mask=_mm_set1_epi8(0x0F);
  const uint8_t* q=qs+n*(K/2); const float* dn=d+n*nb;
  for(int64_t b=0;b<nb;b++){
    __m128i v=_mm_loadu_si128((const __m128i*)(q+b*16));
    __m128i lo=_mm_and_si128(v,mask), hi=_mm_and_si128(_mm_srli_epi16(v,4),mask);
    __m256 q0=_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    __m256 q1=_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo,8)));
    __m256 q2=_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    __m256 q3=_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi,8)));
    __m256 db=_mm256_broadcast_ss(dn+b);
    for(int i=0;i<MG;i++){
      const float* xr=x+(m0+i)*K+b*32;
      __m256 t=_mm256_mul_ps(q0,_mm256_loadu_ps(xr));
      t=_mm256_fmadd_ps(q1,_mm256_loadu_ps(xr+8),t);
      t=_mm256_fmadd_ps(q2,_mm256_loadu_ps(xr+16),t);
      t=_mm256_fmadd_ps(q3,_mm256_loadu_ps(xr+24),t);
      acc[i]=_mm256_fmadd_ps(t,db,acc[i]);
    }
  }
  const float* mn=mm+n*nb;
  for(int i=0;i<MG;i++){
    const float* xsr=xs+(m0+i)*nb; __m256 a=_mm256_setzero_ps(); int64_t b=0;
    for(;b+8<=nb;b+=8) a=_mm256_fmadd_ps(_mm256_loadu_ps(mn+b),_mm256_loadu_ps(xsr+b),a);
    float s=hsum_q(a); for(;b<nb;b++) s+=mn[b]*xsr[b];
    y[(m0+i)*N+n]=hsum_q(acc[i])+s;
  }
}
extern "C" void q41(const float* x, const float* xs, const uint8_t* qs, const float* d, const float* mm,
                    float* y, int64_t M, int64_t N, int64_t K){
  #pragma omp parallel for schedule(static)
  for(int64_t n=0;n<N;n++){ int64_t m=0;
    for(;m+4<=M;m+=4) row_tile<4>(x,xs,qs,d,mm,y,K,N,n,m);
    switch(M-m){case 3: row_tile<3>(x,xs,qs,d,mm,y,K,N,n,m);break; case 2: row_tile<2>(x,xs,qs,d,mm,y,K,N,n,m);break; case 1: row_tile<1>(x,xs,qs,d,mm,y,K,N,n,m);break;}
  }
}

extern "C" double fma_peak_gflops(int threads){
  long iters=100000000; double t0=0; float out=0;
  auto s=std::chrono::steady_clock::now();
  #pragma omp parallel num_threads(threads) reduction(+:out)
  { __m256 a[10]; for(int i=0;i<10;i++) a[i]=_mm256_set1_ps(i*1e-3f);
    __m256 b=_mm256_set1_ps(0.999f), c=_mm256_set1_ps(1e-4f);
    for(long it=0;it<iters/threads;it++){ for(int i=0;i<10;i++) a[i]=_mm256_fmadd_ps(a[i],b,c);}
    for(int i=0;i<10;i++) out+=a[i][0]; }
  t0=std::chrono::duration<double>(std::chrono::steady_clock::now()-s).count();
  return iters*10.0*16/t0/1e9 + 0*out;
}
"""


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--json_out", default="")
  ap.add_argument("--rows", default="1,2,4,5,8,9,16,23,32")
  ap.add_argument("--repeats", type=int, default=10)
  args = ap.parse_args()
  import jax
  import jax.numpy as jnp
  jax.config.update("jax_platforms", "cpu")
  d = tempfile.mkdtemp()
  src, so = os.path.join(d, "k.cc"), os.path.join(d, "k.so")
  open(src, "w").write(SRC)
  subprocess.run(["g++", "-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC", src, "-o", so], check=True)
  lib = ctypes.CDLL(so)
  for f in (lib.rowdot, lib.panel):
    f.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3
  lib.q41.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 3
  lib.fma_peak_gflops.restype = ctypes.c_double
  L, N, K = 30, 3072, 576
  rng = np.random.default_rng(0)
  ws = [rng.normal(size=(N, K)).astype(np.float32) for _ in range(L)]
  panels = [np.ascontiguousarray(w.reshape(N // 16, 16, K).transpose(0, 2, 1)) for w in ws]
  nb = K // 32
  q4 = []
  for _ in range(L):
    q = rng.integers(0, 16, size=(N, K)).astype(np.uint8)
    d = (rng.random((N, nb)) * 0.01).astype(np.float32)
    mn = (-rng.random((N, nb)) * 0.05).astype(np.float32)
    qb = q.reshape(N, nb, 2, 16)
    codes = np.ascontiguousarray((qb[:, :, 0] | (qb[:, :, 1] << 4)).reshape(N, K // 2))
    q4.append((codes, d, mn, (q.reshape(N, nb, 32) * d[..., None] + mn[..., None]).reshape(N, K)))
  wj = [jnp.asarray(w) for w in ws]
  hi = jax.lax.Precision.HIGHEST
  xla = jax.jit(lambda x, ws: [jnp.dot(w, x.T, precision=hi).T for w in ws])

  def med(fn):
    fn()
    ts = []
    for _ in range(args.repeats):
      t0 = time.perf_counter()
      fn()
      ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3

  rows = []
  for m in [int(v) for v in args.rows.split(",")]:
    x = rng.normal(size=(m, K)).astype(np.float32)
    y = np.empty((m, N), np.float32)
    xj = jnp.asarray(x)
    t_xla = med(lambda: jax.block_until_ready(xla(xj, wj)))
    t_row = med(lambda: [lib.rowdot(x.ctypes.data, w.ctypes.data, y.ctypes.data, m, N, K) for w in ws])
    err_row = float(np.abs(y - x @ ws[-1].T).max())
    t_pan = med(lambda: [lib.panel(x.ctypes.data, p.ctypes.data, y.ctypes.data, m, N, K) for p in panels])
    err_pan = float(np.abs(y - x @ ws[-1].T).max())
    xs = np.ascontiguousarray(x.reshape(m, nb, 32).sum(-1))
    t_q4 = med(lambda: [lib.q41(x.ctypes.data, xs.ctypes.data, c.ctypes.data, d.ctypes.data,
                                mn.ctypes.data, y.ctypes.data, m, N, K) for c, d, mn, _ in q4])
    ref = x.astype(np.float64) @ q4[-1][3].T
    err_q4 = float(np.abs(y - ref).max() / np.abs(ref).max())
    gf = 2.0 * L * N * K * m / 1e9
    rows.append(dict(rows=m, xla_ms=t_xla, rowdot_ms=t_row, panel_ms=t_pan, q4_1_ms=t_q4, gflop=gf,
                     max_abs_err_rowdot=err_row, max_abs_err_panel=err_pan,
                     max_rel_err_q4_1=err_q4))
  peak = {t: lib.fma_peak_gflops(t) for t in (1, 2)}
  print("| rows M | XLA dot ms (f32) | rowdot ms (f32) | panel ms (f32) | q4_1 ms | best f32 GFLOP/s |")
  print("|---|---|---|---|---|---|")
  for r in rows:
    best = min(r["xla_ms"], r["rowdot_ms"], r["panel_ms"])
    print(f"| {r['rows']} | {r['xla_ms']:.2f} | {r['rowdot_ms']:.2f} | {r['panel_ms']:.2f} | "
          f"{r['q4_1_ms']:.2f} | {r['gflop'] / best * 1e3:.1f} |")
  print(f"FMA peak GFLOP/s: 1 thread {peak[1]:.1f}, 2 threads {peak[2]:.1f}")
  out = dict(matrices=L, shape=[N, K], rows=rows, fma_peak_gflops=peak)
  print(json.dumps(out))
  if args.json_out:
    with open(args.json_out, "w") as fh:
      json.dump(out, fh, indent=1)


if __name__ == "__main__":
  main()
