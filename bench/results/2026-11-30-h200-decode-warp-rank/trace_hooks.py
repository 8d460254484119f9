# Scratch tool (not built by CMake): patches a copy of include/ and bench/ with globaltimer trace points
# in the decode selection and attention kernels and a dump in BM_decode_step (HISPARSE_SELECT_TRACE,
# HISPARSE_STEP_TRACE). Usage: python3 trace_hooks.py <tree> head|new, then build bench_attention with both macros.
import sys
root=sys.argv[1]; mode=sys.argv[2]  # mode: head or new (selection end hook differs)
# attention hooks
p=root+'/include/hisparse/attention/decode.cuh'
s=open(p).read()
hook='''
#ifdef HISPARSE_STEP_TRACE
__device__ unsigned long long hisparse_att_trace[4096][4];
#define ATT_TRACE(i) do { if (threadIdx.x == 0) { unsigned long long g_; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g_)); auto& e_ = hisparse_att_trace[blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z)][i]; if (e_ == 0) e_ = g_; } } while (0)
#else
#define ATT_TRACE(i) do {} while (0)
#endif
'''
i=s.index('namespace hisparse::attention {')
s=s[:i]+hook+s[i:]
def rep(old,new):
    global s
    assert s.count(old)==1, old
    s=s.replace(old,new)
rep("  const int split = blockIdx.x, b = blockIdx.z;\n","  const int split = blockIdx.x, b = blockIdx.z;\n  ATT_TRACE(0);\n")
rep("    wait_for_prior_grid();\n    const int n_kept = a.num_slices[at];\n","    wait_for_prior_grid();\n    ATT_TRACE(1);\n    const int n_kept = a.num_slices[at];\n")
rep("  if (single) return;\n\n  // Flash-decoding merge.","  ATT_TRACE(2);\n  if (single) return;\n\n  // Flash-decoding merge.")
rep("  if (counter != nullptr && threadIdx.x == 0) *counter = 0;\n}\n","  if (counter != nullptr && threadIdx.x == 0) *counter = 0;\n  ATT_TRACE(3);\n}\n")
open(p,'w').write(s)
if mode=='head':
    p=root+'/include/hisparse/select/decode_selection.cuh'
    s=open(p).read()
    hook2='''
#ifdef HISPARSE_SELECT_TRACE
__device__ unsigned long long hisparse_sel_trace[2048][14];
#define SEL_TRACE(i) do { if (threadIdx.x == 0) { unsigned long long g_; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g_)); if (hisparse_sel_trace[blockIdx.y * gridDim.x + blockIdx.x][i] == 0) hisparse_sel_trace[blockIdx.y * gridDim.x + blockIdx.x][i] = g_; } } while (0)
#else
#define SEL_TRACE(i) do {} while (0)
#endif
'''
    s=s.replace("namespace hisparse::select {\n","namespace hisparse::select {\n"+hook2,1)
    rep("  if (t == 0) p.out.num_slices[at] = kept_slices;\n}\n","  if (t == 0) p.out.num_slices[at] = kept_slices;\n  SEL_TRACE(8);\n}\n")
    rep('''  asm volatile("griddepcontrol.launch_dependents;\\n" ::: "memory");
#endif
''','''  asm volatile("griddepcontrol.launch_dependents;\\n" ::: "memory");
#endif
  SEL_TRACE(0);
''')
    open(p,'w').write(s)
# bench dump
p=root+'/bench/bench_attention.cu'
s=open(p).read()
dump='''
#ifdef HISPARSE_STEP_TRACE
  if (batch == 8 || batch == 1) {
    std::vector<std::vector<double>> sp(14), ap(4);
    for (int rep = 0; rep < 10; ++rep) {
      std::vector<unsigned long long> zs(2048 * 14, 0), za(4096 * 4, 0);
      HISPARSE_CUDA_CHECK(cudaMemcpyToSymbol(select::hisparse_sel_trace, zs.data(), zs.size() * 8));
      HISPARSE_CUDA_CHECK(cudaMemcpyToSymbol(attention::hisparse_att_trace, za.data(), za.size() * 8));
      step.step_seconds(timer, stream);
      HISPARSE_CUDA_CHECK(cudaStreamSynchronize(stream));
      HISPARSE_CUDA_CHECK(cudaMemcpyFromSymbol(zs.data(), select::hisparse_sel_trace, zs.size() * 8));
      HISPARSE_CUDA_CHECK(cudaMemcpyFromSymbol(za.data(), attention::hisparse_att_trace, za.size() * 8));
      unsigned long long t0 = ~0ull;
      for (int c = 0; c < 2048; ++c) if (zs[c * 14] && zs[c * 14] < t0) t0 = zs[c * 14];
      for (int c = 0; c < 2048; ++c) for (int i = 0; i < 14; ++i) if (zs[c * 14 + i] >= t0 && zs[c*14+i]) sp[i].push_back((zs[c * 14 + i] - t0) * 1e-3);
      for (int c = 0; c < 4096; ++c) for (int i = 0; i < 4; ++i) if (za[c * 4 + i] >= t0 && za[c*4+i]) ap[i].push_back((za[c * 4 + i] - t0) * 1e-3);
    }
    auto show = [](const char* n, std::vector<double> v) {
      if (v.empty()) { std::printf("  %-24s none\\n", n); return; }
      std::sort(v.begin(), v.end());
      auto at = [&](double f) { return v[static_cast<std::size_t>(f * (v.size() - 1))]; };
      std::printf("  %-24s n=%5zu min %6.2f p10 %6.2f med %6.2f p90 %6.2f max %6.2f\\n", n, v.size(), v[0], at(.1), at(.5), at(.9), v.back());
    };
    std::printf("STEP TRACE B=%d T=%d\\n", batch, static_cast<int>(context));
    show("sel start", sp[0]); show("sel fine scored", sp[5]); show("sel rank0 end", sp[8]);
    show("att start", ap[0]); show("att past wait", ap[1]); show("att stream done", ap[2]); show("att merge done", ap[3]);
  }
#endif
'''
rep("  for (int i = 0; i < 5; ++i) t_dense.push_back(", dump+"  for (int i = 0; i < 5; ++i) t_dense.push_back(")
open(p,'w').write(s)
