// Host side of the consumer: a config from the preset registry, validated,
// and the CPU reference on a tiny problem.
#include <cstdio>
#include <vector>

#include <hisparse/config.hpp>
#include <hisparse/reference/sparse_attention.hpp>

int launch_scale(float* data, int n);  // kernel.cu

int main() {
  using namespace hisparse;
  const preset_registry presets;
  const SparseAttentionConfig cfg = presets.get(preset_id::standard);
  require_valid(cfg);
  const attention_shape shape{4, 2, 64};
  std::vector<float> k(16 * 2 * 64, 0.25f), v(16 * 2 * 64, 1.5f), q(4 * 64, 0.5f);
  reference::sequence<float> seq;
  seq.keys = tensor_view<const float, 3>::contiguous(k.data(), 16, 2, 64);
  seq.values = tensor_view<const float, 3>::contiguous(v.data(), 16, 2, 64);
  seq.queries = tensor_view<const float, 3>::contiguous(q.data(), 1, 4, 64);
  seq.q_begin = 15;
  const auto r = reference::decode(cfg, shape, seq);
  std::printf("consumer: decode output[0] = %.3f (expected 1.500)\n", r.out(0, 0, 0));
  std::printf("consumer: kernel launch %s\n", launch_scale(nullptr, 0) == 0 ? "compiled" : "failed");
  return r.out(0, 0, 0) == 1.5 ? 0 : 1;
}
