# Writes OUT: the checkout's commit and whether the tree differs from it, for
# the benchmarks' JSON context. Rewritten only when that changes, so builds
# stay incremental. Run as: cmake -DSOURCE=<tree> -DOUT=<header> -P this.
# A tree copied without its history (a GPU host) names its commit in the
# environment: HISPARSE_BUILD_COMMIT, and HISPARSE_BUILD_DIRTY (0 or 1).
if(DEFINED ENV{HISPARSE_BUILD_COMMIT})
  set(commit "$ENV{HISPARSE_BUILD_COMMIT}")
  set(dirty "$ENV{HISPARSE_BUILD_DIRTY}")
  if(dirty STREQUAL "")
    set(dirty 1)
  endif()
else()
  execute_process(COMMAND git -C "${SOURCE}" rev-parse HEAD OUTPUT_VARIABLE commit
    OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET RESULT_VARIABLE failed)
  if(failed)
    set(commit "unknown")
  endif()
  execute_process(COMMAND git -C "${SOURCE}" status --porcelain --untracked-files=no OUTPUT_VARIABLE changes
    ERROR_QUIET)
  if(changes STREQUAL "")
    set(dirty 0)
  else()
    set(dirty 1)
  endif()
endif()
set(text "#pragma once\n#define HISPARSE_BUILD_COMMIT \"${commit}\"\n#define HISPARSE_BUILD_DIRTY ${dirty}\n")
if(EXISTS "${OUT}")
  file(READ "${OUT}" old)
endif()
if(NOT old STREQUAL text)
  file(WRITE "${OUT}" "${text}")
endif()
