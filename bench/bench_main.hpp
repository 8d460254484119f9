#pragma once
// What every benchmark binary shares around Google Benchmark: sweep axes
// from the command line (--batch=1,8 --context=32768,262144 --preset=standard
// --head_dim=128 --dtype=bf16, each a comma-separated list; a binary reads
// the axes it has), and the device and build in every JSON's context
// (gpu_name, gpu_cc, gpu_sms, clocks, driver and runtime, hisparse_commit,
// hisparse_dirty), so a result file says where and from what it came.

#include <benchmark/benchmark.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "hisparse_build_commit.h"  // generated at build time (cmake/commit_header.cmake)

namespace hisparse::bench {

/// The axes a user can sweep, with each binary's defaults.
struct sweep {
  std::vector<std::int64_t> batch, context, head_dim;
  std::vector<std::string> preset, dtype;
};

inline std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

/// Reads and removes --batch, --context, --preset, --head_dim and --dtype
/// (as --name=a,b,c) from argv, leaving Google Benchmark's flags. Exits with
/// a message on a malformed value.
inline sweep parse_sweep(int& argc, char** argv, sweep s) {
  auto numbers = [](const char* flag, const std::string& v) {
    std::vector<std::int64_t> out;
    for (const auto& item : split_list(v)) {
      char* end = nullptr;
      const long long x = std::strtoll(item.c_str(), &end, 10);
      if (end == item.c_str() || *end != '\0' || x < 1) {
        std::fprintf(stderr, "--%s: '%s' is not a positive integer\n", flag, item.c_str());
        std::exit(2);
      }
      out.push_back(x);
    }
    return out;
  };
  int kept = 1;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&](const char* name) -> const char* {
      const std::string prefix = std::string("--") + name + "=";
      return arg.rfind(prefix, 0) == 0 ? argv[i] + prefix.size() : nullptr;
    };
    if (const char* v = value("batch")) {
      s.batch = numbers("batch", v);
    } else if (const char* v = value("context")) {
      s.context = numbers("context", v);
    } else if (const char* v = value("head_dim")) {
      s.head_dim = numbers("head_dim", v);
    } else if (const char* v = value("preset")) {
      s.preset = split_list(v);
    } else if (const char* v = value("dtype")) {
      s.dtype = split_list(v);
    } else {
      if (arg == "--help")
        std::printf(
            "HiSparse sweep axes (comma-separated lists; each binary reads those it has):\n"
            "  --batch=B,...  --context=T,...  --preset=NAME,...  --head_dim=64|128|256,...  --dtype=bf16|fp16,...\n\n");
      argv[kept++] = argv[i];
    }
  }
  argc = kept;
  return s;
}

/// The NVIDIA kernel driver's version ("580.159.04"), from
/// /proc/driver/nvidia/version on Linux: the first dotted number after
/// "Kernel Module" (the open module's line reads "... Open Kernel Module for
/// x86_64  580.159.04 ..."); "unknown" elsewhere.
inline std::string kernel_driver_version() {
  std::ifstream in("/proc/driver/nvidia/version");
  std::string line;
  std::getline(in, line);
  const auto at = line.find("Kernel Module");
  if (at == std::string::npos) return "unknown";
  std::stringstream words(line.substr(at + 13));
  for (std::string v; words >> v;)
    if (!v.empty() && v[0] >= '0' && v[0] <= '9' && v.find('.') != std::string::npos) return v;
  return "unknown";
}

/// The device this process runs on, and the build, in the JSON's context.
inline void add_device_context() {
  int device = 0;
  cudaDeviceProp p{};
  if (cudaGetDevice(&device) != cudaSuccess || cudaGetDeviceProperties(&p, device) != cudaSuccess) {
    benchmark::AddCustomContext("gpu_name", "none");
  } else {
    int clock_khz = 0, mem_khz = 0, driver = 0, runtime = 0;
    (void)cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, device);
    (void)cudaDeviceGetAttribute(&mem_khz, cudaDevAttrMemoryClockRate, device);
    (void)cudaDriverGetVersion(&driver);
    (void)cudaRuntimeGetVersion(&runtime);
    auto version = [](int v) { return std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10); };
    benchmark::AddCustomContext("gpu_name", p.name);
    benchmark::AddCustomContext("gpu_cc", std::to_string(p.major) + "." + std::to_string(p.minor));
    benchmark::AddCustomContext("gpu_sms", std::to_string(p.multiProcessorCount));
    benchmark::AddCustomContext("gpu_sm_clock_max_mhz", std::to_string(clock_khz / 1000));
    benchmark::AddCustomContext("gpu_mem_clock_max_mhz", std::to_string(mem_khz / 1000));
    benchmark::AddCustomContext("gpu_memory_gib", std::to_string(static_cast<double>(p.totalGlobalMem) / (1 << 30)));
    benchmark::AddCustomContext("gpu_driver", kernel_driver_version());
    benchmark::AddCustomContext("cuda_driver_api", version(driver));
    benchmark::AddCustomContext("cuda_runtime", version(runtime));
  }
  benchmark::AddCustomContext("hisparse_commit", HISPARSE_BUILD_COMMIT);
  benchmark::AddCustomContext("hisparse_dirty", HISPARSE_BUILD_DIRTY ? "1" : "0");
}

/// main() of a benchmark binary: the sweep flags, then `register_all(axes)`,
/// then Google Benchmark with the device context.
inline int run_main(int argc, char** argv, const sweep& defaults,
                    const std::function<void(const sweep&)>& register_all) {
  const sweep axes = parse_sweep(argc, argv, defaults);
  try {
    register_all(axes);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  add_device_context();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

}  // namespace hisparse::bench
