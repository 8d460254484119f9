# C++20 for the CUDA sources of a target that links HiSparse. CMake knows
# nvcc's C++20 flag from 3.25.2 on (cuda_std_20 then raises any lower
# CUDA_STANDARD a consumer sets); before that, CUDA_STANDARD 20 puts no -std
# on the nvcc line at all, so the flag goes on unconditionally. Included by
# the project and by the installed package config, so the consumer's CMake
# decides, not the one that built the package.
function(hisparse_require_cuda_cxx20 target scope)
  if(CMAKE_VERSION VERSION_GREATER_EQUAL 3.25.2)
    target_compile_features(${target} ${scope} cuda_std_20)
  else()
    target_compile_options(${target} ${scope} $<$<COMPILE_LANGUAGE:CUDA>:-std=c++20>)
  endif()
endfunction()
