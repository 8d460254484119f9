# Fails when including the umbrella header compiles a kernel: every kernel
# must be a template that only a call instantiates (a non-template inline
# function that names a kernel compiles it into every including file).
#   cmake -DNVCC=... -DINCLUDE_DIRS=a;b -DWORK=dir -P no_kernels_on_include.cmake
file(WRITE ${WORK}/include_only.cu "#include <hisparse/hisparse.cuh>\n")
set(includes "")
foreach(dir IN LISTS INCLUDE_DIRS)
  list(APPEND includes -I${dir})
endforeach()
execute_process(
  COMMAND ${NVCC} -std=c++20 -arch=sm_90 -ptx ${includes} ${WORK}/include_only.cu -o ${WORK}/include_only.ptx
  RESULT_VARIABLE rc ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "nvcc failed on the umbrella header:\n${err}")
endif()
file(STRINGS ${WORK}/include_only.ptx entries REGEX "\\.entry ")
list(LENGTH entries n)
if(n GREATER 0)
  message(FATAL_ERROR "including hisparse.cuh compiles ${n} kernel(s):\n${entries}")
endif()
message(STATUS "including hisparse.cuh compiles no kernel")
